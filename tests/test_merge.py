"""`lmppo merge`: the exact mean of LoRA weight changes, full-weight averages, --toward-start, and its refusals."""

from __future__ import annotations

import json
import os

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file

from conftest import tiny_llama
from lmppo.cli import main
from lmppo.merge import merge

LINEARS = ["q_proj", "v_proj", "up_proj", "down_proj"]


def _adapter(tokenizer, base_dir, out_dir, seed):
    """A LoRA adapter on the tiny Llama saved in `base_dir`, with random (non-zero) A and B."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
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
        want = (load_file(tmp_path / "full0" / "model.safetensors")[key]
                + load_file(tmp_path / "full1" / "model.safetensors")[key]) / 2
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
        ([str(tmp_path / "full"), str(tmp_path / "full"), "--toward-start", "0.5", "--output",
          str(tmp_path / "o5")], "needs --start"),
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
    assert main(["merge", str(tmp_path / "a0"), str(tmp_path / "a1"), "-o", str(tmp_path / "m"),
                 "--toward-start", "0.8"]) == 0
    assert "the mean of 2 policies' weight changes, times 0.8" in " ".join(capsys.readouterr().out.split())
    w = load_file(tmp_path / "m" / "adapter_model.safetensors")
    a = load_file(tmp_path / "a0" / "adapter_model.safetensors")
    key = next(k for k in a if ".lora_B." in k)
    assert torch.allclose(w[key][:, :4], a[key] * 0.4)
