"""lmppo.models.attention: the eager path equals torch's SDPA, the dispatch takes it only where it is faster, and a
model switched to `lmppo_cpu` computes what it computed before (values and gradients)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_gpt2, tiny_llama
from lmppo.models.attention import (
    EAGER_MAX_SCORES,
    IMPLEMENTATION,
    _attention,
    _register,
    eager_attention,
    use_cpu_attention,
)

_register()  # what use_cpu_attention does first; the dispatch tests call _attention directly
from lmppo.models.loading import position_ids_from_mask

NEG = torch.finfo(torch.float32).min


def _additive_mask(B: int, L: int, pad: list[int]) -> torch.Tensor:
    """(B, 1, L, L) causal mask with the first pad[b] keys of row b masked (left padding), additive form."""
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    for b, p in enumerate(pad):
        allowed[b, :, :, :p] = False
        allowed[b, :, torch.arange(L), torch.arange(L)] = True  # a padded query still sees itself (no empty rows)
    return torch.zeros(B, 1, L, L).masked_fill(~allowed, NEG), allowed


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_eager_attention_matches_torch_sdpa(kv_heads):
    torch.manual_seed(0)
    B, H, L, D = 3, 4, 7, 8
    q = torch.randn(B, H, L, D)
    k, v = torch.randn(B, kv_heads, L, D), torch.randn(B, kv_heads, L, D)
    additive, allowed = _additive_mask(B, L, [0, 2, 5])
    out, probs = eager_attention(q, k, v, additive, scaling=0.3)
    groups = H // kv_heads
    expected = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=allowed, scale=0.3
    )
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=1e-5, atol=1e-6)
    assert out.shape == (B, L, H, D)
    torch.testing.assert_close(probs.sum(-1), torch.ones(B, H, L))
    assert probs[1, :, 4, :2].abs().max() == 0  # masked (padding) keys get no weight


def test_eager_attention_default_scaling_is_one_over_sqrt_head_dim():
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 2, 5, 16) for _ in range(3))
    out, _ = eager_attention(q, k, v, None)
    expected = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


class _Module(torch.nn.Module):
    num_key_value_groups = 1
    is_causal = True


@pytest.mark.parametrize(
    "dtype,L_q,L_k,eager",
    [
        (torch.bfloat16, 16, 16, True),  # short bf16 training pass: eager
        (torch.bfloat16, 256, 256, True),  # the largest score matrix that still goes eager
        (torch.bfloat16, 257, 257, False),  # longer: the fused kernel wins (benchmarks/speed/attention_cpu.py)
        (torch.bfloat16, 1, 40, True),  # one decoding step in bf16: eager too (the fused kernel's set-up dominates)
        (torch.float32, 1, 40, False),  # one decoding step in fp32: SDPA
        (torch.float32, 16, 16, False),  # fp32: SDPA (no gain from eager there)
    ],
)
def test_dispatch_takes_the_eager_path_only_where_it_is_faster(dtype, L_q, L_k, eager):
    assert 256 * 256 == EAGER_MAX_SCORES
    q = torch.randn(1, 2, L_q, 8, dtype=dtype)
    k, v = torch.randn(1, 2, L_k, 8, dtype=dtype), torch.randn(1, 2, L_k, 8, dtype=dtype)
    mask = torch.zeros(1, 1, L_q, L_k)
    out, weights = _attention(_Module(), q, k, v, mask, dropout=0.0, scaling=None)
    assert (weights is not None) == eager  # the eager path returns its probabilities, SDPA returns None
    assert out.shape == (1, L_q, 2, 8) and out.dtype == dtype


def test_fp32_inputs_under_bf16_autocast_take_the_eager_path():
    """Inside Llama under autocast q/k/v arrive in fp32 (rotary embedding in fp32): still the eager path, whose
    matmuls autocast runs in bf16."""
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    mask = torch.zeros(1, 1, 16, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, weights = _attention(_Module(), q, k, v, mask, dropout=0.0, scaling=None)
    assert weights is not None and out.dtype == torch.bfloat16
    out, weights = _attention(_Module(), q, k, v, mask, dropout=0.0, scaling=None)  # no autocast: SDPA
    assert weights is None and out.dtype == torch.float32


def test_dispatch_leaves_model_specific_variants_to_sdpa():
    q, k, v = (torch.randn(1, 2, 8, 8, dtype=torch.bfloat16) for _ in range(3))
    with pytest.raises(ValueError, match="softcap"):  # what a model on plain SDPA would get, not a silent eager pass
        _attention(_Module(), q, k, v, torch.zeros(1, 1, 8, 8), softcap=30.0)


def _batch(tokenizer, B: int = 4, L: int = 12):
    torch.manual_seed(3)
    ids = torch.randint(3, len(tokenizer), (B, L))
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :3], mask[2, :7] = 0, 0  # left padding
    return ids, mask


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_switched_model_gives_the_same_values_and_gradients(tokenizer, build):
    ids, mask = _batch(tokenizer)
    positions = position_ids_from_mask(mask)
    before = build(tokenizer)
    after = use_cpu_attention(copy.deepcopy(before))
    assert before.config._attn_implementation == "sdpa"
    assert after.config._attn_implementation == IMPLEMENTATION

    def run(model, bf16: bool):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits.float()
        real = mask.bool()
        logits[real].logsumexp(-1).sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        return logits[real].detach(), grads

    ref_logits, ref_grads = run(before, bf16=False)
    logits, grads = run(after, bf16=False)  # fp32: the SDPA path, only the mask's form differs
    torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
    bf_logits, bf_grads = run(after, bf16=True)  # bf16: the eager path, within bf16 rounding of fp32
    assert (bf_logits - ref_logits).abs().max() < 0.05 * ref_logits.abs().max()
    assert torch.nn.functional.cosine_similarity(bf_grads, ref_grads, dim=0) > 0.99


def test_switched_model_generates_the_same_tokens(tokenizer):
    """The KV-cache sampling loop gives the same tokens (fp32: SDPA either way, only the mask's form differs)."""
    from lmppo.sampling.native import sample_native

    ids, mask = _batch(tokenizer)
    before = tiny_llama(tokenizer)
    after = use_cpu_attention(copy.deepcopy(before))
    stop = torch.tensor([tokenizer.eos_token_id])
    seeds = list(range(ids.shape[0]))
    a = sample_native(before, ids, mask.bool(), 1.0, 8, stop, tokenizer.pad_token_id, seeds)
    b = sample_native(after, ids, mask.bool(), 1.0, 8, stop, tokenizer.pad_token_id, seeds)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_other_implementations_are_left_alone(tokenizer):
    model = tiny_llama(tokenizer)
    model.set_attn_implementation("eager")  # e.g. chosen by the user
    use_cpu_attention(model)
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_padding_known_from_the_host_gives_the_masks_transformers_reads_itself(tokenizer, implementation):
    """`run_trunk(..., padded=)`: the caller says whether the mask holds padding (no read of the device); the hidden
    states are those of transformers' own check, with padding (a mask) and without (SDPA's is_causal)."""
    from lmppo.models.loading import run_trunk

    model = tiny_llama(tokenizer)
    model.set_attn_implementation(implementation)
    ids = torch.randint(5, len(tokenizer), (3, 7), generator=torch.Generator().manual_seed(0))
    full = torch.ones(3, 7, dtype=torch.bool)
    left_padded = full.clone()
    left_padded[0, :2] = False
    with torch.no_grad():
        for mask, padded in ((full, False), (left_padded, True)):
            assert torch.equal(run_trunk(model.model, ids, mask, padded), run_trunk(model.model, ids, mask))
        # the flag is obeyed: said "no padding" over a padded mask, the padding is attended to (wrong on purpose)
        wrong = run_trunk(model.model, ids, left_padded, padded=False)
        if implementation == "sdpa":
            assert not torch.equal(wrong[0], run_trunk(model.model, ids, left_padded)[0])
