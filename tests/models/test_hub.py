"""Hugging Face Hub ids wherever a model path goes: `ORG/NAME` (a local folder of that name wins) and `hub:ORG/NAME`.

This machine has no Hub access, which is the case tested for real: `HF_HUB_OFFLINE=1` (set by conftest for the
in-process tests) and an `HF_ENDPOINT` on a closed local port (in subprocesses, since huggingface_hub reads its
endpoint when imported). Downloads that succeed are tested against a local stand-in of the Hub in test_hub_push.py.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import REPO  # noqa: E402
from lmppo.config import Config, hub_repo_id, is_hub_repo_id
from lmppo.errors import ConfigError
from lmppo.models.loading import fetch_hub_models, resolve_model_path

SRC = os.path.join(REPO, "src")
ABSENT = "lmppo-test-org/absent-model"  # a valid id that no cache holds


def test_repo_id_rules():
    for ok in ("Qwen/Qwen2.5-0.5B", "HuggingFaceTB/SmolLM2-135M-Instruct", "org/name_1.v2"):
        assert is_hub_repo_id(ok, bare=True), ok
    assert is_hub_repo_id("gpt2") and not is_hub_repo_id("gpt2", bare=True)  # a bare single name is a folder name
    for bad in (
        "a/b/c",
        "./x",
        "../x",
        "/abs/path",
        "org//name",
        "org/na--me",
        "org/na..me",
        "org/name.git",
        "org/-name",
        "org/name.",
        "org name/x",
        "~/models",
        "",
        "x" * 50 + "/" + "y" * 50,
    ):
        assert not is_hub_repo_id(bad, bare=True), bad


def test_local_folder_wins_over_a_hub_id(tmp_path, monkeypatch, tiny_model_dir):
    monkeypatch.chdir(tmp_path)
    assert hub_repo_id("myorg/mymodel") == "myorg/mymodel"
    shutil.copytree(tiny_model_dir, tmp_path / "myorg" / "mymodel")
    assert hub_repo_id("myorg/mymodel") is None
    assert resolve_model_path("myorg/mymodel", "model.policy") == "myorg/mymodel"  # no Hub call (offline here)
    assert hub_repo_id("hub:myorg/mymodel") == "myorg/mymodel"  # the explicit form always means the Hub


def test_validation_accepts_hub_ids_and_refuses_what_is_neither(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for value in ("Qwen/Qwen2.5-0.5B", "hub:Qwen/Qwen2.5-0.5B", "hub:gpt2"):
        cfg = Config()
        cfg.model.policy = value
        cfg.validate()
    for value in ("no_such_dir", "a/b/c", "./missing/model"):
        cfg = Config()
        cfg.model.policy = value
        with pytest.raises(ConfigError, match="no such folder") as err:
            cfg.validate()
        assert "`model.policy`" in str(err.value) and value in str(err.value)
    cfg = Config()
    cfg.model.policy = "hub:a/b/c"
    with pytest.raises(ConfigError, match="not a valid Hub model id"):
        cfg.validate()


@pytest.mark.parametrize("field", ["model.policy", "model.tokenizer", "value.init_from", "reward.sources[1].path"])
def test_offline_hub_id_is_one_error_naming_field_and_id(field, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 (conftest): each model field's Hub id fails before any model loads, naming itself."""
    monkeypatch.chdir(tmp_path)
    cfg = Config()
    cfg.reward.sources.append(cfg.reward.sources[0].__class__(kind="model", path="local_rm"))
    os.mkdir("local_rm")  # a local reward model folder is not a Hub id: not fetched
    if field == "model.policy":
        cfg.model.policy = ABSENT
    elif field == "model.tokenizer":
        cfg.model.tokenizer = "hub:" + ABSENT
    elif field == "value.init_from":
        cfg.value.mode, cfg.value.init_from = "critic", ABSENT
    else:
        cfg.reward.sources[1].path = ABSENT
    cfg.validate()
    with pytest.raises(ConfigError) as err:
        fetch_hub_models(cfg)
    text = str(err.value)
    assert f"`{field}`" in text and ABSENT in text and "the Hub cannot be reached" in text and "HF_HUB_OFFLINE" in text
    assert "\n" not in text


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lmppo(args, tmp_path, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    full.update(PYTHONPATH=SRC, OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf_home"), **env)
    return subprocess.run(
        [sys.executable, "-m", "lmppo", *args], cwd=tmp_path, env=full, capture_output=True, text=True, timeout=600
    )


def _error_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.strip()]


@pytest.mark.parametrize("how", ["offline", "unreachable endpoint"])
def test_train_with_an_unreachable_hub(how, tmp_path, tiny_model_dir):
    """`lmppo train --model.policy ORG/NAME` for real: one error line, nothing written, exit code 2."""
    port = _closed_port()
    env = {"HF_HUB_OFFLINE": "1"} if how == "offline" else {"HF_ENDPOINT": f"http://127.0.0.1:{port}"}
    (tmp_path / "p.txt").write_text("the movie was\nthis film is\n")
    cfg = {
        "output_dir": str(tmp_path / "run"),
        "data": {"prompts": str(tmp_path / "p.txt")},
        "reward": {"sources": [{"kind": "model", "path": tiny_model_dir}]},
        "log": {"trackers": []},
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _lmppo(["train", "c.yaml", "--model.policy", "Qwen/Qwen2.5-0.5B"], tmp_path, **env)
    assert out.returncode == 2, out.stderr
    errors = [ln for ln in _error_lines(out.stderr) if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
    assert "`model.policy`" in errors[0] and "'Qwen/Qwen2.5-0.5B'" in errors[0]
    assert "the Hub cannot be reached" in errors[0]
    assert ("HF_HUB_OFFLINE is set" if how == "offline" else f"127.0.0.1:{port}") in errors[0], errors[0]
    assert not (tmp_path / "run").exists()  # refused before the output folder is made


def test_eval_with_an_unreachable_hub(tmp_path):
    out = _lmppo(["eval", ABSENT], tmp_path, HF_ENDPOINT=f"http://127.0.0.1:{_closed_port()}")
    assert out.returncode == 2, out.stderr
    lines = _error_lines(out.stderr)
    assert len(lines) == 1 and lines[0].startswith("error:") and ABSENT in lines[0], out.stderr
    assert "the Hub cannot be reached" in lines[0]
    out = _lmppo(["eval", "no/such/folder"], tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 2 and "no such folder" in out.stderr, out.stderr
    out = _lmppo(["eval", "hub:not//valid"], tmp_path, HF_HUB_OFFLINE="1")
    assert out.returncode == 2 and "not a valid Hub model id" in out.stderr and "Traceback" not in out.stderr, (
        out.stderr
    )
