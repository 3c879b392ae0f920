"""The default job's phases at two commits, side by side: alternating worker processes, one per source tree.

    python benchmarks/speed/phase_ab.py --base REV [--head REV] [--rounds 6] [--iterations 2] [--threads 1]
        [--precision bf16]

Each tree is `git archive REV src` unpacked into a temporary folder (`--head` defaults to the working tree's src/).
Every round runs one worker per tree, in turn. A worker imports lmppo from its tree, builds the trainer of that
tree's built-in default recipe (`lmppo train` with no arguments: SmolLM2-135M, LoRA, batch 32, 24 new tokens),
runs one warm-up iteration and then `--iterations` timed ones: the rollout phase (sampling, the reference pass, the
policy/value pass), the score/rewards/advantages phases, and the PPO update, each in process CPU time, plus the
sampling engine's share of the rollout. It prints, per phase, min / p10 / median over all timed iterations of each
tree, and the base/head ratio of each round's medians with its spread. CPU time is what survives a shared
machine; `--threads 1` keeps it so.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)
import flops  # noqa: E402
from common import percentile, time_sampling, timed_iteration  # noqa: E402

ROOT = bench_path.ROOT
PHASES = ("iteration", "rollout", "sampling", "update")


def unpack(rev: str, into: Path) -> Path:
    """`src/` of commit `rev` under `into`; returns the folder to put on PYTHONPATH."""
    blob = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(blob)) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def worker(args) -> None:
    import torch

    import lmppo
    from lmppo.config import load_config
    from lmppo.training.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    cfg = load_config(str(Path(lmppo.__file__).parent / "recipes" / "sentiment.yaml"))  # the tree's default job
    cfg.output_dir, cfg.overwrite, cfg.log.trackers, cfg.log.progress = tempfile.mkdtemp(), True, [], False
    cfg.precision = args.precision
    trainer = PPOTrainer(cfg)
    spent: dict[str, float] = {}
    time_sampling(trainer, spent)
    rows = []
    for i in range(args.iterations + 1):  # the first: warm-up
        timed_iteration(trainer, spent)
        if i:
            rows.append({p: spent.get(p) for p in PHASES})
    Path(args.result).write_text(json.dumps({"rows": rows, "lmppo": lmppo.__file__}))


def default_job_floor(threads: int) -> dict[str, float]:
    """The FLOPs the default job's rollout and iteration need (`flops.forward_flops`, padded prompt columns counted
    as computed: the batch's prompts are left-padded to the longest), and seconds at the bf16 matmul rate this
    process measures. Rollout: sampling (prefill of the prompts, then one token per step for every row), the
    reference pass and the policy/value pass (two minibatches: no reuse of the rollout forward). Update: per epoch a
    forward and a backward pass over the batch; with LoRA the backward computes the activations' gradients (about
    one forward) and the adapters' small weight gradients, so 2 forwards' worth."""
    import random

    from lmppo.config import ModelConfig, load_config, recipe_path
    from lmppo.data.prompts import load_prompt_records, tokenize_prompts
    from lmppo.models.loading import load_tokenizer, resolve_model_path

    cfg = load_config(recipe_path("sentiment"))
    path = resolve_model_path(cfg.model.policy)
    lengths = [
        len(ids)
        for ids in tokenize_prompts(
            load_prompt_records(cfg.data, None), load_tokenizer(path, ModelConfig()), cfg.data
        ).ids
    ]
    rng = random.Random(0)
    batch, new = cfg.rollout.batch_size, cfg.rollout.max_new_tokens
    prompt = statistics.mean(max(rng.sample(lengths, batch)) for _ in range(200))
    shape = flops.llama_shape(Path(path) / "config.json")
    one_pass = batch * flops.forward_flops(shape, prompt + new, new)
    sampling = batch * flops.forward_flops(shape, prompt, 1) + sum(
        batch * (flops.forward_flops(shape, prompt + t + 1, 1) - flops.forward_flops(shape, prompt + t, 0))
        for t in range(new - 1)
    )
    rollout = sampling + 2 * one_pass
    update = cfg.ppo.num_epochs * 2 * one_pass
    rate = flops.matmul_gflops("bfloat16", threads) * 1e9
    return {
        "prompt": prompt,
        "rollout_gflop": rollout / 1e9,
        "iteration_gflop": (rollout + update) / 1e9,
        "rate_gflops": rate / 1e9,
        "rollout_s": rollout / rate,
        "iteration_s": (rollout + update) / rate,
    }


def read_result(path: Path, src: Path) -> list[dict]:
    """A worker's timed iterations; exits if its lmppo did not come from `src`."""
    result = json.loads(path.read_text())
    if not result["lmppo"].startswith(str(src)):  # an installed lmppo shadowed the tree
        sys.exit(f"error: the worker of {path.name} imported lmppo from {result['lmppo']}, not from {src}")
    return result["rows"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", help="the commit to compare against (git rev); required")
    ap.add_argument("--head", default=None, help="default: the working tree's src/")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--iterations", type=int, default=2, help="timed iterations per worker (after one warm-up)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--precision", default="bf16", help="the same for both trees (older trees have no `auto`)")
    ap.add_argument(
        "--report",
        type=Path,
        default=None,
        metavar="DIR",
        help="print the report of an earlier run from its folder (the phase_ab-* folder it printed)",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    if not args.base:
        ap.error("--base REV is required")
    import torch

    labels = {"base": args.base, "head": args.head or "working tree"}
    if args.report:
        tmp = args.report
        trees = {"base": tmp / "base" / "src", "head": tmp / "head" / "src" if args.head else ROOT / "src"}
        results = {
            side: [read_result(tmp / f"{side}-{r}.json", src) for r in range(args.rounds)]
            for side, src in trees.items()
        }
        load = []
    else:
        tmp = Path(tempfile.mkdtemp(prefix="phase_ab-"))
        print(f"workers' results and logs in {tmp}", flush=True)
        trees = {
            "base": unpack(args.base, tmp / "base"),
            "head": unpack(args.head, tmp / "head") if args.head else ROOT / "src",
        }
        results = {side: [] for side in trees}
        load = [os.getloadavg()]
    for r in range(0 if args.report else args.rounds):
        for side, src in trees.items():
            out = tmp / f"{side}-{r}.json"
            env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": str(args.threads)}
            with open(tmp / f"{side}-{r}.log", "w") as log:
                done = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--worker",
                        "--result",
                        str(out),
                        "--iterations",
                        str(args.iterations),
                        "--threads",
                        str(args.threads),
                        "--precision",
                        args.precision,
                    ],
                    env=env,
                    cwd=tmp,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            if done.returncode:
                sys.exit(f"error: the {side} worker failed (exit {done.returncode}); its output: {log.name}")
            results[side].append(read_result(out, src))
            print(
                f"round {r + 1}/{args.rounds} {side:4} iteration medians "
                f"{statistics.median(row['iteration'] for row in results[side][-1]):.2f} s",
                flush=True,
            )
    if not args.report:
        load.append(os.getloadavg())
    print(
        f"\nthe default job's phases, base {labels['base']} against head {labels['head']}: {args.rounds} rounds x "
        f"{args.iterations} iterations per tree, precision {args.precision}, {args.threads} thread(s); capability "
        f"{torch.backends.cpu.get_cpu_capability()}, AVX-512 BF16 {torch.cpu._is_avx512_bf16_supported()}; "
        + (
            f"load average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at the end"
            if load
            else "reported again from the saved results"
        )
    )
    print(f"{'phase (cpu s)':14} {'side':5} {'min':>7} {'p10':>7} {'p50':>7} | base/head per round (medians)")
    for phase in PHASES:
        per_round = {
            side: [
                statistics.median(row[phase] for row in rows)
                for rows in results[side]
                if all(row[phase] is not None for row in rows)
            ]
            for side in trees
        }
        for side in trees:
            xs = [row[phase] for rows in results[side] for row in rows if row[phase] is not None]
            if xs:
                print(f"{phase:14} {side:5} {min(xs):7.3f} {percentile(xs, 10):7.3f} {percentile(xs, 50):7.3f}")
        if per_round["base"] and per_round["head"]:
            ratios = [b / h for b, h in zip(per_round["base"], per_round["head"])]
            print(
                f"{phase:14} speed-up head vs base: median x{statistics.median(ratios):.2f} "
                f"[{min(ratios):.2f}, {max(ratios):.2f}] over rounds"
            )
    if args.precision != "bf16":
        return
    floor = default_job_floor(args.threads)
    print(
        f"\nFLOP floor of the default job (batch prompts padded to {floor['prompt']:.1f} tokens on average; bf16 "
        f"matmul {floor['rate_gflops']:.0f} GFLOP/s at {args.threads} thread(s), measured now):"
    )
    for phase, needed, seconds in (
        ("rollout", floor["rollout_gflop"], floor["rollout_s"]),
        ("iteration", floor["iteration_gflop"], floor["iteration_s"]),
    ):
        p10 = {side: percentile([row[phase] for rows in results[side] for row in rows], 10) for side in trees}
        print(
            f"  {phase:9} needs {needed:.0f} GFLOP = {seconds:.2f} s at that rate; p10 base {p10['base']:.2f} s "
            f"({seconds / p10['base']:.0%} of the rate), head {p10['head']:.2f} s ({seconds / p10['head']:.0%}); "
            f"2x faster than base would take {seconds / (p10['base'] / 2):.0%}, 1.5x "
            f"{seconds / (p10['base'] / 1.5):.0%}"
        )


if __name__ == "__main__":
    main()
