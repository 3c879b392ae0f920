"""The default job's iterations with and without one bf16 cast of the frozen weights (`lmppo.models.frozen_casts`), in
one
process, alternating.

    python benchmarks/speed/frozen_casts.py [--rounds 6] [--threads 1] [--precision auto] [--where copy|all]
        [--reward-model PATH]

Builds the trainer of `lmppo train` with no arguments (the built-in default recipe: SmolLM2-135M, LoRA r 16
all-linear, batch 32, 24 new tokens, shared value head, `precision: auto`) and runs whole iterations (rollout,
score, rewards, advantages, the PPO update), alternately with the frozen linear layers as plain nn.Linear ("cast
each pass": autocast casts the fp32 weight at every call) and as FrozenCastLinear ("cast once"). `--where copy`
(lmppo's setting): the sampler's copy only (its LM head; `SamplingWeights.keep_casts`); `--where all`: also every
frozen linear layer of the policy, a reference copy and reward models (the passes over whole batches).
`--reward-model PATH` swaps the recipe's reward for a reward model (the learned-reward benchmark's kind of run).
Prints per-iteration process CPU time (min, p10, median) of the iteration and of its rollout and update phases, and
the per-round ratio with its spread. Under `precision: fp32` nothing is cast, and both variants run the same code.
"""

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from lmppo.config import RewardSourceConfig, load_config, recipe_path
from lmppo.models.frozen_casts import reuse_frozen_casts
from lmppo.training.trainer import PPOTrainer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
from common import percentile, time_sampling, timed_iteration  # noqa: E402

VARIANTS = ("cast each pass", "cast once")


def switch(trainer: PPOTrainer, keep: bool, where: str) -> None:
    """Casts kept (`keep`) or made at every call, in the sampling copy and, `where == "all"`, in every model the
    iteration runs: the actor, a reference copy, reward models."""
    trainer.sampling_engine().weights.keep_casts = keep  # applied to the copy at its next refresh
    if where == "all":
        for model in [trainer.actor, trainer.reference.model] + [
            getattr(s, "model", None) for s in trainer.reward_sources
        ]:
            if isinstance(model, torch.nn.Module):
                reuse_frozen_casts(model, enabled=keep)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--where", choices=["copy", "all"], default="copy")
    ap.add_argument("--reward-model", default=None, help="a reward model folder instead of the recipe's reward")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(recipe_path("sentiment"))  # what `lmppo train` runs with no config
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.progress = tempfile.mkdtemp(), True, [], False
    cfg.precision = args.precision
    if args.reward_model:
        cfg.reward.sources = [RewardSourceConfig(kind="model", path=args.reward_model, name="rm")]
    trainer = PPOTrainer(cfg)
    phases = ("iteration", "rollout", "sampling", "update")
    times: dict[str, dict[str, list[float]]] = {v: {phase: [] for phase in phases} for v in VARIANTS}
    spent: dict[str, float] = {}
    time_sampling(trainer, spent)
    load = [os.getloadavg()]
    for r in range(args.rounds + 1):  # round 0: warm-up (the sampling copy and the casts are built there)
        for variant in VARIANTS:
            switch(trainer, variant == "cast once", args.where)
            timed_iteration(trainer, spent)
            if r:
                for phase in phases:
                    times[variant][phase].append(spent[phase])
    load.append(os.getloadavg())
    print(
        f"default job's iterations (batch {cfg.rollout.batch_size}, {cfg.rollout.max_new_tokens} new tokens, LoRA "
        f"{'r %d' % cfg.model.lora.r if cfg.model.lora.enabled else 'off'}, reward "
        f"{'model' if args.reward_model else 'recipe'}, casts kept in: {args.where}, precision {cfg.precision}, "
        f"{args.threads} thread(s)), "
        f"{args.rounds} alternating rounds; capability {torch.backends.cpu.get_cpu_capability()}, AVX-512 BF16 "
        f"{torch.cpu._is_avx512_bf16_supported()}; load average {load[0][0]:.2f} at the start, {load[1][0]:.2f} "
        "at the end"
    )
    print(f"{'':15}" + "".join(f" {phase + ' cpu s: min':>24} {'p10':>7} {'p50':>7}" for phase in times[VARIANTS[0]]))
    for v in VARIANTS:
        print(
            f"{v:15}"
            + "".join(f" {min(t):24.3f} {percentile(t, 10):7.3f} {percentile(t, 50):7.3f}" for t in times[v].values())
        )
    for phase in times[VARIANTS[0]]:
        before, after = times[VARIANTS[0]][phase], times[VARIANTS[1]][phase]
        ratios = [a / b for a, b in zip(before, after)]
        print(
            f"{phase} speed-up cast once / cast each pass, per round: median x{statistics.median(ratios):.2f} "
            f"[{min(ratios):.2f}, {max(ratios):.2f}]; at p10 x{percentile(before, 10) / percentile(after, 10):.2f}"
        )


if __name__ == "__main__":
    main()
