"""Reward granularity: per-token rewards vs the same signal summed into one score, over several seeds.

The task and the runs are those of `tests/rewards/test_learning_granularity.py` (a tiny random Llama writes 24 tokens;
each token earns +1 if it is in a target quarter of the vocabulary, -1 otherwise; `tokens` gets that list,
`scalar` gets its sum on the last token). For each seed both forms train with the same budget; the score is the
fraction of target tokens in fresh samples after training (0.25 is chance).

    python benchmarks/learning/granularity.py [--seeds 0,1,2,3,4,5] [--iterations 12 [16 ...]]

Prints, per budget, the mean +- sd over seeds of the final target fraction for each form, the mean per-seed
difference, and on how many seeds per-token won. Runs on CPU in about 5 s per run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

ROOT = bench_path.ROOT
bench_path.put_first(bench_path.TESTS, bench_path.SRC)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2,3,4,5", help="comma-separated seeds")
    parser.add_argument("--iterations", type=int, nargs="+", default=[12], help="budgets (iterations of 16 episodes)")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from test_learning_granularity import BATCH, RESPONSE_TOKENS, run_target_task

    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for iterations in args.iterations:
            finals: dict[str, list[float]] = {"tokens": [], "scalar": []}
            kls: dict[str, list[float]] = {"tokens": [], "scalar": []}
            for seed in seeds:
                for form in ("tokens", "scalar"):
                    r = run_target_task(form, seed, os.path.join(tmp, f"{form}-{seed}-{iterations}"), iterations)
                    finals[form].append(r["final"])
                    kls[form].append(r["kl"])
                print(
                    f"  budget {iterations:>3} it, seed {seed}: tokens {finals['tokens'][-1]:.3f}  "
                    f"scalar {finals['scalar'][-1]:.3f}",
                    flush=True,
                )
            rows.append((iterations, finals, kls))

    def ms(xs):
        return f"{statistics.mean(xs):.3f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"

    print(
        f"\nTarget-token fraction after training ({len(seeds)} seeds; {RESPONSE_TOKENS} tokens per response, "
        f"{BATCH} episodes per iteration; chance 0.25)"
    )
    print(
        "| episodes | per-token rewards | scalar (sum on last token) | per-token - scalar | per-token wins | "
        "KL tokens / scalar |"
    )
    print("|---:|---:|---:|---:|---:|---:|")
    for iterations, finals, kls in rows:
        diff = [a - b for a, b in zip(finals["tokens"], finals["scalar"])]
        wins = sum(d > 0 for d in diff)
        print(
            f"| {iterations * BATCH} | {ms(finals['tokens'])} | {ms(finals['scalar'])} | {ms(diff)} | "
            f"{wins}/{len(diff)} | {statistics.mean(kls['tokens']):.2f} / {statistics.mean(kls['scalar']):.2f} |"
        )
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
