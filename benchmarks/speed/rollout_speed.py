"""The default job's rollout phase with and without the sampling copy (LoRA folded, bf16 weights), in one process.

    python benchmarks/speed/rollout_speed.py [--rounds 6] [--threads 1] [--precision auto]

Builds the trainer of `lmppo train` with no arguments (the built-in default recipe: SmolLM2-135M, LoRA r 16
all-linear, batch 32, 24 new tokens, shared value head, `precision: auto`) and runs its rollout phase
(`PPOTrainer.collect_rollout`: sampling, the reference pass with the adapters off, the policy/value pass)
alternately with the native engine on the policy itself ("unfolded") and on its sampling copy ("folded"). No
update runs between rollouts, so both see the same weights. Prints per-call process CPU time (min, p10, median) of
the whole phase and of the sampling inside it, and the per-round ratio with its spread.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from lmppo.config import load_config, recipe_path
from lmppo.training.trainer import PPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
from common import percentile  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--lora", type=int, default=1, help="0: the recipe without LoRA (full weights)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(recipe_path("sentiment"))  # what `lmppo train` runs with no config
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.progress = tempfile.mkdtemp(), True, [], False
    cfg.precision = args.precision
    cfg.model.lora.enabled = bool(args.lora)
    trainer = PPOTrainer(cfg)
    engine = trainer.sampling_engine()
    sample = engine.sample
    spent = {"sample": 0.0}

    def timed_sample(policy, prompts):
        start = time.process_time()
        try:
            return sample(policy, prompts)
        finally:
            spent["sample"] += time.process_time() - start

    engine.sample = timed_sample
    whole = {"unfolded": [], "folded": []}
    sampling = {"unfolded": [], "folded": []}
    for variant in whole:  # warm-up: the copy is built here
        engine.copies = variant == "folded"
        trainer.collect_rollout()
    load = [os.getloadavg()]
    for _ in range(args.rounds):
        for variant in whole:
            engine.copies = variant == "folded"
            spent["sample"] = 0.0
            start = time.process_time()
            trainer.collect_rollout()
            whole[variant].append(time.process_time() - start)
            sampling[variant].append(spent["sample"])
    load.append(os.getloadavg())
    print(
        f"default job's rollout phase (batch {cfg.rollout.batch_size}, {cfg.rollout.max_new_tokens} new tokens, "
        f"LoRA {'r %d' % cfg.model.lora.r if cfg.model.lora.enabled else 'off'}, "
        f"precision {cfg.precision} -> autocast "
        f"{'bf16' if trainer._autocast().__class__.__name__ != 'nullcontext' else 'off'}"
        f", {args.threads} thread(s)), {args.rounds} alternating rounds; capability "
        f"{torch.backends.cpu.get_cpu_capability()}, AVX-512 BF16 {torch.cpu._is_avx512_bf16_supported()}; load "
        f"average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end"
    )
    print(f"{'':9} {'phase cpu s: min':>16} {'p10':>7} {'p50':>7}   {'sampling: min':>13} {'p10':>7} {'p50':>7}")
    for v in whole:
        print(
            f"{v:9} {min(whole[v]):16.3f} {percentile(whole[v], 10):7.3f} {percentile(whole[v], 50):7.3f}   "
            f"{min(sampling[v]):13.3f} {percentile(sampling[v], 10):7.3f} {percentile(sampling[v], 50):7.3f}"
        )
    for name, figures in (("phase", whole), ("sampling", sampling)):
        ratios = [a / b for a, b in zip(figures["unfolded"], figures["folded"])]
        print(
            f"{name} speed-up folded/unfolded per round: median x{statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}, {max(ratios):.2f}]; at p10 "
            f"x{percentile(figures['unfolded'], 10) / percentile(figures['folded'], 10):.2f}"
        )


if __name__ == "__main__":
    main()
