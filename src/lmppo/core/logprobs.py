"""Log-probabilities of chosen tokens and entropies, from logits.

Logits in bf16/fp16 (autocast on a GPU: a (16, 192, 49152) minibatch is 0.3 GB in bf16, 0.6 GB more as an fp32
copy) go through autograd functions that work on blocks of rows: each block is upcast to fp32, reduced, and freed;
backward recomputes the block's softmax from the saved low-precision logits. No fp32 copy of the whole vocabulary
axis exists at any time, and the numbers are those of the fp32 formula. fp32 logits take the plain formulas (no copy
to avoid).
"""

from __future__ import annotations

import torch

BLOCK_ELEMENTS = 1 << 22  # fp32 elements per block (16 MiB): rows per block = BLOCK_ELEMENTS // V


def _rows_per_block(vocab: int, block_elements: int) -> int:
    return max(1, block_elements // max(vocab, 1))


class _SelectiveLogSoftmax(torch.autograd.Function):
    """log_softmax(x)[index] row by row in fp32 blocks; saves the (low-precision) logits and the fp32 logsumexp."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, block_elements: int) -> torch.Tensor:
        flat, idx = logits.reshape(-1, logits.shape[-1]), index.reshape(-1)
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        step = _rows_per_block(flat.shape[1], block_elements)
        for start in range(0, flat.shape[0], step):
            lse[start : start + step] = torch.logsumexp(flat[start : start + step].float(), dim=-1)
        chosen = flat.gather(-1, idx[:, None]).squeeze(-1).float()
        ctx.save_for_backward(logits, index, lse)
        ctx.block_elements = block_elements
        return (chosen - lse).reshape(index.shape)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, index, lse = ctx.saved_tensors
        flat, idx, g = logits.reshape(-1, logits.shape[-1]), index.reshape(-1), grad.reshape(-1).float()
        out = torch.empty_like(flat)
        step = _rows_per_block(flat.shape[1], ctx.block_elements)
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            block = -(flat[rows].float() - lse[rows, None]).exp_().mul_(g[rows, None])  # -g * softmax
            block.scatter_add_(-1, idx[rows, None], g[rows, None])  # + g at the chosen token
            out[rows] = block
        return out.reshape(logits.shape), None, None


class _Entropy(torch.autograd.Function):
    """Entropy of softmax(x) row by row in fp32 blocks; dH/dx_j = -p_j (x_j - sum_i p_i x_i)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, block_elements: int) -> torch.Tensor:
        flat = logits.reshape(-1, logits.shape[-1])
        lse = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
        mean = torch.empty_like(lse)  # sum_i p_i x_i
        step = _rows_per_block(flat.shape[1], block_elements)
        for start in range(0, flat.shape[0], step):
            block = flat[start : start + step].float()
            lse[start : start + step] = torch.logsumexp(block, dim=-1)
            mean[start : start + step] = (torch.softmax(block, dim=-1) * block).sum(-1)
        ctx.save_for_backward(logits, lse, mean)
        ctx.block_elements = block_elements
        return (lse - mean).reshape(logits.shape[:-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        logits, lse, mean = ctx.saved_tensors
        flat, g = logits.reshape(-1, logits.shape[-1]), grad.reshape(-1).float()
        out = torch.empty_like(flat)
        step = _rows_per_block(flat.shape[1], ctx.block_elements)
        for start in range(0, flat.shape[0], step):
            rows = slice(start, start + step)
            block = flat[rows].float()
            p = (block - lse[rows, None]).exp()
            out[rows] = block.sub_(mean[rows, None]).mul_(p).mul_(-g[rows, None])
        return out.reshape(logits.shape), None


def selective_log_softmax(
    logits: torch.Tensor, index: torch.Tensor, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """log_softmax(logits, -1) gathered at `index`, without materialising the full log-softmax.

    Equivalent to ``torch.log_softmax(logits.float(), -1).gather(-1, index[..., None]).squeeze(-1)``.
    logits: (..., V) float; index: (...) long -> (...) in float32 (bf16 logits are upcast first, a block of rows at a
    time: log-softmax in bf16 loses about 2 significant digits, which shows up directly in the PPO ratio).
    """
    if logits.dtype != torch.float32:
        return _SelectiveLogSoftmax.apply(logits, index, block_elements)
    chosen = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    return chosen - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(
    logits: torch.Tensor, chunk_size: int = 64, block_elements: int = BLOCK_ELEMENTS
) -> torch.Tensor:
    """Entropy of softmax(logits) over the last dim: logsumexp(l) - sum(softmax(l) * l).

    logits: (B, T, V) -> (B, T) float32. fp32 logits: computed over chunks of `chunk_size` rows so only a (chunk, V)
    block of probabilities exists at once; bf16/fp16 logits: fp32 blocks of `block_elements` (see the module
    docstring). The naive equivalent is ``-(p * p.log()).sum(-1)`` with ``p = softmax(l.float())``.
    """
    if logits.dtype != torch.float32:
        return _Entropy.apply(logits, block_elements)
    flat = logits.reshape(-1, logits.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        block = flat[start : start + chunk_size].float()
        probs = torch.softmax(block, dim=-1)
        out[start : start + chunk_size] = torch.logsumexp(block, dim=-1) - (probs * block).sum(-1)
    return out.reshape(logits.shape[:-1])
