"""Without the extra `environments` (textarena, reasoning-gym): lmppo imports and runs, and a run that asks for a
TextArena game, a reasoning-gym task or its reward stops with one line naming the extra. The libraries are made
unimportable for real in a subprocess (a `sitecustomize` that sets their `sys.modules` entries to None, which
Python's import system reads as "not installed")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

SRC = str(Path(__file__).resolve().parents[2] / "src")
EXTRA = 'pip install "lmppo[environments]"'


def run_without_extra(tmp_path: Path, argv: list[str]) -> subprocess.CompletedProcess:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\nsys.modules['textarena'] = None\nsys.modules['reasoning_gym'] = None\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), SRC]), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)


def test_lmppo_imports_without_the_extra(tmp_path):
    code = (
        "import importlib.util, lmppo, lmppo.rewards.builtin, lmppo.environments.api, lmppo.data.prompts\n"
        "import lmppo.environments.textarena_games, lmppo.data.generated\n"
        "try:\n    import textarena\nexcept ImportError:\n    print('no textarena')\n"
    )
    out = run_without_extra(tmp_path, ["-c", code])
    assert out.returncode == 0 and out.stdout.strip() == "no textarena", out.stderr


@pytest.mark.parametrize(
    "change, needs",
    [
        ({"environment": {"path": "textarena:GuessTheNumber-v0"}}, "environment.path `textarena:GuessTheNumber-v0`"),
        ({"data": {"prompts": "reasoning_gym:basic_arithmetic"}}, "data.prompts `reasoning_gym:basic_arithmetic`"),
    ],
)
def test_a_run_that_needs_the_extra_is_one_line_naming_it(tmp_path, tiny_model_dir, change, needs):
    (tmp_path / "prompts.txt").write_text("one\ntwo\nthree\nfour\n")
    config = {
        "output_dir": str(tmp_path / "run"),
        "total_episodes": 4,
        "model": {"policy": tiny_model_dir},
        "data": {"prompts": str(tmp_path / "prompts.txt")},
        "rollout": {"batch_size": 4, "max_new_tokens": 4},
        "ppo": {"micro_batch_size": 2, "num_minibatches": 2},
        "reward": {"sources": [{"kind": "function", "path": "lmppo.rewards.builtin:number_only"}]},
        "log": {"trackers": []},
    }
    for section, fields in change.items():
        config.setdefault(section, {}).update(fields)
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    out = run_without_extra(tmp_path, ["-m", "lmppo", "train", "c.yaml"])
    err = out.stderr.strip()
    assert out.returncode == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("error: ") and needs in err and EXTRA in err, err
    assert not (tmp_path / "run").exists()  # before the run folder, so before any model loads


def test_the_reward_without_the_extra_names_it(tmp_path):
    code = (
        "from lmppo.rewards.builtin import reasoning_gym\n"
        "from lmppo.errors import LmppoError\n"
        "try:\n    reasoning_gym(['1'], [{'answer': '1'}])\n"
        "except LmppoError as err:\n    print(err)\n"
    )
    out = run_without_extra(tmp_path, ["-c", code])
    assert out.returncode == 0, out.stderr
    assert (
        out.stdout.strip()
        == f"the reward `reasoning_gym` needs the package `reasoning-gym`, which is not installed: {EXTRA}"
    )
