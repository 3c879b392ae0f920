"""Blockwise logprobs and entropy for bf16/fp16 logits (lmppo.core.logprobs): values and gradients worked by hand,
the fp32 formula on random inputs, and no fp32 copy of the whole logits tensor at any point."""

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax

# logits [0, 1] (exact in bf16): p = (1, e) / (1 + e) = (0.268941, 0.731059)
P1 = math.e / (1 + math.e)
LSE = math.log(1 + math.e)  # 1.313262


def test_logprob_of_each_token_and_its_gradient_by_hand():
    logits = torch.tensor([[0.0, 1.0], [0.0, 1.0]], dtype=torch.bfloat16, requires_grad=True)
    lp = selective_log_softmax(logits, torch.tensor([1, 0]), block_elements=2)  # one row per block
    assert lp.dtype == torch.float32
    assert lp.tolist() == pytest.approx([1 - LSE, -LSE], abs=1e-6)  # -0.313262, -1.313262
    lp.sum().backward()
    # d log p_k / d x_j = [j == k] - p_j
    want = [[-(1 - P1), 1 - P1], [1 - (1 - P1), -P1]]  # [[-0.268941, 0.268941], [0.731059, -0.731059]]
    assert logits.grad.float().tolist() == [pytest.approx(r, abs=4e-3) for r in want]  # bf16 gradient


def test_entropy_and_its_gradient_by_hand():
    logits = torch.tensor([[[0.0, 1.0]]], dtype=torch.bfloat16, requires_grad=True)
    h = entropy_from_logits(logits)
    # H = logsumexp(x) - sum p x = 1.313262 - 0.731059 = 0.582203
    assert h.item() == pytest.approx(LSE - P1, abs=1e-6)
    h.sum().backward()
    # dH/dx_j = -p_j (x_j - sum_i p_i x_i): (0.196612, -0.196612)
    want = [-(1 - P1) * (0 - P1), -P1 * (1 - P1)]
    assert logits.grad.float()[0, 0].tolist() == pytest.approx(want, abs=2e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_blockwise_equals_the_fp32_formula_values_and_gradients(dtype):
    g = torch.Generator().manual_seed(0)
    base = (3 * torch.randn(3, 5, 37, generator=g)).to(dtype)
    index = torch.randint(0, 37, (3, 5), generator=g)
    weights = torch.randn(3, 5, generator=g)
    for block in (37, 37 * 4, 1 << 22):  # one row per block, 4 rows, everything at once
        ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        lp = selective_log_softmax(ours, index, block_elements=block)
        want = torch.log_softmax(ref.float(), -1).gather(-1, index[..., None]).squeeze(-1)
        assert torch.allclose(lp, want, atol=1e-6)
        (lp * weights).sum().backward()
        (want * weights).sum().backward()
        assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=1e-2, rtol=1e-2)

        ours, ref = base.clone().requires_grad_(), base.clone().requires_grad_()
        h = entropy_from_logits(ours, block_elements=block)
        p = torch.softmax(ref.float(), -1)
        want = -(p * torch.log_softmax(ref.float(), -1)).sum(-1)
        assert torch.allclose(h, want, atol=1e-5)
        (h * weights).sum().backward()
        (want * weights).sum().backward()
        assert torch.allclose(ours.grad.float(), ref.grad.float(), atol=1e-2, rtol=1e-2)


class LargestFloat32(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest["numel"] = max(self.largest["numel"], t.numel())
        return out


def test_no_fp32_tensor_as_large_as_the_logits_exists_in_forward_or_backward():
    logits = torch.randn(8, 16, 64).bfloat16().requires_grad_()
    index = torch.randint(0, 64, (8, 16))
    with LargestFloat32() as seen:
        loss = selective_log_softmax(logits, index, block_elements=64 * 16).sum()
        loss = loss + entropy_from_logits(logits, block_elements=64 * 16).sum()
        loss.backward()
    assert 0 < seen.largest["numel"] <= 64 * 16  # a block of 16 rows, not 8 x 16 x 64
    with LargestFloat32() as seen:  # the naive formula would make one
        torch.log_softmax(logits.float(), -1).gather(-1, index[..., None]).sum().backward()
    assert seen.largest["numel"] == logits.numel()


def test_fp32_logits_take_the_plain_formula_bit_for_bit():
    logits = torch.randn(2, 3, 11)
    index = torch.randint(0, 11, (2, 3))
    want = logits.gather(-1, index[..., None]).squeeze(-1) - torch.logsumexp(logits, -1)
    assert torch.equal(selective_log_softmax(logits, index), want)
