"""`lmppo merge`: the exact mean of LoRA weight changes, full-weight averages, --toward-start, --kl-budget (LAMBDA
chosen by the held-out KL), and their refusals."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from rich.console import Console
from safetensors.torch import load_file

from conftest import (
    PROMPTS,
    tiny_llama,
)
from lmppo.apps.cli import main
from lmppo.apps.merge import merge, merge_to_budget
from lmppo.evaluation.evaluate import main as eval_main

HERE = os.path.dirname(os.path.abspath(__file__))

LINEARS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _adapter(tokenizer, base_dir, out_dir, seed, scale=0.3):
    """A LoRA adapter on the tiny Llama saved in `base_dir`, with random (non-zero) A and B of sd `scale`."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return model


def _merged_weights(model) -> dict[str, torch.Tensor]:
    """The effective weights W0 + scale * B A of a peft model, as a plain state dict."""
    return {k: v.clone() for k, v in model.merge_and_unload().state_dict().items()}


@pytest.fixture
def base_dir(tmp_path, tokenizer):
    path = tmp_path / "base"
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_lora_merge_is_the_exact_mean_of_the_weight_changes(tmp_path, tokenizer, base_dir):
    from transformers import AutoModelForCausalLM

    runs = [str(tmp_path / f"a{i}") for i in range(3)]
    effective = [_merged_weights(_adapter(tokenizer, base_dir, run, seed=i)) for i, run in enumerate(runs)]
    start = AutoModelForCausalLM.from_pretrained(base_dir).state_dict()
    for lam in (1.0, 0.5):
        out = merge(runs, str(tmp_path / f"merged-{lam}"), toward_start=lam)
        cfg = json.loads(open(os.path.join(out, "adapter_config.json")).read())
        assert cfg["r"] == 12 and cfg["lora_alpha"] == 24  # rank r * K, alpha scaled with it: alpha / r stays 2
        got = _merged_weights(PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out))
        for key, w0 in start.items():
            want = w0 + lam * (sum(e[key] for e in effective) / 3 - w0)
            assert torch.allclose(got[key], want, atol=1e-5), key
        changed = [k for k in start if not torch.equal(got[k], start[k])]
        assert changed and all(any(t in k for t in LINEARS) for k in changed)
    record = json.loads(open(tmp_path / "merged-0.5" / "merge.json").read())
    assert record["toward_start"] == 0.5 and len(record["inputs"]) == 3
    assert os.path.isfile(tmp_path / "merged-1.0" / "tokenizer.json")  # the first input's other files come along


def test_a_run_folder_is_read_at_final_policy(tmp_path, tokenizer, base_dir):
    for i in range(2):
        _adapter(tokenizer, base_dir, tmp_path / f"run{i}" / "final" / "policy", seed=i)
    out = merge([str(tmp_path / "run0"), str(tmp_path / "run1")], str(tmp_path / "merged"))
    a = load_file(tmp_path / "run0" / "final" / "policy" / "adapter_model.safetensors")
    b = load_file(tmp_path / "run1" / "final" / "policy" / "adapter_model.safetensors")
    m = load_file(os.path.join(out, "adapter_model.safetensors"))
    key = next(k for k in a if ".lora_B." in k)
    assert torch.equal(m[key], torch.cat([a[key], b[key]], 1) / 2)
    key = next(k for k in a if ".lora_A." in k)
    assert torch.equal(m[key], torch.cat([a[key], b[key]], 0))


def test_full_weight_merge_and_toward_start(tmp_path, tokenizer, base_dir):
    models = []
    for i in range(2):
        model = tiny_llama(tokenizer, seed=10 + i)
        model.save_pretrained(tmp_path / f"full{i}")
        models.append(model.state_dict())
    start = load_file(os.path.join(base_dir, "model.safetensors"))
    runs = [str(tmp_path / "full0"), str(tmp_path / "full1")]
    mean = load_file(os.path.join(merge(runs, str(tmp_path / "mean")), "model.safetensors"))
    part = load_file(os.path.join(merge(runs, str(tmp_path / "part"), 0.25, start=base_dir), "model.safetensors"))
    for key, w0 in start.items():
        want = (
            load_file(tmp_path / "full0" / "model.safetensors")[key]
            + load_file(tmp_path / "full1" / "model.safetensors")[key]
        ) / 2
        assert torch.allclose(mean[key], want, atol=1e-6)
        assert torch.allclose(part[key], w0 + 0.25 * (want - w0), atol=1e-6)


