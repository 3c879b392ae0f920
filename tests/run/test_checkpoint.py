"""Checkpoint files: layout, manifest checks, pruning, corrupt and half-written checkpoints, a full disk,
non-finite updates and weights, protection of an existing run, and no secret in anything written."""

from __future__ import annotations

import errno
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
import yaml

from lmppo.config import Config, RewardSourceConfig
from lmppo.errors import CheckpointError, ConfigError, StorageError, TrainingError
from lmppo.redact import redact_text
from lmppo.run.config_file import redacted_config_dict
from lmppo.run.folder import MANIFEST, list_checkpoints
from lmppo.run.manifest import latest_checkpoint, verify_checkpoint
from lmppo.training.trainer import PPOTrainer
from train_worker import api_objects, make_config, read_jsonl


def train(tmp_path, tokenizer, iterations=3, name="run", reward=None, **fields) -> PPOTrainer:
    fields.setdefault("checkpoint__every", 1)
    objects = api_objects(tokenizer) if reward is None else api_objects(tokenizer, reward)
    trainer = PPOTrainer(make_config(str(tmp_path / name), iterations, **fields), **objects)
    trainer.train()
    return trainer


def test_layout_manifest_and_keep_last(tmp_path, tokenizer):
    trainer = train(tmp_path, tokenizer, iterations=3, checkpoint__keep_last=2)
    run = trainer.config.output_dir
    assert [i for i, _ in list_checkpoints(run)] == [3, 2]
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["iter-00000002", "iter-00000003"]
    path = latest_checkpoint(run)
    files = sorted(os.listdir(path))
    assert files == sorted(
        [
            "manifest.json",
            "optimizer.pt",
            "rng-rank0.json",
            "rng-rank0.safetensors",
            "state.json",
            "trained.safetensors",
        ]
    )
    manifest = verify_checkpoint(path)
    assert manifest["iteration"] == 3 and sorted(manifest["files"]) == [f for f in files if f != MANIFEST]
    # no pickle: tensors in safetensors, the optimizer loads with weights_only=True, the rest is JSON
    torch.load(os.path.join(path, "optimizer.pt"), weights_only=True)
    state = json.load(open(os.path.join(path, "state.json")))
    for key in (
        "iteration",
        "episode",
        "train_seconds",
        "nonfinite_in_a_row",
        "stream",
        "kl_controller",
        "score_moments",
        "scheduler",
        "config",
        "reference",
        "frozen_fingerprint",
    ):
        assert key in state, key
    assert state["iteration"] == 3 and state["episode"] == 24 and state["stream"] == trainer.stream.state_dict()
    assert state["kl_controller"]["value"] == trainer.kl_controller.coef  # the adaptive coefficient, exactly
    from safetensors.torch import load_file

    stored = load_file(os.path.join(path, "trained.safetensors"))
    for name, p in trainer.actor.named_parameters():
        assert torch.equal(stored["actor." + name], p), name


def test_corrupt_or_half_written_checkpoints_are_skipped_with_a_warning(tmp_path, tokenizer):
    run = train(tmp_path, tokenizer, iterations=3, checkpoint__keep_last=3).config.output_dir
    ck = {i: p for i, p in list_checkpoints(run)}
    data = bytearray(open(os.path.join(ck[3], "trained.safetensors"), "rb").read())
    data[-5] ^= 0xFF  # one flipped bit in a weight
    open(os.path.join(ck[3], "trained.safetensors"), "wb").write(bytes(data))
    with open(os.path.join(ck[2], MANIFEST), "w") as fh:
        fh.write('{"format": 1, "files": ')  # torn manifest
    with pytest.warns(UserWarning) as caught:
        assert latest_checkpoint(run) == ck[1]
    messages = " | ".join(str(w.message) for w in caught)
    assert "sha256" in messages and "unreadable" in messages
    os.unlink(os.path.join(ck[1], MANIFEST))  # a folder without manifest is never used
    with pytest.warns(UserWarning, match="no manifest.json"):
        assert latest_checkpoint(run) is None
    with pytest.raises(CheckpointError, match="corrupt"):
        verify_checkpoint(ck[3])


def test_resume_skips_a_corrupt_newest_checkpoint_and_sets_it_aside(tmp_path, tokenizer):
    run = train(tmp_path, tokenizer, iterations=3, checkpoint__keep_last=3).config.output_dir
    newest = dict(list_checkpoints(run))[3]
    os.truncate(os.path.join(newest, "optimizer.pt"), 10)
    with pytest.warns(UserWarning, match="bytes"):
        trainer = PPOTrainer.resume(run, **api_objects(tokenizer))
    assert trainer.iteration == 2
    assert [i for i, _ in list_checkpoints(run)] == [2, 1]
    assert any(n.startswith("corrupt-iter-00000003") for n in os.listdir(os.path.join(run, "checkpoints")))
    trainer.train()
    assert [i for i, _ in list_checkpoints(run)] == [3, 2, 1]


