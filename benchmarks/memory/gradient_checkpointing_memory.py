"""Peak memory of one training pass (forward + backward) with and without `model.gradient_checkpointing`.

Each variant runs in a fresh subprocess: it builds a random Llama (hidden 512, 8 layers, vocabulary 8192; fp32),
applies lmppo's `prepare_policy` (eval mode, optional LoRA) and, for the checkpointed variant,
`models.enable_gradient_checkpointing`, then runs `models.policy_forward` on a batch of B sequences of L tokens
and a backward pass of a log-likelihood loss. Printed: the resident set size after the model is built (the
baseline) and the peak (`ru_maxrss`) above it, for each variant, and their ratio. CPU only; activation memory on a
GPU follows the same count (one set of layer activations per layer without checkpointing, about one layer's with).

    PYTHONPATH=src python benchmarks/memory/gradient_checkpointing_memory.py [--batch 8] [--length 512] [--lora]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys


def _rss_mb() -> float:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_variant(checkpointing: bool, batch: int, length: int, lora: bool) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from lmppo.config import Config
    from lmppo.models.loading import enable_gradient_checkpointing, policy_forward, prepare_policy

    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    mc = Config().model
    mc.lora.enabled = lora
    policy = prepare_policy(LlamaForCausalLM(cfg), mc)
    if checkpointing:
        enable_gradient_checkpointing(policy)
    ids = torch.randint(0, 8192, (batch, length))
    mask = torch.ones_like(ids, dtype=torch.bool)
    prompt = 16
    baseline = _rss_mb()
    logits = policy_forward(policy, ids, mask, prompt, 1.0).logits
    loss = -torch.log_softmax(logits, -1).gather(-1, ids[:, prompt:, None]).mean()
    loss.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "checkpointing": checkpointing,
        "baseline_mb": round(baseline),
        "peak_mb": round(peak),
        "pass_mb": round(peak - baseline),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=512)
    p.add_argument("--lora", action="store_true")
    p.add_argument("--variant", choices=["on", "off"], default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.variant:
        print(json.dumps(run_variant(args.variant == "on", args.batch, args.length, args.lora)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows = []
    for variant in ("off", "on"):
        cmd = [
            sys.executable,
            __file__,
            "--variant",
            variant,
            "--batch",
            str(args.batch),
            "--length",
            str(args.length),
        ] + (["--lora"] if args.lora else [])
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(
        f"batch {args.batch} x {args.length} tokens, {'LoRA' if args.lora else 'full weights'}, hidden 512, "
        "8 layers, fp32, CPU"
    )
    for r in rows:
        print(
            f"  gradient_checkpointing {str(r['checkpointing']):5}: model built {r['baseline_mb']:6d} MB, "
            f"peak {r['peak_mb']:6d} MB, forward + backward above the model {r['pass_mb']:6d} MB"
        )
    print(f"  ratio (off / on) of the pass's memory: {rows[0]['pass_mb'] / max(rows[1]['pass_mb'], 1):.2f}")


if __name__ == "__main__":
    main()