def test_refusals_are_one_error_line_and_write_nothing(tmp_path, tokenizer, base_dir, capsys):
    _adapter(tokenizer, base_dir, tmp_path / "a0", seed=0)
    _adapter(tokenizer, base_dir, tmp_path / "a1", seed=1)
    tiny_llama(tokenizer).save_pretrained(tmp_path / "full")
    other = tmp_path / "other-base"
    _adapter(tokenizer, base_dir, other, seed=2)
    cfg = json.loads((other / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps(cfg | {"base_model_name_or_path": "/somewhere/else"}))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "keep.txt").write_text("user data")
    a0, a1 = str(tmp_path / "a0"), str(tmp_path / "a1")
    cases = [
        ([a0, "--output", str(tmp_path / "o1")], "at least two runs"),
        ([a0, a1, "--output", str(occupied)], "already exists and is not empty"),
        ([a0, str(tmp_path / "full"), "--output", str(tmp_path / "o2")], "some inputs are LoRA adapters"),
        ([a0, str(other), "--output", str(tmp_path / "o3")], "base_model_name_or_path"),
        ([a0, a1, "--toward-start", "-0.5", "--output", str(tmp_path / "o4")], "must be >= 0"),
        (
            [str(tmp_path / "full"), str(tmp_path / "full"), "--toward-start", "0.5", "--output", str(tmp_path / "o5")],
            "needs --start",
        ),
        ([a0, str(tmp_path / "nowhere"), "--output", str(tmp_path / "o6")], "no such folder"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert main(["merge", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: lmppo merge") and message in err and len(err.splitlines()) == 1, err
    assert [p.name for p in occupied.iterdir()] == ["keep.txt"] and (occupied / "keep.txt").read_text() == "user data"
    assert not any((tmp_path / f"o{i}").exists() for i in range(1, 7))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left behind


def test_cli_merges_and_says_what_it_wrote(tmp_path, tokenizer, base_dir, capsys):
    _adapter(tokenizer, base_dir, tmp_path / "a0", seed=0)
    _adapter(tokenizer, base_dir, tmp_path / "a1", seed=1)
    assert (
        main(["merge", str(tmp_path / "a0"), str(tmp_path / "a1"), "-o", str(tmp_path / "m"), "--toward-start", "0.8"])
        == 0
    )
    assert "the mean of 2 policies' weight changes, times 0.8" in " ".join(capsys.readouterr().out.split())
    w = load_file(tmp_path / "m" / "adapter_model.safetensors")
    a = load_file(tmp_path / "a0" / "adapter_model.safetensors")
    key = next(k for k in a if ".lora_B." in k)
    assert torch.allclose(w[key][:, :4], a[key] * 0.4)


# ----------------------------------------------------------------------------- --kl-budget: LAMBDA chosen by held-out
# KL


SMALL = 0.1  # the sd of a budget test's adapter factors: a weight change small beside the tiny model's weights


def _budget_config(tmp_path, policy: str) -> str:
    from lmppo.config import Config, RewardSourceConfig, save_config

    cfg = Config()
    cfg.precision = "fp32"
    cfg.output_dir = str(tmp_path / "unused")
    cfg.model.policy = policy
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2) + "\n")
    cfg.data.prompts, cfg.data.holdout = str(prompts), 6
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens, cfg.rollout.temperature = 8, 6, 1.0
    cfg.reward.sources = [
        RewardSourceConfig(kind="function", path=f"{HERE}/test_merge.py:length_reward", name="length")
    ]
    path = tmp_path / "config.yaml"
    save_config(cfg, str(path))
    return str(path)


def length_reward(prompts, completions):
    return [len(c) / 10.0 for c in completions]


def _eval_kl(
    model: str,
    config: str,
    out: str,
    reference: str | None = None,
    seed: int | None = None,
    samples_per_prompt: int = 4,
) -> float:
    argv = [model, "--config", config, "-o", out, "--show", "0", "--samples-per-prompt", str(samples_per_prompt)]
    argv += (["--reference", reference] if reference else []) + (["--seed", str(seed)] if seed is not None else [])
    assert eval_main(argv, Console(file=io.StringIO())) == 0
    return json.load(open(out))["trained"]["kl_exact"]


def test_kl_budget_lands_a_lora_merge_on_the_budget_and_writes_what_it_measured(tmp_path, tokenizer, base_dir, capsys):
    runs = [str(tmp_path / f"a{i}") for i in range(2)]
    for i, run in enumerate(runs):
        _adapter(tokenizer, base_dir, run, seed=i, scale=SMALL)
    config = _budget_config(tmp_path, base_dir)
    _, whole, _ = merge_to_budget(runs, str(tmp_path / "whole"), 1e6, config=config, say=lambda _: None)
    assert whole.toward_start == 1.0 and whole.kl_exact > 0.001
    budget = whole.kl_exact / 4
    assert main(["merge", *runs, "-o", str(tmp_path / "m"), "--kl-budget", f"{budget}", "--config", config]) == 0
    out = " ".join(capsys.readouterr().out.split())
    record = json.load(open(tmp_path / "m" / "merge.json"))["kl_budget"]
    chosen, steps = record["chosen"], record["steps"]
    assert steps[0]["toward_start"] == 1.0 and steps[0]["kl_exact"] == pytest.approx(whole.kl_exact, rel=1e-5)
    assert abs(chosen["kl_exact"] - budget) <= 0.1 * budget, steps
    assert 0 < chosen["toward_start"] < 1 and "within the budget" in out and "lambda 1.000" in out
    assert record["held_out"] and record["prompts"] == 6 and record["samples_per_prompt"] == 4
    # the folder written is the policy measured: lmppo eval, same config and seed, reads the same KL
    assert _eval_kl(str(tmp_path / "m"), config, str(tmp_path / "e.json")) == pytest.approx(
        chosen["kl_exact"], rel=1e-4
    )
    a = load_file(os.path.join(runs[0], "adapter_model.safetensors"))
    m = load_file(tmp_path / "m" / "adapter_model.safetensors")
    key = next(k for k in a if ".lora_B." in k)
    assert torch.allclose(m[key][:, :4], a[key] * chosen["toward_start"] / 2)


def test_kl_budget_on_full_weights_starts_from_the_configs_policy(tmp_path, tokenizer, base_dir):
    runs = []
    for i in range(2):
        model = tiny_llama(tokenizer, seed=0)
        with torch.no_grad():  # the start plus a small change of its own
            g = torch.Generator().manual_seed(20 + i)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        model.save_pretrained(tmp_path / f"full{i}")
        tokenizer.save_pretrained(tmp_path / f"full{i}")
        runs.append(str(tmp_path / f"full{i}"))
    config = _budget_config(tmp_path, base_dir)
    _, whole, _ = merge_to_budget(runs, str(tmp_path / "whole"), 1e6, config=config, say=lambda _: None)
    budget = whole.kl_exact / 3
    _, chosen, steps = merge_to_budget(runs, str(tmp_path / "m"), budget, config=config, say=lambda _: None)
    assert abs(chosen.kl_exact - budget) <= 0.1 * budget and len(steps) >= 2
    lam = chosen.toward_start
    got = load_file(tmp_path / "m" / "model.safetensors")
    start = load_file(os.path.join(base_dir, "model.safetensors"))
    mean = load_file(tmp_path / "whole" / "model.safetensors")
    for key, w0 in start.items():
        assert torch.allclose(got[key], w0 + lam * (mean[key] - w0), atol=1e-6), key
    assert _eval_kl(str(tmp_path / "m"), config, str(tmp_path / "e.json"), reference=base_dir) == pytest.approx(
        chosen.kl_exact, rel=1e-4
    )


def test_kl_budget_refusals_are_one_line_before_any_model_loads(tmp_path, tokenizer, base_dir, capsys):
    a0, a1 = str(tmp_path / "a0"), str(tmp_path / "a1")
    _adapter(tokenizer, base_dir, a0, seed=0)
    _adapter(tokenizer, base_dir, a1, seed=1)
    config = _budget_config(tmp_path, base_dir)
    cases = [
        ([a0, a1, "--kl-budget", "2", "--toward-start", "0.5", "--config", config], "not both"),
        ([a0, a1, "--kl-budget", "0", "--config", config], "--kl-budget 0.0: must be a number of nats > 0"),
        ([a0, a1, "--kl-budget", "2"], "give the runs' config with --config"),
        ([a0, a1, "--kl-budget", "2", "--tolerance", "1.5", "--config", config], "--tolerance 1.5"),
        ([a0, a1, "--kl-budget", "2", "--max-evals", "0", "--config", config], "--max-evals 0: must be >= 1"),
        (
            [a0, a1, "--kl-budget", "2", "--samples-per-prompt", "0", "--config", config],
            "--samples-per-prompt 0: must be >= 1",
        ),
    ]
    for i, (argv, message) in enumerate(cases):
        capsys.readouterr()
        assert main(["merge", *argv, "-o", str(tmp_path / f"o{i}")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: lmppo merge") and message in err and len(err.splitlines()) == 1, err
    assert not any((tmp_path / f"o{i}").exists() for i in range(len(cases)))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_kl_budget_moves_a_single_run_toward_its_start(tmp_path, tokenizer, base_dir):
    run = str(tmp_path / "a0")
    _adapter(tokenizer, base_dir, run, seed=0, scale=SMALL)
    config = _budget_config(tmp_path, base_dir)
    _, whole, _ = merge_to_budget([run], str(tmp_path / "whole"), 1e6, config=config, say=lambda _: None)
    out = tmp_path / "new" / "deeper" / "m"  # its parent folders do not exist yet
    _, chosen, steps = merge_to_budget([run], str(out), whole.kl_exact / 2, config=config, say=lambda _: None)
    assert steps[0].kl_exact == pytest.approx(whole.kl_exact) and 0 < chosen.toward_start < 1
    assert abs(chosen.kl_exact - whole.kl_exact / 2) <= 0.1 * whole.kl_exact / 2
    a = load_file(os.path.join(run, "adapter_model.safetensors"))
    m = load_file(out / "adapter_model.safetensors")
    assert all(torch.allclose(m[k], a[k] * (chosen.toward_start if ".lora_B." in k else 1.0)) for k in a)
    assert os.listdir(out.parent) == ["m"]  # the scratch copy is gone


def test_kl_budget_search_options_are_honoured(tmp_path, tokenizer, base_dir, capsys):
    runs = [str(tmp_path / f"a{i}") for i in range(2)]
    for i, run in enumerate(runs):
        _adapter(tokenizer, base_dir, run, seed=i, scale=SMALL)
    config = _budget_config(tmp_path, base_dir)
    assert (
        main(
            [
                "merge",
                *runs,
                "-o",
                str(tmp_path / "m"),
                "--kl-budget",
                "1e-6",
                "--config",
                config,
                "--max-evals",
                "1",
                "--samples-per-prompt",
                "2",
                "--seed",
                "7",
            ]
        )
        == 0
    )
    record = json.load(open(tmp_path / "m" / "merge.json"))["kl_budget"]
    assert len(record["steps"]) == 1 and record["samples_per_prompt"] == 2 and record["seed"] == 7
    assert "not within 10% of the budget after 1 tries" in " ".join(capsys.readouterr().out.split())
    assert _eval_kl(
        str(tmp_path / "m"), config, str(tmp_path / "e.json"), seed=7, samples_per_prompt=2
    ) == pytest.approx(record["chosen"]["kl_exact"], rel=1e-4)  # the seed and sample count were those used
