"""Hub ids that download, and `lmppo push`, against a local stand-in of the Hub's HTTP API (tests/hub_standin.py),
never the network. `lmppo` runs in subprocesses with HF_ENDPOINT pointing at the stand-in (huggingface_hub reads
its endpoint when imported)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import yaml

from conftest import REPO  # noqa: E402
from hub_standin import HubStandIn
from lmppo.run.model_card import hub_card

SRC = os.path.join(REPO, "src")
TOKEN = "hf_standInToken0123456789abcdef"
REWARDS = "def length(completions, **kwargs):\n    return [len(c) / 10 for c in completions]\n"


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name), "rb") as fh:
            out[name] = fh.read()
    return out


def _lmppo(args, cwd, hub_url: str, **env) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    full.update(
        {
            "PYTHONPATH": SRC,
            "OMP_NUM_THREADS": "1",
            "HF_HOME": str(cwd / "hf_home"),
            "HF_ENDPOINT": hub_url,
            "HF_TOKEN": TOKEN,
            **env,
        }
    )
    if not full["HF_TOKEN"]:
        del full["HF_TOKEN"]  # no login at all (HF_HOME is empty too)
    return subprocess.run(
        [sys.executable, "-m", "lmppo", *args], cwd=cwd, env=full, capture_output=True, text=True, timeout=900
    )


@pytest.fixture(scope="module")
def hub():
    server = HubStandIn().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def hub_run(hub, tiny_model_dir, tmp_path_factory):
    """`lmppo train` of `model.policy: stand-in-org/tiny-llama` (LoRA, 4 iterations): the policy comes from the
    stand-in Hub, which also holds a pickle file that must not be downloaded; `push_to_hub` uploads the result."""
    files = _files(tiny_model_dir)
    hub.add_model("stand-in-org/tiny-llama", {**files, "pytorch_model.bin": b"not to be downloaded"})
    tmp = tmp_path_factory.mktemp("hub_run")
    (tmp / "prompts.txt").write_text("the movie was\nthis film is\nmy friend felt\nthe story seemed\n")
    (tmp / "rewards.py").write_text(REWARDS)
    cfg = {
        "output_dir": str(tmp / "run"),
        "total_episodes": 8,
        "precision": "fp32",
        "push_to_hub": "someone/from-train",
        "model": {"policy": "stand-in-org/tiny-llama", "lora": {"enabled": True, "r": 4}},
        "data": {"prompts": str(tmp / "prompts.txt"), "holdout": 2},
        "rollout": {"batch_size": 2, "max_new_tokens": 4, "stop_token": "none"},
        "reward": {"sources": [{"kind": "function", "path": f"{tmp / 'rewards.py'}:length"}]},
        "ppo": {"num_epochs": 1, "micro_batch_size": 2},
        "log": {"trackers": [], "sample_every": 0},
    }
    (tmp / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _lmppo(["train", "c.yaml"], tmp, hub.url)
    assert out.returncode == 0, out.stderr[-3000:]
    return tmp, files


def test_a_hub_id_downloads_and_trains(hub, hub_run):
    tmp, files = hub_run
    snapshots = tmp / "hf_home" / "hub" / "models--stand-in-org--tiny-llama" / "snapshots"
    (snapshot,) = os.listdir(snapshots)
    got = _files(str(snapshots / snapshot))
    assert set(got) == set(files) and all(got[k] == files[k] for k in files)  # the pickle file was not fetched
    gets = [r["path"] for r in hub.requests if r["method"] == "GET" and "/resolve/" in r["path"]]
    assert any(p.endswith("/model.safetensors") for p in gets) and not any(p.endswith(".bin") for p in gets)
    final = tmp / "run" / "final"
    assert sorted(os.listdir(final)) == ["policy", "policy-merged", "value"]
    card = (final / "policy-merged" / "README.md").read_text()
    assert "base_model: stand-in-org/tiny-llama" in card and "`stand-in-org/tiny-llama`" in card
    assert "## Held-out prompts, before and after training" in card  # lmppo train's summary added the table
    adapter_config = yaml.safe_load((final / "policy" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "stand-in-org/tiny-llama"


def test_a_downloaded_hub_id_resolves_offline_from_the_cache(hub_run):
    """Once downloaded, the id resolves with HF_HUB_OFFLINE=1 and no Hub at all (the local Hub cache)."""
    tmp, _files_ = hub_run
    code = (
        "from lmppo.models.loading import resolve_model_path\n"
        "print(resolve_model_path('stand-in-org/tiny-llama', 'model.policy'))"
    )
    env = {
        **os.environ,
        "PYTHONPATH": SRC,
        "OMP_NUM_THREADS": "1",
        "HF_HOME": str(tmp / "hf_home"),
        "HF_HUB_OFFLINE": "1",
        "HF_ENDPOINT": f"http://127.0.0.1:{_closed_port()}",
    }
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    folder = out.stdout.strip().splitlines()[-1]
    assert "models--stand-in-org--tiny-llama" in folder and os.path.isfile(os.path.join(folder, "model.safetensors"))


def test_push_to_hub_uploads_at_the_end_of_training(hub, hub_run):
    tmp, _files_ = hub_run
    (commit,) = [c for c in hub.commits if c["repo"] == "someone/from-train"]
    local = _files(str(tmp / "run" / "final" / "policy-merged"))
    assert set(commit["files"]) == set(local) and all(commit["files"][k] == local[k] for k in local if k != "README.md")
    assert commit["files"]["README.md"].decode() == hub_card(local["README.md"].decode(), "someone/from-train")
    assert b"## Held-out prompts, before and after training" in commit["files"]["README.md"]  # pushed after it


def test_push_to_hub_without_a_login_is_refused_before_training(tmp_path, tiny_model_dir):
    cfg = {"output_dir": str(tmp_path / "run"), "push_to_hub": "someone/x", "model": {"policy": tiny_model_dir}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = _lmppo(
        ["train", "c.yaml"],
        tmp_path,
        f"http://127.0.0.1:{_closed_port()}",
        HF_TOKEN="",
        HF_TOKEN_PATH=str(tmp_path / "no-token"),
    )
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "`push_to_hub`" in lines[0] and "hf auth login" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_push_to_hub_must_be_a_repo_id():
    from lmppo.config import Config
    from lmppo.errors import ConfigError

    cfg = Config()
    cfg.push_to_hub = "not a repo"
    with pytest.raises(ConfigError, match="push_to_hub"):
        cfg.validate()


def test_push_uploads_the_merged_folder(hub, hub_run):
    tmp, _files_ = hub_run
    n = len(hub.requests)
    out = _lmppo(["push", "run", "--repo-id", "someone/my-ppo-model", "--private"], tmp, hub.url)
    assert out.returncode == 0, out.stderr
    assert "pushed" in out.stdout and "someone/my-ppo-model" in out.stdout
    created = hub.created[-1]
    assert (created.get("organization"), created["name"]) == ("someone", "my-ppo-model")
    assert created.get("visibility") == "private" or created.get("private") is True, created
    commit = hub.commits[-1]
    assert commit["repo"] == "someone/my-ppo-model" and commit["revision"] == "main"
    local = _files(str(tmp / "run" / "final" / "policy-merged"))
    assert set(commit["files"]) == set(local) and all(commit["files"][k] == local[k] for k in local if k != "README.md")
    assert "model.safetensors" in commit["files"]
    card = commit["files"]["README.md"].decode()  # the card on the Hub loads from the repo, not from PATH
    assert (
        'from_pretrained("someone/my-ppo-model")' in card
        and '"PATH"' not in card
        and '"PATH"' in local["README.md"].decode()
    )
    assert card == hub_card(local["README.md"].decode(), "someone/my-ppo-model")
    for request in hub.requests[n:]:
        if request["method"] == "POST":  # every write carries the token, as a Bearer header
            assert (
                request["headers"].get("authorization", request["headers"].get("Authorization")) == f"Bearer {TOKEN}"
            ), request["path"]
    assert TOKEN not in out.stdout + out.stderr


def test_push_the_adapter_folder_on_request(hub, hub_run):
    tmp, _files_ = hub_run
    out = _lmppo(["push", "run", "--repo-id", "someone/my-adapter", "--folder", "policy"], tmp, hub.url)
    assert out.returncode == 0, out.stderr
    files = hub.commits[-1]["files"]
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert files["README.md"].startswith(b"---\nlibrary_name: peft\n")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("how", ["unreachable", "offline"])
def test_push_with_an_unreachable_hub_is_one_error_line(how, hub_run):
    tmp, _files_ = hub_run
    port = _closed_port()
    env = {"HF_HUB_OFFLINE": "1"} if how == "offline" else {}
    out = _lmppo(["push", "run", "--repo-id", "someone/x"], tmp, f"http://127.0.0.1:{port}", **env)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: lmppo push someone/x: the Hub cannot be reached"), lines
    assert ("HF_HUB_OFFLINE" if how == "offline" else f"127.0.0.1:{port}") in lines[0]
    assert TOKEN not in out.stderr


def test_push_with_a_refused_token(hub, hub_run):
    tmp, _files_ = hub_run
    hub.refused_token = "hf_refusedToken0123456789abcdef"
    try:
        out = _lmppo(["push", "run", "--repo-id", "someone/y"], tmp, hub.url, HF_TOKEN=hub.refused_token)
    finally:
        hub.refused_token = ""
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "refused the upload (HTTP 401)" in lines[0] and "hf auth login" in lines[0], lines
    assert "hf_refusedToken" not in out.stderr


def test_push_refuses_bad_input_before_any_request(tmp_path):
    from lmppo.apps.push import push
    from lmppo.errors import LmppoError

    with pytest.raises(LmppoError, match="not a Hub model id"):
        push(str(tmp_path), "not/a/repo")
    with pytest.raises(LmppoError, match="no such folder"):
        push(str(tmp_path / "missing"), "org/name")
    (tmp_path / "config.yaml").write_text("seed: 0\n")
    with pytest.raises(LmppoError, match="did not finish"):
        push(str(tmp_path), "org/name")
    (tmp_path / "final" / "policy").mkdir(parents=True)
    with pytest.raises(LmppoError, match="has no such folder"):
        push(str(tmp_path), "org/name", folder="policy-merged")


def test_the_hub_card_names_a_local_base_folder_by_its_last_part_only():
    card = (
        '# run\n\nmodel = AutoModelForCausalLM.from_pretrained("PATH")\n\n## Base model\n\n'
        "`/home/me/models/my-sft`\n\n## Training\n"
    )
    shown = hub_card(card, "me/my-model")
    assert 'from_pretrained("me/my-model")' in shown and "/home/me" not in shown
    assert "`my-sft` (a local model folder, not on the Hub)" in shown
    hub_base = "---\nbase_model: HuggingFaceTB/SmolLM2-135M\n" + card.replace(
        "/home/me/models/my-sft", "HuggingFaceTB/SmolLM2-135M"
    )
    assert "`HuggingFaceTB/SmolLM2-135M`" in hub_card(hub_base, "me/my-model")  # a Hub id stays as it is
