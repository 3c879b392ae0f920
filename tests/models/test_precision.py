"""`precision: auto`: the choice logic for both kinds of CPU (capabilities faked at `cpu_bf16_support`, the one
place that reads the machine), the probe's cache, and the choice reaching a run (config.yaml, autocast)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import Config
from lmppo.errors import ConfigError
from lmppo.models import precision as precision_module
from lmppo.models.precision import CpuBf16Support, choose_precision, native_cpu_bf16

AVX2_EPYC = CpuBf16Support(machine="x86_64", capability="AVX2", avx512_bf16=False, amx=False, onednn_isa_limit="")
ZEN4_EPYC = CpuBf16Support(machine="x86_64", capability="AVX512", avx512_bf16=True, amx=False, onednn_isa_limit="")
SAPPHIRE_RAPIDS = CpuBf16Support(machine="x86_64", capability="AVX512", avx512_bf16=True, amx=True, onednn_isa_limit="")
SKYLAKE_X = CpuBf16Support(machine="x86_64", capability="AVX512", avx512_bf16=False, amx=False, onednn_isa_limit="")
GRAVITON = CpuBf16Support(machine="aarch64", capability="SVE256", avx512_bf16=False, amx=False, onednn_isa_limit="")
LIMITED = CpuBf16Support(machine="x86_64", capability="AVX512", avx512_bf16=True, amx=False, onednn_isa_limit="AVX2")


def no_probe() -> float:
    raise AssertionError("the capabilities settle this case: the probe must not run")


@pytest.mark.parametrize(
    "cpu,native",
    [
        (AVX2_EPYC, False),
        (ZEN4_EPYC, True),
        (SAPPHIRE_RAPIDS, True),
        (SKYLAKE_X, None),
        (GRAVITON, None),
        (LIMITED, None),
        (CpuBf16Support("x86_64", "DEFAULT", False, False, ""), False),
    ],
)
def test_native_bf16_from_capabilities(cpu, native):
    assert native_cpu_bf16(cpu) is native


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    choice = choose_precision("auto", "cpu", cpu=AVX2_EPYC, probe=no_probe)
    assert choice.precision == "fp32"
    assert "no native bf16" in choice.reason and "AVX2" in choice.reason


@pytest.mark.parametrize("cpu", [ZEN4_EPYC, SAPPHIRE_RAPIDS])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu):
    choice = choose_precision("auto", "cpu", cpu=cpu, probe=no_probe)
    assert choice.precision == "bf16"
    assert "native bf16" in choice.reason


@pytest.mark.parametrize(
    "slowdown,expected", [(0.3, "bf16"), (0.8, "bf16"), (0.81, "fp32"), (2.6, "fp32"), (45.0, "fp32")]
)
def test_auto_probes_when_the_capabilities_do_not_settle_it(slowdown, expected):
    calls = []

    def probe():
        calls.append(1)
        return slowdown

    for cpu in (SKYLAKE_X, GRAVITON, LIMITED):
        choice = choose_precision("auto", "cpu", cpu=cpu, probe=probe)
        assert choice.precision == expected, cpu
        assert choice.bf16_slowdown == slowdown
    assert len(calls) == 3


def test_explicit_bf16_on_a_cpu_without_native_bf16_runs_as_asked_with_one_warning():
    with pytest.warns(UserWarning, match=r"ran 17\.0x as long as in fp32") as caught:
        choice = choose_precision("bf16", "cpu", cpu=AVX2_EPYC, probe=lambda: 17.0)
    assert len(caught) == 1
    assert choice.precision == "bf16" and choice.bf16_slowdown == 17.0


def test_explicit_bf16_on_a_native_cpu_neither_probes_nor_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_precision("bf16", "cpu", cpu=ZEN4_EPYC, probe=no_probe).precision == "bf16"


def test_explicit_fp32_never_probes():
    for cpu in (AVX2_EPYC, ZEN4_EPYC, GRAVITON):
        assert choose_precision("fp32", "cpu", cpu=cpu, probe=no_probe).precision == "fp32"


@pytest.mark.parametrize("supported,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_the_gpus_bf16_support(supported, expected):
    assert choose_precision("auto", "cuda", cuda_bf16=supported, probe=no_probe).precision == expected


def test_the_probe_cache_is_read_when_its_key_matches(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPPO_CACHE", str(tmp_path))
    cache = tmp_path / "bf16-probe.json"
    cache.write_text(json.dumps({"key": precision_module._probe_key(), "slowdown": 12.5}))
    assert precision_module.cached_bf16_slowdown() == 12.5
    cache.write_text(json.dumps({"key": "another machine", "slowdown": 12.5}))
    measured = precision_module.cached_bf16_slowdown()  # a real probe: a positive ratio, now cached for this key
    assert measured > 0 and measured != 12.5
    assert json.loads(cache.read_text()) == {"key": precision_module._probe_key(), "slowdown": measured}


def test_the_probe_key_changes_with_the_onednn_isa_limit(monkeypatch):
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = precision_module._probe_key()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert precision_module._probe_key() != plain


def test_reading_this_machine_gives_a_decision_or_a_probe():
    cpu = precision_module.cpu_bf16_support()
    assert isinstance(cpu.capability, str) and cpu.capability
    assert native_cpu_bf16(cpu) in (True, False, None)


def test_default_config_and_recipe_ask_for_auto():
    from lmppo.config import load_config, recipe_path

    assert Config().precision == "auto"
    assert load_config(recipe_path("sentiment")).precision == "auto"
    cfg = Config()
    with pytest.raises(ConfigError, match="precision"):  # refused on assignment
        cfg.precision = "bf32"


@pytest.mark.parametrize("cpu,expected", [(AVX2_EPYC, "fp32"), (ZEN4_EPYC, "bf16")])
def test_a_run_with_auto_computes_in_the_chosen_precision_and_stores_it(
    tmp_path, tokenizer, monkeypatch, cpu, expected
):
    from lmppo.training.trainer import PPOTrainer

    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: cpu)
    monkeypatch.setattr(precision_module, "cached_bf16_slowdown", no_probe)
    cfg = small_config(tmp_path / "run", iterations=1, precision="auto")
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda prompts, completions: [0.0] * len(completions)],
    )
    assert trainer.config.precision == expected
    with trainer._autocast():
        assert torch.is_autocast_enabled("cpu") is (expected == "bf16")
    text = (tmp_path / "run" / "config.yaml").read_text()
    assert f"\nprecision: {expected}\n" in text
    assert "# precision: auto:" in text


def test_the_probe_leaves_the_global_rng_as_it_was(tmp_path, monkeypatch):
    monkeypatch.setenv("LMPPO_CACHE", str(tmp_path))  # an empty cache: the probe runs (a random layer and input)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    precision_module.cached_bf16_slowdown()
    assert (tmp_path / "bf16-probe.json").is_file()  # it did run
    assert torch.equal(torch.rand(4), expected)  # and a seeded run draws the same numbers after it
    assert sorted(p.name for p in tmp_path.iterdir()) == [".bf16-probe.json.lock", "bf16-probe.json"]
