"""Attention on CPU: the plain (eager) path vs torch's fused SDPA kernel, forward + backward of one layer.

Prints, per sequence length and dtype, the CPU time of each and the ratio SDPA / eager (> 1: eager is faster).
This is the measurement behind `lmppo.models.attention.EAGER_MAX_SCORES`.

    python benchmarks/speed/attention_cpu.py [--lengths 64,128,256,512] [--batch 8 --heads 8 --head-dim 64]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from lmppo.models.attention import eager_attention


def cpu_ms(fn, repeats: int) -> float:
    fn(), fn()  # warm-up
    start = time.process_time()
    for _ in range(repeats):
        fn()
    return (time.process_time() - start) / repeats * 1000


def layer_step(kind: str, dtype: torch.dtype, B: int, H: int, L: int, D: int):
    q, k, v = (torch.randn(B, H, L, D, dtype=dtype, requires_grad=True) for _ in range(3))
    allowed = torch.ones(L, L, dtype=torch.bool).tril()[None, None].repeat(B, 1, 1, 1)
    allowed[: B // 2, :, :, :5] = False  # left padding in half of the rows
    allowed[:, :, torch.arange(L), torch.arange(L)] = True
    additive = torch.zeros(B, 1, L, L).masked_fill(~allowed, torch.finfo(torch.float32).min)

    def step():
        if kind == "eager":
            out, _ = eager_attention(q, k, v, additive)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        out.float().sum().backward()

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="64,128,256,512")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"one attention layer, forward + backward, batch {args.batch}, {args.heads} heads of {args.head_dim}, "
        f"{args.threads} thread(s); CPU ms"
    )
    print(
        f"{'tokens':>6} | {'fp32 eager':>10} {'fp32 sdpa':>10} {'sdpa/eager':>10} | "
        f"{'bf16 eager':>10} {'bf16 sdpa':>10} {'sdpa/eager':>10}"
    )
    for L in (int(x) for x in args.lengths.split(",")):
        repeats = max(2, 2560 // L)
        row = []
        for dtype in (torch.float32, torch.bfloat16):
            eager = cpu_ms(layer_step("eager", dtype, args.batch, args.heads, L, args.head_dim), repeats)
            sdpa = cpu_ms(layer_step("sdpa", dtype, args.batch, args.heads, L, args.head_dim), repeats)
            row.append(f"{eager:10.1f} {sdpa:10.1f} {sdpa / eager:9.2f}x")
        print(f"{L:>6} | {row[0]} | {row[1]}")


if __name__ == "__main__":
    main()
