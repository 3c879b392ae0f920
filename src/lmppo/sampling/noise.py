"""Counter-based Gumbel noise for the native sampler, computed on the device that holds the logits.

The noise of response b at decoding step t and vocabulary index v is a pure function of (seed_b, t, v), built from
SplitMix64 (Steele, Lea, Flood 2014, "Fast splittable pseudorandom number generators"; Vigna's reference
`splitmix64.c`), whose n-th output from state s is mix(s + n * GAMMA):

    base(b, t) = mix(seed_b + (t + 1) * GAMMA)          first output of the stream seeded seed_b + t * GAMMA
    z(b, t, j) = mix(base(b, t) + (j + 1) * GAMMA)      output j + 1 of the stream seeded base(b, t)
    word(b, t, v) = low 32 bits of z(b, t, v // 2) for even v, high 32 bits for odd v

So a response's randomness depends only on its seed (run seed, iteration, position: `response_seed`), never on the
batch it sits in, the process count or a resume, and no host generator or host-to-device copy takes part in a step.
All of it is int64 tensor ops: products wrap around in two's complement (what torch's CPU and CUDA kernels do) and
logical right shifts are arithmetic shifts masked to the kept bits, so CPU and GPU compute the same integers (the
reference-value tests check it on each device). 16 int64 ops per pair of words; Philox4x32-10 took 60 and was 5x
slower on this CPU than the per-response CPU generators it replaced (docs/performance.md, "Native sampler noise").
On the CPU the rows are processed a few at a time so the work stays in cache.

The Gumbel transform -log(-log(u)), u = (word + 0.5) / 2^32, runs in float64 and is rounded to float32 once, so a
last-bit difference between the CPU's and the GPU's `log` reaches the float32 noise with probability about 2^-29.
u is never 0 or 1; the largest noise value is -log(-log(1 - 2^-33)) = 22.9 (a standard Gumbel exceeds it with
probability 1e-10).
"""

from __future__ import annotations

from typing import Sequence, Union

import torch

MASK32 = 0xFFFFFFFF


def _signed(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    return x - (1 << 64) if x >= 1 << 63 else x


GAMMA = _signed(0x9E3779B97F4A7C15)  # the golden-ratio Weyl increment
MIX1 = _signed(0xBF58476D1CE4E5B9)
MIX2 = _signed(0x94D049BB133111EB)
CPU_CHUNK = 16384  # word pairs per chunk on the CPU (128 KiB per int64 tensor: the work stays in L2)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits by k (0 < k < 64)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def mix64(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output function on int64 tensors (the uint64 bits): z ^= z >> 30; z *= MIX1; z ^= z >> 27;
    z *= MIX2; z ^= z >> 31 (logical shifts, products modulo 2^64)."""
    z = (z ^ _shr(z, 30)) * MIX1
    z = (z ^ _shr(z, 27)) * MIX2
    return z ^ _shr(z, 31)


def splitmix64(state: torch.Tensor, n: Union[int, torch.Tensor]) -> torch.Tensor:
    """Output n (n >= 1) of SplitMix64 seeded with `state`: mix64(state + n * GAMMA), broadcasting."""
    return mix64(state + torch.as_tensor(n, dtype=torch.long, device=state.device) * GAMMA)


def seed_tensor(seeds: Union[Sequence[int], torch.Tensor], device: Union[str, torch.device]) -> torch.Tensor:
    """(B,) int64 response seeds (`response_seed`: 63-bit, so they fit int64) on `device`; one copy per rollout."""
    return torch.as_tensor(list(seeds) if not isinstance(seeds, torch.Tensor) else seeds, dtype=torch.long).to(device)


def uniform_words(seeds: torch.Tensor, step: Union[int, torch.Tensor], vocab: int) -> torch.Tensor:
    """(B, V) int64 uniform 32-bit words of step `step` (an int or a 0-dim int64 tensor), laid out as in the module
    docstring: word v of row b is half v % 2 of output v // 2 + 1 of the stream seeded base(b, step)."""
    device = seeds.device
    pairs = (vocab + 1) // 2
    step = torch.as_tensor(step, dtype=torch.long, device=device)
    base = splitmix64(seeds[:, None], step + 1)  # (B, 1)
    j = torch.arange(1, pairs + 1, dtype=torch.long, device=device)[None, :]  # (1, V/2): outputs 1, 2, ...
    z = splitmix64(base, j)  # (B, V/2)
    return torch.stack([z & MASK32, _shr(z, 32)], dim=-1).reshape(seeds.shape[0], 2 * pairs)[:, :vocab]


def gumbel_from_words(words: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel float32 from uint32 words: -log(-log(u)), u = (w + 0.5) / 2^32, computed in float64."""
    return words.double().add_(0.5).mul_(2.0**-32).log_().neg_().log_().neg_().float()


def gumbel_noise(seeds: torch.Tensor, step: Union[int, torch.Tensor], vocab: int) -> torch.Tensor:
    """(B, V) float32 standard Gumbel noise on the seeds' device, row b a function of (seeds[b], step) only.
    On CUDA one pass over the whole batch (a fixed sequence of kernels, capturable in a CUDA graph); on the CPU a
    few rows at a time."""
    if seeds.device.type == "cuda" or seeds.shape[0] * vocab <= 2 * CPU_CHUNK:
        return gumbel_from_words(uniform_words(seeds, step, vocab))
    rows = max(1, 2 * CPU_CHUNK // vocab)
    out = torch.empty(seeds.shape[0], vocab, dtype=torch.float32)
    for start in range(0, seeds.shape[0], rows):
        out[start : start + rows] = gumbel_from_words(uniform_words(seeds[start : start + rows], step, vocab))
    return out


def gumbel_argmax(
    logits: torch.Tensor, temperature: float, seeds: torch.Tensor, step: Union[int, torch.Tensor]
) -> torch.Tensor:
    """(B,) tokens drawn from softmax(logits / temperature) by Gumbel-max: argmax(logits / T + G), G the noise of
    (seeds[b], step). logits: (B, V), cast to float32 first."""
    scores = logits.float() / temperature
    return (scores + gumbel_noise(seeds, step, scores.shape[-1])).argmax(-1)