def test_full_disk_keeps_the_previous_checkpoint_and_says_where(tmp_path, tokenizer, monkeypatch):
    real_save = torch.save
    calls = {"n": 0}

    def save_then_disk_full(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] < 2:
            return real_save(obj, path, *args, **kwargs)
        with open(path, "wb") as fh:  # half of the file reaches the disk, then the disk is full
            fh.write(b"\0" * 100)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(torch, "save", save_then_disk_full)
    trainer = PPOTrainer(make_config(str(tmp_path / "run"), 3, checkpoint__every=1), **api_objects(tokenizer))
    with pytest.raises(StorageError) as err:
        trainer.train()
    message = str(err.value)
    root = os.path.join(str(tmp_path / "run"), "checkpoints")
    assert "disk is full" in message and root in message and "iter-00000001 is intact" in message
    assert "\n" not in message
    assert sorted(os.listdir(root)) == ["iter-00000001"]  # no half-written folder left behind
    monkeypatch.setattr(torch, "save", real_save)
    resumed = PPOTrainer.resume(str(tmp_path / "run"), **api_objects(tokenizer))
    assert resumed.iteration == 1
    resumed.train()
    assert resumed.iteration == 3


# ----------------------------------------------------------------------------- non-finite updates


def poison_gradients(trainer: PPOTrainer, backward_calls: set[int]) -> dict:
    """NaN into the LM head's gradient on the given backward calls (counted from 1 over the whole run)."""
    count = {"n": 0}

    def hook(grad):
        count["n"] += 1
        return grad * float("nan") if count["n"] in backward_calls else grad

    trainer.policy.lm_head.weight.register_hook(hook)
    return count


def all_finite(trainer: PPOTrainer) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in trainer.actor.parameters())


def test_nonfinite_update_is_skipped_counted_and_never_checkpointed(tmp_path, tokenizer):
    # 2 epochs x 2 minibatches = 4 optimizer steps an iteration, one micro-batch (backward call) each
    trainer = PPOTrainer(make_config(str(tmp_path / "run"), 3, checkpoint__every=1), **api_objects(tokenizer))
    poison_gradients(trainer, {1, 7, 8})  # step 1 of iteration 1; steps 3 and 4 of iteration 2
    history = trainer.train()
    assert [m["update/skipped_nonfinite"] for m in history] == [1.0, 2.0, 0.0]
    assert all_finite(trainer)
    state = json.load(open(os.path.join(dict(list_checkpoints(trainer.config.output_dir))[2], "state.json")))
    assert state["nonfinite_in_a_row"] == 2  # the streak goes on across iterations and through a resume
    logged = read_jsonl(os.path.join(trainer.config.output_dir, "metrics.jsonl"))
    assert [m["update/skipped_nonfinite"] for m in logged] == [1.0, 2.0, 0.0]


def test_too_many_nonfinite_updates_in_a_row_stop_the_run(tmp_path, tokenizer, capsys):
    trainer = PPOTrainer(
        make_config(str(tmp_path / "run"), 3, checkpoint__every=1, ppo__max_nonfinite_updates=3),
        **api_objects(tokenizer),
    )
    poison_gradients(trainer, set(range(5, 100)))  # every update from iteration 2 on
    with pytest.raises(TrainingError, match="3 updates in a row"):
        trainer.train()
    assert all_finite(trainer)
    assert [i for i, _ in list_checkpoints(trainer.config.output_dir)] == [1]
    assert trainer.iteration == 1


def test_nan_weights_are_never_written(tmp_path, tokenizer):
    trainer = train(tmp_path, tokenizer, iterations=1)
    before = latest_checkpoint(trainer.config.output_dir)
    with torch.no_grad():
        trainer.policy.lm_head.weight[0, 0] = float("nan")
    trainer.iteration = 2
    with pytest.raises(CheckpointError, match=r"refusing.*lm_head.*NaN or inf.*iter-00000001 is kept"):
        trainer.save_checkpoint()
    assert [p for _, p in list_checkpoints(trainer.config.output_dir)] == [before]
    verify_checkpoint(before)


# ----------------------------------------------------------------------------- the run folder


