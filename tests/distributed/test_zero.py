"""DeepSpeed ZeRO-2 and ZeRO-3 (2 CPU processes, torchrun, gloo, DeepSpeed's CPU accelerator) against a plain
1-process run with the same global batch and seed.

Same setting as tests/test_distributed.py: the native sampler gives both layouts the same responses and, with one
minibatch per epoch, the update is the token mean over the same global batch, so every metric of the three
iterations must agree. Tolerance: 1e-4 absolute (1e-4 relative for large values), as for DDP. What may differ is
float reduction order only: ZeRO reduce-scatters / all-reduces gradient buckets where one process accumulates,
and ZeRO-3 gathers weights (exact copies, no arithmetic). Measured here: at most about 1e-6 (relative), on every
configuration below. Excluded: wall-clock fields and `val/ratio_var` (a variance across each process's
micro-batch means).

The ZeRO runs are skipped when `deepspeed` cannot be imported (it is not a dependency of lmppo;
`pip install deepspeed`); the checks of the config field and of the error messages run everywhere.
"""

from __future__ import annotations

import json

import pytest
from test_distributed import assert_close, run_workers

from lmppo.config import Config
from lmppo.errors import ConfigError

pytestmark = pytest.mark.slow  # real processes, each training a model: minutes in all (make test-fast skips them)

try:
    import deepspeed  # noqa: F401

    DEEPSPEED_ERROR = ""
except Exception as err:  # not installed, or installed but broken
    DEEPSPEED_ERROR = f"{type(err).__name__}: {err}"
needs_deepspeed = pytest.mark.skipif(
    bool(DEEPSPEED_ERROR),
    reason=f"deepspeed is not importable ({DEEPSPEED_ERROR}); pip install deepspeed to run the ZeRO tests",
)

_BASELINES: dict = {}  # settings -> (metrics, folder) of the plain 1-process run


def one_process(tmp_path_factory, **env) -> list[dict]:
    """The plain 1-process run (no DeepSpeed) for these settings, run once per session."""
    key = tuple(sorted(env.items()))
    if key not in _BASELINES:
        folder = tmp_path_factory.mktemp("plain")
        _BASELINES[key] = run_workers(folder, 1, **env), folder / "n1"
    return _BASELINES[key][0]


def zero_run(tmp_path, stage: str, **env) -> tuple[list[dict], dict]:
    history = run_workers(tmp_path, 2, DEEPSPEED=stage, **env)
    info = json.loads((tmp_path / "n2" / "metrics.json.zero.json").read_text())
    return history, info


def assert_same_run(one: list[dict], two: list[dict]) -> None:
    assert len(one) == len(two) == 3
    for a, b in zip(one, two):
        assert set(a) == set(b)
        assert_close(a, b)


def test_config_names_a_deepspeed_setting(tmp_path):
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    for ok in ("", "zero2", "zero3"):
        cfg.deepspeed = ok
        cfg.validate()
    cfg.deepspeed = "zero4"
    with pytest.raises(ConfigError, match="deepspeed"):
        cfg.validate()
    (tmp_path / "ds.json").write_text('{"zero_optimization": {"stage": 3}}')
    cfg.deepspeed = str(tmp_path / "ds.json")
    cfg.validate()


def test_deepspeed_without_package_or_launcher_is_a_clear_error(monkeypatch):
    """Not installed: the error says `pip install deepspeed`; installed but started without torchrun / accelerate
    launch: the error names the launchers (a lone process would have no process group to shard over)."""
    from lmppo.distributed.zero import accelerator_kwargs

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.deepspeed = "zero3"
    with pytest.raises(ConfigError, match="pip install deepspeed" if DEEPSPEED_ERROR else "torchrun"):
        accelerator_kwargs(cfg)
    cfg.deepspeed = ""
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    assert accelerator_kwargs(cfg) == {"cpu": False}


