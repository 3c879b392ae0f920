"""Sampling anchors and this machine's roofline: lmppo's native sampler and transformers' `generate` in tokens/s on
the same model, prompts and batch, against what the machine's measured matmul and memory rates allow.

    python benchmarks/sampling_anchors.py [--model smollm2] [--batch 32] [--new 24] [--rounds 5] [--threads 1]
        [--bf16] [--lora]

Roofline of one decoding step (batch B, context length L, Llama shape from the model's config):
  FLOPs = B * (2 * trunk weights + 2 * hidden * vocab + 4 * layers * L * hidden)   (projections, LM head at the
          last position only, attention scores and weighted values)
  bytes = every weight once (trunk + LM head, in the compute dtype) + the KV cache read (2 * layers * L * kv_dim
          per row, in the compute dtype)
The floor of a step is max(FLOPs / matmul rate, bytes / memory rate), with the matmul rate measured at the
step's own shape ((B, hidden) x (hidden, ffn)) and the memory rate by summing a 256 MB tensor, both in this
process at `--threads`. A sampler's "% of roofline" is that floor over its measured time per step (CPU time).
Sampling a whole batch also pays a prefill (not in the floor; its share is printed). llama.cpp is not measured
here (its Python package builds from source, which did not fit this session).
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lmppo.models import resolve_model_path
from lmppo.rollout import sample_responses
from lmppo.sampling import SamplingWeights, sample_native
from sampler_speed import bench_policy  # noqa: E402  (benchmarks/ is on the path when a script runs)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flops  # noqa: E402


def memory_gbps(threads: int, megabytes: int = 256, seconds: float = 1.0) -> float:
    """Read bandwidth: sums of a `megabytes` float32 tensor, CPU time."""
    torch.set_num_threads(threads)
    x = torch.ones(megabytes * 2 ** 20 // 4)
    x.sum()
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds * threads:
        x.sum()
        count += 1
    return x.numel() * 4 * count / ((time.process_time() - start) / threads) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true")
    ap.add_argument("--lora", action="store_true", help="LoRA r 16 all-linear on the policy (the default job's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model, ids, mask, no_stop, seeds, gen_config = bench_policy(args)
    path = resolve_model_path(args.model)
    weights = SamplingWeights()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def native():
        with autocast():
            return sample_native(weights.model_for(model), ids, mask, 1.0, args.new, no_stop, tok.pad_token_id, seeds)

    def hf():
        with autocast():
            return sample_responses(model, ids, mask, gen_config, no_stop, args.new)

    def prefill():
        with autocast():
            return sample_native(weights.model_for(model), ids, mask, 1.0, 1, no_stop, tok.pad_token_id, seeds)

    samplers = {"lmppo native": native, "HF generate": hf, "prefill + 1 token": prefill}
    for fn in samplers.values():
        fn()
    cpu = {n: [] for n in samplers}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for name, fn in samplers.items():
            start = time.process_time()
            fn()
            cpu[name].append(time.process_time() - start)
    load1 = os.getloadavg()

    shape = flops.llama_shape(Path(path) / "config.json")
    config = json.loads((Path(path) / "config.json").read_text())
    dtype_bytes = 2 if args.bf16 else 4
    B, P = args.batch, ids.shape[1]
    L = P + args.new / 2  # mean context over the decoding steps
    step_flops = B * (2 * shape["trunk_params"] + 2 * shape["hidden"] * shape["vocab"]
                      + 4 * shape["layers"] * L * shape["hidden"])
    step_bytes = ((shape["trunk_params"] + shape["hidden"] * shape["vocab"]) * dtype_bytes
                  + B * 2 * shape["layers"] * L * shape["kv_dim"] * dtype_bytes)
    dtype_name = "bfloat16" if args.bf16 else "float32"
    rate = flops.matmul_gflops(dtype_name, args.threads, m=B, k=shape["hidden"], n=shape["ffn"], seconds=0.5)
    bandwidth = memory_gbps(args.threads)
    floor = max(step_flops / (rate * 1e9), step_bytes / (bandwidth * 1e9))
    print(f"model {args.model} ({config.get('model_type')}, {shape['trunk_params'] / 1e6:.0f}M trunk weights, vocab "
          f"{shape['vocab']}), batch {B} x {args.new} new tokens after {P}-token prompts, {args.threads} thread(s), "
          f"{dtype_name}{', LoRA r 16' if args.lora else ''}; capability {torch.backends.cpu.get_cpu_capability()}, "
          f"AVX-512 BF16 {torch.cpu._is_avx512_bf16_supported()}; load average {load0[0]:.2f} -> {load1[0]:.2f}")
    print(f"roofline per decoding step: {step_flops / 1e9:.2f} GFLOP at {rate:.0f} GFLOP/s ({B}x{shape['hidden']}x"
          f"{shape['ffn']} {dtype_name} matmul) = {1e3 * step_flops / (rate * 1e9):.1f} ms; {step_bytes / 1e6:.0f} MB "
          f"at {bandwidth:.1f} GB/s = {1e3 * step_bytes / (bandwidth * 1e9):.1f} ms -> floor {1e3 * floor:.1f} ms "
          f"({B / floor:.0f} tokens/s)")
    pre = min(cpu["prefill + 1 token"])
    for name in ("lmppo native", "HF generate"):
        best, med = min(cpu[name]), statistics.median(cpu[name])
        per_step = (best - pre) / (args.new - 1)
        print(f"  {name:13} {B * args.new / best:7.1f} tokens/s (CPU min {best:.3f} s, median {med:.3f} s); "
              f"decoding {1e3 * per_step:.1f} ms/step = {100 * floor / per_step:.0f}% of the roofline "
              f"(prefill {pre:.3f} s = {100 * pre / best:.0f}% of the call)")


if __name__ == "__main__":
    main()