def test_existing_run_is_not_overwritten_unless_asked(tmp_path, tokenizer):
    first = train(tmp_path, tokenizer, iterations=1, log__sample_every=1)
    run = first.config.output_dir
    with pytest.raises(ConfigError) as err:
        PPOTrainer(make_config(run, 1), **api_objects(tokenizer))
    assert "`output_dir`" in str(err.value) and "--resume" in str(err.value) and "overwrite: true" in str(err.value)
    assert "metrics.jsonl" in str(err.value) and "checkpoints" in str(err.value)
    # overwrite: the old run's files go (its checkpoints would otherwise be resumed later)
    trainer = PPOTrainer(make_config(run, 1, overwrite=True), **api_objects(tokenizer))
    assert sorted(n for n in os.listdir(run) if not n.startswith(".")) == ["config.yaml"]
    trainer.train()
    assert len(read_jsonl(os.path.join(run, "metrics.jsonl"))) == 1


def test_only_our_config_yaml_is_reused_without_overwrite(tmp_path, tokenizer):
    run = tmp_path / "run"
    with pytest.raises(ConfigError):  # stopped after writing config.yaml, before any work: may start again
        PPOTrainer(make_config(str(run), 1, rollout__stop_token="no-such-token-here"), **api_objects(tokenizer))
    assert [n for n in os.listdir(run) if not n.startswith(".")] == ["config.yaml"]
    PPOTrainer(make_config(str(run), 1), **api_objects(tokenizer))
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "config.yaml").write_text("my: own file\n")
    with pytest.raises(ConfigError, match="config.yaml"):
        PPOTrainer(make_config(str(foreign), 1), **api_objects(tokenizer))
    assert (foreign / "config.yaml").read_text() == "my: own file\n"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="is a file"):
        PPOTrainer(make_config(str(tmp_path / "file"), 1), **api_objects(tokenizer))


# ----------------------------------------------------------------------------- secrets


def test_redaction_masks_credentials_and_keeps_config_fields():
    assert redact_text("https://alice:s3cr3t@host/x?token=abc&n=1") == "https://***@host/x?token=***&n=1"
    assert redact_text("HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz0123 run") == "HF_TOKEN=*** run"
    assert redact_text("key sk-abcdefghijklmnopqrstuvwx1234") == "key ***"
    assert redact_text("Authorization: Bearer abcdefghijklmnop") == "Authorization: Bearer ***"
    assert redact_text("/data/prompts.jsonl") == "/data/prompts.jsonl"
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.reward.sources = [RewardSourceConfig(kind="http", path="https://bob:hunter2@rm.example/score?api_key=K9")]
    cfg.rollout.generation_kwargs = {"api_key": "zzz", "use_cache": True}
    cfg.rollout.stop_token = "<|end|>"
    out = redacted_config_dict(cfg)
    text = json.dumps(out)
    assert "hunter2" not in text and "K9" not in text and "zzz" not in text
    assert out["reward"]["sources"][0]["path"] == "https://***@rm.example/score?api_key=***"
    assert out["rollout"]["generation_kwargs"] == {"api_key": "***", "use_cache": True}
    assert out["rollout"]["stop_token"] == "<|end|>" and out["rollout"]["max_new_tokens"] == 24
    assert cfg.reward.sources[0].path.startswith("https://bob:hunter2@")  # the config itself is untouched


class _Scores(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        answer = json.dumps({"scores": [len(c) / 20.0 for c in body["completions"]]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


@pytest.fixture()
def score_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scores)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_no_secret_reaches_the_run_folder_and_resume_asks_for_it(tmp_path, tokenizer, score_server):
    url = f"http://alice:s3cr3t-pw@{score_server}/score?token=t0k3n-value"
    cfg = make_config(str(tmp_path / "run"), 1, log__trackers=["tensorboard"], log__sample_every=1)
    cfg.reward.sources = [RewardSourceConfig(kind="http", path=url, name="rm", timeout=5.0)]
    objects = api_objects(tokenizer)
    objects.pop("reward_functions")
    PPOTrainer(cfg, **objects).train()
    written = []
    for root, _dirs, files in os.walk(tmp_path / "run"):
        for name in files:
            written.append(os.path.join(root, name))
            data = open(os.path.join(root, name), "rb").read()
            assert b"s3cr3t-pw" not in data and b"t0k3n-value" not in data, name
    assert any("events.out.tfevents" in w for w in written)  # the tracker got the (masked) config
    saved = yaml.safe_load(open(tmp_path / "run" / "config.yaml"))
    assert saved["reward"]["sources"][0]["path"] == f"http://***@{score_server}/score?token=***"
    # the masked config cannot score: resuming from it asks for the config again
    objects = api_objects(tokenizer)
    objects.pop("reward_functions")
    with pytest.raises(ConfigError, match=r"reward\.sources\[0\]\.path.*masked"):
        PPOTrainer.resume(str(tmp_path / "run"), **objects)
    cfg.total_episodes = 16
    resumed = PPOTrainer.resume(str(tmp_path / "run"), config=cfg, **objects)
    resumed.train()
    assert resumed.iteration == 2