@needs_deepspeed
@pytest.mark.parametrize("value_mode", ["shared", "critic"])
@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_zero_matches_one_process(tmp_path, tmp_path_factory, stage, value_mode):
    two, info = zero_run(tmp_path, stage, VALUE_MODE=value_mode)
    assert info["num_processes"] == 2 and info["stage"] == int(stage[-1])
    # ZeRO-3 shards the policy and the frozen reference; ZeRO-2 keeps whole weights in each process
    assert info["policy_partitioned"] == info["reference_partitioned"] == (stage == "zero3")
    assert_same_run(one_process(tmp_path_factory, VALUE_MODE=value_mode), two)
    # the final model (under ZeRO-3 gathered from the shards for the save) equals the plain run's
    plain_folder = _BASELINES[(("VALUE_MODE", value_mode),)][1]
    assert_same_weights(plain_folder / "run" / "final", tmp_path / "n2" / "run" / "final")


def assert_same_weights(plain, zero) -> None:
    from safetensors.torch import load_file

    files = sorted(p.relative_to(plain) for p in plain.rglob("*.safetensors"))
    assert files and files == sorted(p.relative_to(zero) for p in zero.rglob("*.safetensors"))
    for f in files:
        a, b = load_file(str(plain / f)), load_file(str(zero / f))
        assert set(a) == set(b), f
        for name in a:
            assert a[name].shape == b[name].shape, (f, name)
            assert (a[name] - b[name]).abs().max().item() <= 1e-4, (f, name)


@needs_deepspeed
def test_zero3_policy_loaded_partitioned_from_a_folder(tmp_path, tmp_path_factory):
    """model.policy a folder: zero.Init partitions the policy as it loads, the reference is loaded again from the
    folder and the critic is built from it (new zeroed head); the run still matches the plain one."""
    two, info = zero_run(tmp_path, "zero3", VALUE_MODE="critic", POLICY_FROM_FOLDER="1")
    assert info["policy_partitioned"] and info["reference_partitioned"]
    assert_same_run(one_process(tmp_path_factory, VALUE_MODE="critic"), two)


@needs_deepspeed
def test_zero3_ema_reference_moves_shard_by_shard(tmp_path, tmp_path_factory):
    """reference.mode ema under ZeRO-3: each process averages its own shard; the same as one process doing it."""
    two, _ = zero_run(tmp_path, "zero3", REFERENCE_MODE="ema")
    one = one_process(tmp_path_factory, REFERENCE_MODE="ema")
    assert_same_run(one, two)
    frozen = one_process(tmp_path_factory, VALUE_MODE="shared")
    assert abs(one[2]["objective/kl"] - frozen[2]["objective/kl"]) > 1e-3  # the EMA reference did move


@needs_deepspeed
def test_zero3_lora_policy_loaded_partitioned(tmp_path, tmp_path_factory):
    """LoRA under ZeRO-3 with the base model partitioned at load: the adapter-off reference check gathers the
    weights once; the adapters train as one process trains them."""
    two, info = zero_run(tmp_path, "zero3", LORA="1", POLICY_FROM_FOLDER="1")
    assert info["policy_partitioned"] and not info["reference_partitioned"]  # adapter-off: no reference copy
    assert_same_run(one_process(tmp_path_factory, LORA="1"), two)


@needs_deepspeed
def test_zero3_checkpoint_reads_only_the_real_elements_of_padded_partitions(tmp_path, tmp_path_factory):
    """A 1-element bias split over 2 processes leaves process 1 a partition of padding alone, uninitialised memory
    that can hold NaN (seen in CI: "value_head.score.bias holds NaN or inf", a refused checkpoint). Here every
    partition's padding is filled with NaN before each checkpoint: the run must save and match the plain run."""
    two, info = zero_run(tmp_path, "zero3", VALUE_MODE="shared", POISON_ZERO3_PADDING="1")
    assert info["stage"] == 3 and info["policy_partitioned"]
    assert_same_run(one_process(tmp_path_factory, VALUE_MODE="shared"), two)
    assert (tmp_path / "n2" / "run" / "checkpoints").is_dir()
