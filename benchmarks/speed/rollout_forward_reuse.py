"""What `ppo.reuse_rollout_forward` saves: one iteration with and without it, side by side in one process.

Two lmppo trainers on the speed benchmark's tiny models and settings (``compare_trl.py``: batch 8, one minibatch,
4 epochs), one reusing the rollout's policy/value pass as the first epoch's forward and one running it again,
take turns doing one iteration each (which goes first alternates). Time is the process's CPU time (one torch
thread), so other load on the machine barely moves it. The first iteration of each is warm-up and not counted.

    python benchmarks/speed/rollout_forward_reuse.py [--configs base,shared,bf16] [--iterations 10]

Builds the speed benchmark's tiny models and prompts first if they are not cached yet.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
import common  # noqa: E402
import compare_trl  # noqa: E402


def make_trainer(name: str, reuse: bool, iterations: int, cache: Path, out: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmppo.training.trainer import PPOTrainer

    run = compare_trl.make_run_cfg(name, "lmppo", 0, iterations * common.BASE_SETTINGS["batch_size"], cache, out)
    config = compare_trl.lmppo_config(run, out / ("reuse" if reuse else "plain"))
    config.ppo.reuse_rollout_forward = reuse
    config.checkpoint.every = 0
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    policy = AutoModelForCausalLM.from_pretrained(cache / "policy", dtype=torch.float32)
    trainer = PPOTrainer(config, policy=policy, tokenizer=tok, prompts=common.load_prompts(cache)["train"])
    trainer.save_model = lambda directory: None  # timing only: nothing written
    trainer.save_checkpoint = lambda: None
    return trainer


def one_iteration(trainer) -> float:
    """CPU seconds of the trainer's next iteration (rollout, scores, advantages, PPO epochs, logging)."""
    batch = trainer.config.rollout.batch_size
    trainer.config.total_episodes = (trainer.iteration + 1) * batch
    start = time.process_time()
    trainer.train()
    return time.process_time() - start


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--configs", default="base,shared,bf16")
    ap.add_argument("--iterations", type=int, default=10)
    ap.add_argument("--cache", type=Path, default=common.DEFAULT_CACHE_ROOT / "tiny")
    a = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    compare_trl.build_cache(sys.executable, "tiny", a.cache, None, 3600)  # reused when already built
    print(
        f"CPU seconds per iteration (median of {a.iterations - 1}, first iteration left out), one thread; "
        "rollout and update: wall seconds of those phases (median)"
    )
    print(
        f"{'config':12} {'rerun':>8} {'reuse':>8} {'rerun/reuse':>12}   {'rollout rerun/reuse':>20} "
        f"{'update rerun/reuse':>19}"
    )
    for name in a.configs.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            trainers = {reuse: make_trainer(name, reuse, a.iterations, a.cache, Path(tmp)) for reuse in (False, True)}
            seconds: dict[bool, list[float]] = {False: [], True: []}
            for i in range(a.iterations):
                for reuse in (False, True) if i % 2 else (True, False):
                    seconds[reuse].append(one_iteration(trainers[reuse]))
            phases = {
                reuse: {
                    phase: statistics.median(m[f"time/{phase}"] for m in trainer.history[1:])
                    for phase in ("rollout", "update")
                }
                for reuse, trainer in trainers.items()
            }
        rerun, reuse = (statistics.median(seconds[k][1:]) for k in (False, True))
        print(
            f"{name:12} {rerun:8.3f} {reuse:8.3f} {rerun / reuse:11.3f}x   "
            f"{phases[False]['rollout']:9.3f} / {phases[True]['rollout']:<8.3f} "
            f"{phases[False]['update']:8.3f} / {phases[True]['update']:<8.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
