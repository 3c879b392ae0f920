"""`precision: auto`: the choice logic for both kinds of CPU (capabilities faked at `cpu_bf16_support`, the one
place that reads the machine), the choice reaching a run (config.yaml, autocast) and a resume keeping it."""

from __future__ import annotations

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
GRAVITON3 = CpuBf16Support("aarch64", "SVE256", False, False, "", arm_bf16=True)
LIMITED_TO_AMX = CpuBf16Support("x86_64", "AVX512", True, True, "AVX512_CORE_AMX")


@pytest.mark.parametrize(
    "cpu,native",
    [
        (AVX2_EPYC, False),
        (ZEN4_EPYC, True),
        (SAPPHIRE_RAPIDS, True),
        (SKYLAKE_X, False),
        (GRAVITON, False),
        (LIMITED, False),
        (GRAVITON3, True),
        (LIMITED_TO_AMX, True),
        (CpuBf16Support("x86_64", "DEFAULT", False, False, ""), False),
    ],
)
def test_native_bf16_from_capabilities(cpu, native):
    assert native_cpu_bf16(cpu) is native


def test_auto_is_fp32_on_a_cpu_without_native_bf16():
    choice = choose_precision("auto", "cpu", cpu=AVX2_EPYC)
    assert choice.precision == "fp32"
    assert "no native bf16" in choice.reason and "AVX2" in choice.reason


@pytest.mark.parametrize("cpu", [ZEN4_EPYC, SAPPHIRE_RAPIDS])
def test_auto_is_bf16_on_a_cpu_with_native_bf16(cpu):
    choice = choose_precision("auto", "cpu", cpu=cpu)
    assert choice.precision == "bf16"
    assert "native bf16" in choice.reason


def test_auto_is_fp32_where_bf16_is_emulated_whatever_a_timing_would_say():
    for cpu in (SKYLAKE_X, GRAVITON, LIMITED):  # emulated bf16: fp32, decided without measuring anything
        choice = choose_precision("auto", "cpu", cpu=cpu)
        assert choice.precision == "fp32", cpu
        assert "no native bf16" in choice.reason


def test_explicit_bf16_on_a_cpu_without_native_bf16_runs_as_asked_with_one_warning():
    with pytest.warns(UserWarning, match=r"without native bf16 .*AVX2 kernels.*picks fp32 here") as caught:
        choice = choose_precision("bf16", "cpu", cpu=AVX2_EPYC)
    assert len(caught) == 1
    assert choice.precision == "bf16"


def test_explicit_bf16_on_a_native_cpu_neither_probes_nor_warns():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert choose_precision("bf16", "cpu", cpu=ZEN4_EPYC).precision == "bf16"


def test_explicit_fp32_never_probes():
    for cpu in (AVX2_EPYC, ZEN4_EPYC, GRAVITON):
        assert choose_precision("fp32", "cpu", cpu=cpu).precision == "fp32"


@pytest.mark.parametrize("supported,expected", [(True, "bf16"), (False, "fp32")])
def test_auto_on_cuda_follows_the_gpus_bf16_support(supported, expected):
    assert choose_precision("auto", "cuda", cuda_bf16=supported).precision == expected


def test_reading_this_machine_gives_a_decision():
    cpu = precision_module.cpu_bf16_support()
    assert isinstance(cpu.capability, str) and cpu.capability
    assert native_cpu_bf16(cpu) is (cpu.capability.startswith("AVX512") and (cpu.avx512_bf16 or cpu.amx))


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


def test_a_resume_computes_in_the_precision_the_run_decided_at_its_start(tmp_path, tokenizer, monkeypatch):
    """Decided once: a run that began in bf16 (native CPU) resumes in bf16 on a CPU whose capabilities would say
    fp32 now, also when the resumed config says `auto` again."""
    from lmppo.training.trainer import PPOTrainer

    objects = dict(
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[lambda prompts, completions: [0.0] * len(completions)],
    )
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: ZEN4_EPYC)
    cfg = small_config(tmp_path / "run", iterations=1, precision="auto")
    cfg.checkpoint.every = 1
    PPOTrainer(cfg, **objects).train()
    monkeypatch.setattr(precision_module, "cpu_bf16_support", lambda: AVX2_EPYC)
    again = small_config(tmp_path / "run", iterations=2, precision="auto")
    resumed = PPOTrainer.resume(str(tmp_path / "run"), config=again, **dict(objects, policy=tiny_llama(tokenizer)))
    assert resumed.config.precision == "bf16"
