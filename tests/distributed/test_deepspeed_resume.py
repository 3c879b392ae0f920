"""Checkpoints and exact resume under DeepSpeed ZeRO-2 and ZeRO-3 (and plain DDP): 2 CPU processes (torchrun, gloo),
the real
`lmppo train` command (tests/zero_worker.py), a tiny Llama loaded from a folder (under ZeRO-3: partitioned as it
loads), a checkpoint after every iteration.

- A run SIGKILLed (torchrun and both workers, as a machine that dies) after its first checkpoint and resumed with
  `--resume` ends with the same metrics.jsonl rows (wall-clock fields aside), the same samples.jsonl, the same final
  model and the same DeepSpeed optimizer shards as an uninterrupted run, bit for bit.
- A checkpoint whose write is interrupted on one process (process 1 SIGKILLed after writing its shards, before the
  barrier) is never published; a published checkpoint with a really truncated shard file fails verification and
  the resume uses the one before it; both resumes still end bit-identical.
- A resume with another number of processes or another ZeRO stage is refused with one `error:` line naming both.
- ZeRO-3's final model is the full model as an ordinary Hugging Face folder (from_pretrained, `lmppo eval`); with
  LoRA, the adapter.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml
from test_zero import needs_deepspeed

from conftest import TESTS  # noqa: E402
from lmppo.run.folder import list_checkpoints
from lmppo.run.manifest import latest_checkpoint
from train_worker import comparable, read_jsonl

sys.path.insert(0, os.path.join(TESTS, "..", "benchmarks", "tools"))
from fault_injection import process_tree  # noqa: E402  (torchrun starts its workers in sessions of their own)

pytestmark = pytest.mark.slow  # real processes, each training a model: minutes in all (make test-fast skips them)

HERE = TESTS
WORKER = os.path.join(HERE, "zero_worker.py")
ITERATIONS = 4
SETTINGS = {
    # shared value head, an EMA reference moving every iteration, score normalisation, linear decay
    "zero2": {
        "value": {"mode": "shared"},
        "reference": {"mode": "ema", "every": 1},
        "reward_normalize": True,
        "lr_schedule": "linear",
    },
    # plain DDP (whole tensors in the checkpoint), with the per-process score normaliser of zero2
    "ddp": {
        "value": {"mode": "shared"},
        "reference": {"mode": "ema", "every": 1},
        "reward_normalize": True,
        "lr_schedule": "linear",
    },
    # separate critic (one engine with the actor), a reference synced every 2 iterations (its shards per process)
    "zero3": {
        "value": {"mode": "critic"},
        "reference": {"mode": "sync", "every": 2},
        "reward_normalize": False,
        "lr_schedule": "cosine",
    },
    # LoRA on the partitioned base: the engine holds the adapters and the value head; the final model is the adapter
    "zero3-lora": {
        "value": {"mode": "shared"},
        "reference": {"mode": "frozen"},
        "lora": True,
        "reward_normalize": False,
        "lr_schedule": "constant",
    },
}
REWARD = "def length(prompts, completions):\n    return [len(c) / 20.0 for c in completions]\n"
PROMPTS = [
    "the movie was",
    "this film is",
    "my friend felt",
    "the story seemed",
    "a critic said",
    "the ending was",
    "the actor looked",
    "we left early because",
]


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    from conftest import tiny_llama
    from helpers_tokenizers import make_bpe_tokenizer

    root = tmp_path_factory.mktemp("zero_assets")
    tok = make_bpe_tokenizer()
    tiny_llama(tok).save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    (root / "reward.py").write_text(REWARD)
    return {"root": root, "straight": {}}


def config_file(assets, stage: str, run, iterations: int = ITERATIONS) -> str:
    root, s = assets["root"], SETTINGS[stage]
    config = {
        "output_dir": str(run),
        "total_episodes": 8 * iterations,
        "seed": 0,
        "precision": "fp32",
        "device": "cpu",
        "deepspeed": {"ddp": "", "zero3-lora": "zero3"}.get(stage, stage),
        "model": {"policy": str(root / "model"), "lora": {"enabled": bool(s.get("lora")), "r": 4}},
        "data": {"prompts": str(root / "prompts.txt"), "holdout": 0},
        "rollout": {"batch_size": 8, "max_new_tokens": 6, "temperature": 1.0},
        "reward": {
            "sources": [{"kind": "function", "path": f"{root / 'reward.py'}:length"}],
            "normalize": s["reward_normalize"],
        },
        "value": s["value"],
        "reference": s["reference"],
        "ppo": {
            "num_epochs": 2,
            "num_minibatches": 2,
            "micro_batch_size": 2,
            "learning_rate": 1e-3,
            "lr_schedule": s["lr_schedule"],
        },
        "log": {"trackers": [], "sample_every": 1, "num_samples": 2, "progress": False},
        "checkpoint": {"every": 1, "keep_last": 2},
    }
    path = str(run) + ".yaml"
    with open(path, "w") as fh:
        yaml.safe_dump(config, fh)
    return path


def launch(args: list[str], log, nproc: int = 2, **env) -> subprocess.Popen:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the Python interpreter")
    environ = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **env,
        "PYTHONPATH": os.pathsep.join([HERE, os.path.join(HERE, "..", "src"), os.environ.get("PYTHONPATH", "")]),
    }
    with open(log, "w") as fh:
        return subprocess.Popen(
            [torchrun, "--standalone", "--nproc_per_node", str(nproc), WORKER, *args],
            env=environ,
            stdout=subprocess.DEVNULL,
            stderr=fh,
        )


def finish(proc: subprocess.Popen, log) -> str:
    proc.wait(timeout=600)
    text = open(log, encoding="utf-8", errors="replace").read()
    assert proc.returncode == 0, text[-4000:]
    return text


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL torchrun and its workers at once, as when the machine dies."""
    for pid in process_tree(proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(timeout=60)


def wait_for(path, proc: subprocess.Popen, log, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if proc.poll() is not None:
            raise AssertionError(
                f"the run ended before {path} appeared:\n" + open(log, errors="replace").read()[-4000:]
            )
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.01)


def straight_run(assets, stage: str):
    """The uninterrupted run of `stage`, run once per module. A failed run is remembered: the later tests that need
    it fail with its own message, not with "already holds a run" from a second attempt in the same folder."""
    if stage not in assets["straight"]:
        run = assets["root"] / f"straight-{stage}"
        try:
            finish(launch(["train", config_file(assets, stage, run)], str(run) + ".log"), str(run) + ".log")
        except AssertionError as failure:
            assets["straight"][stage] = failure
            raise
        assets["straight"][stage] = run
    done = assets["straight"][stage]
    if isinstance(done, AssertionError):
        raise AssertionError(f"the uninterrupted {stage} run failed earlier in this module:\n{done}")
    return done


def shard_tensors(checkpoint) -> dict:
    """Every tensor of a checkpoint: DeepSpeed's files (its own pickles, loaded in full; the fp32 master partitions
    as DeepSpeed's zero_to_fp32 rebuilds them, since their padding slots hold whatever memory held), the reference
    shards, DDP's whole tensors."""
    from safetensors.torch import load_file

    out = {}

    def walk(obj, key):
        if "fp32_flat_groups" in key or "single_partition_of_fp32_groups" in key:
            return  # padded partitions: compared through zero_to_fp32 below
        if isinstance(obj, torch.Tensor):
            out[key] = obj
        elif isinstance(obj, dict):
            for k, v in obj.items():
                walk(v, f"{key}/{k}")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(v, f"{key}/{i}")

    if (checkpoint / "deepspeed").is_dir():
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        for name in sorted(os.listdir(checkpoint / "deepspeed")):
            if name.endswith(".pt"):
                walk(torch.load(checkpoint / "deepspeed" / name, map_location="cpu", weights_only=False), name)
        walk(get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="deepspeed"), "fp32 weights")
    else:  # DDP: whole tensors
        walk(torch.load(checkpoint / "optimizer.pt", weights_only=True), "optimizer.pt")
    for name in sorted(os.listdir(checkpoint)):
        if name.startswith("reference") or name == "trained.safetensors":
            walk(load_file(str(checkpoint / name)), name)
    return out


