"""What this machine lacks is refused in one `error:` line before any model loads, and leaves no run folder: an
attention kernel the CPU cannot run, a tracker or backend whose package is not installed, a Hub upload without a
login; and config values that used to slip through (`seed: true`, an empty or `$VAR` output_dir)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from cli_support import assert_one_clean_line, changed, env, run_cli, write  # noqa: F401  (fixtures)
from conftest import REPO
from lmppo.config import Config, load_config
from lmppo.errors import ConfigError


def _refused(env, capsys, *names, **changes):
    tmp_path, base = env
    path = write(tmp_path, "config.yaml", data=changed(base, **changes))
    assert_one_clean_line(*run_cli(["train", path], capsys), *names)
    assert not (tmp_path / "run").exists()  # refused before the run folder is made


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: flex attention may run")
def test_flex_attention_on_a_cpu_is_refused_up_front(env, capsys):
    _refused(
        env, capsys, "`model.attn_implementation`", "flex_attention", "`auto`, `sdpa`, `eager`",
        model__attn_implementation="flex_attention",
    )  # fmt: skip


@pytest.mark.parametrize("tracker", ["mlflow", "wandb", "trackio", "swanlab"])
def test_a_tracker_whose_package_is_missing_is_refused_before_the_models_load(env, capsys, tracker):
    if importlib.util.find_spec(tracker) is not None:
        pytest.skip(f"{tracker} is installed here")
    _refused(
        env, capsys, "`log.trackers`", repr(tracker), f"pip install {tracker}", log__trackers=["tensorboard", tracker]
    )


def test_vllm_backend_where_it_cannot_run_is_refused_before_the_models_load(env, capsys):
    if importlib.util.find_spec("vllm") is not None and torch.cuda.is_available():
        pytest.skip("vllm runs here")
    names = ["`rollout.backend`", "'vllm'"] + ([] if not torch.cuda.is_available() else ["pip install 'lmppo[vllm]'"])
    _refused(env, capsys, *names, rollout__backend="vllm")


def test_lmppo_push_without_a_login_sends_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    env.update(PYTHONPATH=os.path.join(REPO, "src"), HF_HOME=str(tmp_path / "hf"), HF_TOKEN_PATH=str(tmp_path / "t"))
    env["HF_ENDPOINT"] = "http://127.0.0.1:9"  # nothing listens: a request would be a connection error instead
    out = subprocess.run(
        [sys.executable, "-m", "lmppo", "push", str(tmp_path / "run"), "--repo-id", "someone/x"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert "`--repo-id`" in lines[0] and "hf auth login" in lines[0] and "HF_TOKEN" in lines[0]


def test_seed_true_is_not_read_as_1(env, capsys):
    with pytest.raises(ConfigError, match=r"`seed` = True: must be an integer"):
        Config(seed=True)
    _refused(env, capsys, "`seed`", "True", "integer", seed=True)


def test_empty_output_dir_is_refused_and_leaves_no_lock(env, capsys, monkeypatch):
    tmp_path, _ = env
    monkeypatch.chdir(tmp_path)
    _refused(env, capsys, "`output_dir`", "''", "is empty", output_dir="")
    assert not any(name.startswith(".lmppo") for name in os.listdir(tmp_path))


def test_output_dir_expands_environment_variables(tmp_path, monkeypatch, env, capsys):
    monkeypatch.setenv("LMPPO_TEST_RUNS", str(tmp_path / "runs"))
    for form in ("$LMPPO_TEST_RUNS/a", "${LMPPO_TEST_RUNS}/a"):
        assert load_config(None, {"output_dir": form}).validate().output_dir == str(tmp_path / "runs" / "a")
    monkeypatch.delenv("LMPPO_TEST_RUNS")
    monkeypatch.chdir(tmp_path)
    _refused(env, capsys, "`output_dir`", "LMPPO_TEST_RUNS", "not set", output_dir="$LMPPO_TEST_RUNS/a")
    assert not any(name.startswith(("$", ".lmppo")) for name in os.listdir(tmp_path))


@pytest.mark.parametrize(
    "source,missing",
    [
        ("def multiply(a: int, b: int) -> int:\n    return a * b\n", "because it has no docstring"),
        ('def multiply(a, b: int) -> int:\n    """Multiplies.\n\n    Args:\n        a: one\n        b: two\n    """\n'
         "    return a * b\n", "Argument a is missing a type hint"),
    ],
)  # fmt: skip
def test_a_tool_the_model_cannot_be_told_about_is_refused_before_the_models_load(env, capsys, source, missing):
    """Not transformers' 30-line traceback after the models loaded: one line naming the tool and what it lacks."""
    tmp_path, _ = env
    (tmp_path / "my_tools.py").write_text(source)
    _refused(
        env, capsys, "`environment.tools`", "tool `multiply`", missing,
        environment__path="tools", environment__tools=[f"{tmp_path / 'my_tools.py'}:multiply"],
        rollout__stop_token="<|im_end|>", reward__sources=[],
    )  # fmt: skip