def assert_same_end(straight, run) -> None:
    a, b = read_jsonl(str(straight / "metrics.jsonl")), read_jsonl(str(run / "metrics.jsonl"))
    assert [m["iteration"] for m in b] == list(range(1, ITERATIONS + 1))
    assert [comparable(m) for m in a] == [comparable(m) for m in b]
    assert read_jsonl(str(straight / "samples.jsonl")) == read_jsonl(str(run / "samples.jsonl"))
    from safetensors.torch import load_file

    files = sorted(p.relative_to(straight / "final") for p in (straight / "final").rglob("*.safetensors"))
    assert files == sorted(p.relative_to(run / "final") for p in (run / "final").rglob("*.safetensors"))
    for f in files:
        x, y = load_file(str(straight / "final" / f)), load_file(str(run / "final" / f))
        assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f
    last = f"checkpoints/iter-{ITERATIONS:08d}"
    x, y = shard_tensors(straight / last), shard_tensors(run / last)
    assert x and x.keys() == y.keys()
    for k in x:
        assert x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]), k


@pytest.mark.parametrize(
    "stage",
    [
        pytest.param("zero2", marks=needs_deepspeed),
        pytest.param("zero3", marks=needs_deepspeed),
        pytest.param("zero3-lora", marks=needs_deepspeed),
        "ddp",
    ],
)
def test_sigkilled_run_resumes_bit_identical(tmp_path, assets, stage):
    straight = straight_run(assets, stage)
    files = sorted(os.listdir(straight / "checkpoints" / f"iter-{ITERATIONS:08d}"))
    assert {"rng-rank0.json", "rng-rank1.json", "state.json"} <= set(files)
    assert ("trained.safetensors" in files) == (stage == "ddp") == ("deepspeed" not in files)
    if stage == "zero3":  # the synced reference: one file of shards per process
        assert {"reference-rank0.safetensors", "reference-rank1.safetensors"} <= set(files)
    run, log = tmp_path / "run", str(tmp_path / "run.log")
    proc = launch(["train", config_file(assets, stage, run)], log)
    wait_for(run / "checkpoints" / "iter-00000001" / "manifest.json", proc, log)
    kill_tree(proc)
    assert proc.returncode == -signal.SIGKILL and not (run / "final").exists()
    finish(launch(["train", "--resume", str(run)], log + ".resume"), log + ".resume")
    assert_same_end(straight, run)
    assert [i for i, _ in list_checkpoints(str(run))] == [ITERATIONS, ITERATIONS - 1]  # keep_last 2
    if stage.startswith("zero3"):
        assert_final_is_the_full_model(run, lora=stage == "zero3-lora")


def assert_final_is_the_full_model(run, lora: bool) -> None:
    """ZeRO-3's final/policy is an ordinary Hugging Face folder (the adapter, with LoRA) holding the full weights:
    what DeepSpeed's own zero_to_fp32 rebuilds from the last checkpoint's shards; `lmppo eval` evaluates it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from lmppo.apps.cli import main

    full = get_fp32_state_dict_from_zero_checkpoint(
        str(run / "checkpoints" / f"iter-{ITERATIONS:08d}"), tag="deepspeed"
    )
    if lora:  # PEFT's adapter file names drop the adapter name (`lora_A.default.weight` -> `lora_A.weight`)
        adapter = load_file(str(run / "final" / "policy" / "adapter_model.safetensors"))
        names = {k: "policy." + re.sub(r"\.(lora_[AB])\.weight$", r".\1.default.weight", k) for k in adapter}
        assert adapter and all(torch.equal(full[names[k]], v) for k, v in adapter.items())
    else:
        policy = AutoModelForCausalLM.from_pretrained(str(run / "final" / "policy")).state_dict()
        assert policy and all(torch.equal(full["policy." + k], v) for k, v in policy.items())
    assert main(["eval", str(run), "--num-prompts", "4", "--output", str(run / "eval.json")]) == 0


@needs_deepspeed
def test_checkpoint_cut_short_on_one_process_is_never_loaded(tmp_path, assets):
    stage = "zero2"
    straight = straight_run(assets, stage)
    run, log = tmp_path / "run", str(tmp_path / "run.log")
    marker = str(tmp_path / "stalled")
    proc = launch(["train", config_file(assets, stage, run)], log, STALL_IN_WRITE="1:2", STALL_MARKER=marker)
    wait_for(marker, proc, log)
    os.kill(int(open(marker).read()), signal.SIGKILL)  # process 1, its shards written, the barrier not reached
    proc.wait(timeout=120)  # torchrun stops process 0 and fails
    assert proc.returncode != 0
    assert [i for i, _ in list_checkpoints(str(run))] == [1]  # iteration 2's checkpoint was never published
    assert latest_checkpoint(str(run)).endswith("iter-00000001")
    finish(launch(["train", "--resume", str(run)], log + ".resume"), log + ".resume")
    assert_same_end(straight, run)

    # a published checkpoint with a really truncated shard of process 1: fails verification, the one before is used
    last = run / "checkpoints" / f"iter-{ITERATIONS:08d}"
    shard = next(p for p in (last / "deepspeed").iterdir() if "zero_pp_rank_1_" in p.name)
    with open(shard, "r+b") as fh:
        fh.truncate(os.path.getsize(shard) // 2)
    with pytest.warns(UserWarning, match="truncated or changed"):
        assert latest_checkpoint(str(run)).endswith(f"iter-{ITERATIONS - 1:08d}")
    finish(launch(["train", "--resume", str(run)], log + ".again"), log + ".again")  # redoes the last iteration
    assert_same_end(straight, run)


@needs_deepspeed
@pytest.mark.parametrize(
    "nproc, extra, now", [(1, [], "ZeRO-2 with 1 process:"), (2, ["--deepspeed", "zero3"], "ZeRO-3 with 2 processes:")]
)
def test_resume_with_another_world_size_or_stage_is_refused(tmp_path, assets, nproc, extra, now):
    run = tmp_path / "run"
    shutil.copytree(straight_run(assets, "zero2"), run)
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    log = str(tmp_path / "resume.log")
    proc = launch(["train", "--resume", str(run), *extra], log, nproc=nproc)
    proc.wait(timeout=600)
    text = open(log, errors="replace").read()
    assert proc.returncode != 0
    errors = {line for line in text.splitlines() if line.startswith("error:")}
    assert len(errors) == 1, text[-3000:]  # the same line from every process
    line = errors.pop()
    assert now in line and "it was written under DeepSpeed ZeRO-2 with 2 processes" in line
    assert "Traceback" not in text.split("error:")[0]
    assert sorted(str(p.relative_to(run)) for p in run.rglob("*")) == before  # refused before anything changed


# ----------------------------------------------------------------------------- in one process, no launcher


def test_layout_check_names_both_settings():
    from lmppo.errors import CheckpointError
    from lmppo.run.checkpoint import check_layout

    zero2 = {"layout": {"deepspeed_stage": 2}, "num_processes": 2}
    check_layout(zero2, 2, 2, "ck")  # the same: allowed
    check_layout(zero2, 2, None, "ck")  # the stage not known before the engine starts: only the processes compared
    for processes, stage, now in (
        (4, 2, "under DeepSpeed ZeRO-2 with 4 processes"),
        (2, 3, "under DeepSpeed ZeRO-3 with 2 processes"),
        (2, 0, "without DeepSpeed with 2 processes"),
        (1, None, "under DeepSpeed ZeRO-2 with 1 process:"),
    ):
        with pytest.raises(CheckpointError, match="it was written under DeepSpeed ZeRO-2 with 2 processes") as err:
            check_layout(zero2, processes, stage, "ck")
        assert f"cannot resume from ck {now}" in str(err.value) and "(2)" in str(err.value)
    plain = {"num_processes": 2}  # whole tensors (older checkpoints have no layout): another world size continues
    with pytest.raises(CheckpointError, match="written without DeepSpeed with 2 processes"):
        check_layout(plain, 2, 3, "ck")
    with pytest.warns(UserWarning, match="written by 2 processes, this run has 1"):
        check_layout(plain, 1, 0, "ck")


def test_sharded_manifest_must_list_every_process_part(tmp_path):
    """A DeepSpeed checkpoint verifies only when its manifest lists state.json, the RNG files of every process and
    every process's optimizer shard, and every file is inside the folder."""
    import json

    from lmppo.errors import CheckpointError
    from lmppo.run.manifest import verify_checkpoint, write_manifest

    folder = tmp_path / "iter-00000001"
    (folder / "deepspeed").mkdir(parents=True)
    for name in (
        "state.json",
        "rng-rank0.json",
        "rng-rank0.safetensors",
        "rng-rank1.json",
        "rng-rank1.safetensors",
        "deepspeed/mp_rank_00_model_states.pt",
        "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ):
        (folder / name).write_text(name)
    layout = {"deepspeed_stage": 2}
    write_manifest(str(folder), 1, 2, layout)
    with pytest.raises(CheckpointError, match="optimizer shard of process 1"):
        verify_checkpoint(str(folder))
    (folder / "deepspeed" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_text("shard 1")
    write_manifest(str(folder), 1, 2, layout)
    manifest = verify_checkpoint(str(folder))
    assert manifest["processes"] == 2 and "deepspeed/zero_pp_rank_1_mp_rank_00_optim_states.pt" in manifest["files"]
    (folder / "rng-rank1.json").unlink()
    with pytest.raises(CheckpointError, match="rng-rank1.json is missing"):
        verify_checkpoint(str(folder))
    (folder / "rng-rank1.json").write_text("rng-rank1.json")
    for outside in ("../state.json", "deepspeed/../../x", "/etc/passwd"):
        data = json.loads((folder / "manifest.json").read_text())
        data["files"][outside] = {"bytes": 1, "sha256": ""}
        (folder / "manifest.json").write_text(json.dumps(data))
        with pytest.raises(CheckpointError, match="outside the folder"):
            verify_checkpoint(str(folder))
        write_manifest(str(folder), 1, 2, layout)
