"""A learned, hackable reward: does the KL stay where the user sets it, and how much held-out reward per nat?

The task (issue 13), built deterministically from packaged data:
  * reward model: SmolLM2-135M-Instruct with a one-label score head, fine-tuned (full weights, BCE on the
    label) on 160 of the 200 labelled sentences of gensim's `pang_lee_polarity.cor`; the other 40 measure it
    (accuracy and AUC are printed and stored). Unlike VADER it is a learned model, so it can be over-optimised.
  * prompts: lmppo's `builtin:reviews` (review openings), 32 of them held out by the run's seed.
  * judges the policy never trains on, on the held-out samples: VADER, the MiniLM sentiment judge, and two
    MiniLM checks of reward hacking: the prompt-relevance gap (cosine of a completion with its own prompt minus
    its mean cosine with the other prompts) and the completions' self-similarity (mean pairwise cosine).

Sub-commands (run from the repository root with lmppo's venv; `trl` runs in the TRL 1.12 venv):
    python benchmarks/learning/learned_reward.py build                       # reward model + TRL-format cache, once
    python benchmarks/learning/learned_reward.py lmppo --target 5 --seed 0   # train (640 episodes), eval, judge
    .venv-trl/bin/python benchmarks/learning/learned_reward.py trl --kl-coef 0.05 --seed 0
    python benchmarks/learning/learned_reward.py judge RUN_DIR               # eval + judge a TRL run (lmppo venv)
    python benchmarks/learning/learned_reward.py interpolate RUN_DIR         # a run interpolated toward its start
    python benchmarks/learning/learned_reward.py lmppo --target 5 --seed 100 --set data.holdout_seed 0 \
        --name lmppo-b-t5-s0
    python benchmarks/learning/learned_reward.py merge lmppo-m2-t5-s0 lmppo-pin-t5-s0 lmppo-b-t5-s0   # WARP's merge
    python benchmarks/learning/learned_reward.py merge lmppo-kb2-s0 lmppo-pin-t20-s0 lmppo-pinb-t20-s0 --kl-budget 2
    python benchmarks/learning/learned_reward.py warp --target 20 --seed 2 --budgets 2 5 10   # `lmppo warp`
    python benchmarks/learning/learned_reward.py report [--lmppo PREFIX ...] # the table (and a plot) of the runs

Every run writes `result.json` and `eval.json` (the held-out samples and their scores) in its folder under
benchmarks/.cache/learned_reward/runs/; a compact record of both (eval.json's summary and the per-prompt mean scores,
not the samples) is also written as one line of benchmarks/results/learned_reward.jsonl, which is committed, so
`report` can read runs whose cache is gone (a run in the cache wins over its record).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

HERE = bench_path.BENCHMARKS
ROOT = bench_path.ROOT
CACHE = HERE / ".cache" / "learned_reward"
RUNS = CACHE / "runs"
RECORDS = HERE / "results" / "learned_reward.jsonl"  # one compact line per judged run, kept in the repository
RM_SPLIT_SEED = 13
RM_TRAIN = 160
HOLDOUT = 32
EPISODES = 640
RECIPE_REWARD = [
    {"kind": "model", "path": None, "name": "rm", "weight": 1.0},
    {"kind": "function", "path": "lmppo.rewards.builtin:vader_sentiment", "name": "vader", "weight": 0.0},
    {"kind": "function", "path": "lmppo.rewards.builtin:minilm_sentiment", "name": "minilm_judge", "weight": 0.0},
]


# ----------------------------------------------------------------------------- build (lmppo venv)
def build(force: bool = False) -> dict:
    """The reward model (trained here) and the TRL-format cache (tokenizer, policy, critic, reward)."""
    manifest_path = CACHE / "manifest.json"
    if manifest_path.exists() and not force:
        return json.loads(manifest_path.read_text())
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    from lmppo.models.assets import ensure_smollm2, polarity_sentences

    t0 = time.time()
    model_dir = ensure_smollm2()
    CACHE.mkdir(parents=True, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # TRL finds where a response ends by its first pad token: pad must differ from the stop token
        spare = [t for t in tokenizer.all_special_tokens if t not in (tokenizer.eos_token, tokenizer.bos_token)]
        tokenizer.pad_token = spare[0] if spare else tokenizer.unk_token
    tokenizer.padding_side = "left"
    texts, labels = polarity_sentences()
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(RM_SPLIT_SEED)).tolist()
    train_idx, test_idx = order[:RM_TRAIN], order[RM_TRAIN:]

    torch.manual_seed(RM_SPLIT_SEED)
    rm = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
    rm.config.pad_token_id = tokenizer.pad_token_id
    opt = torch.optim.AdamW(rm.parameters(), lr=3e-5, weight_decay=0.0)
    gen = torch.Generator().manual_seed(RM_SPLIT_SEED + 1)
    rm.train()
    for epoch in range(3):
        perm = torch.randperm(len(train_idx), generator=gen).tolist()
        for start in range(0, len(perm), 16):
            batch = [train_idx[i] for i in perm[start : start + 16]]
            enc = tokenizer([texts[i] for i in batch], return_tensors="pt", padding=True)
            y = torch.tensor([float(labels[i]) for i in batch])
            loss = torch.nn.functional.binary_cross_entropy_with_logits(rm(**enc).logits[:, 0], y)
            loss.backward()
            opt.step()
            opt.zero_grad()
    rm.eval()
    with torch.no_grad():
        enc = tokenizer([texts[i] for i in test_idx], return_tensors="pt", padding=True)
        s = rm(**enc).logits[:, 0]
    y = torch.tensor([labels[i] for i in test_idx])
    accuracy = float(((s > 0).long() == y).float().mean())
    pos, neg = s[y == 1], s[y == 0]
    auc = float((pos[:, None] > neg[None, :]).float().mean())
    for name in ("reward", "critic"):  # TRL's value model starts from the reward model, as in TRL's examples
        rm.save_pretrained(CACHE / name)
        tokenizer.save_pretrained(CACHE / name)
    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.save_pretrained(CACHE / "policy")
    tokenizer.save_pretrained(CACHE / "policy")
    tokenizer.save_pretrained(CACHE / "tokenizer")
    manifest = {
        "reward_model": {
            "heldout_accuracy": accuracy,
            "heldout_auc": auc,
            "train": RM_TRAIN,
            "test": len(test_idx),
            "epochs": 3,
            "lr": 3e-5,
        },
        "pad_token": tokenizer.pad_token,
        "seconds": round(time.time() - t0, 1),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    print(f"reward model: held-out accuracy {accuracy:.2f}, AUC {auc:.2f} ({manifest['seconds']} s)")
    return manifest


def recipe(output_dir: Path, seed: int, **kl) -> dict:
    """The built-in recipe with the learned reward model, 640 episodes, and `kl` settings."""
    import yaml

    cfg = yaml.safe_load((ROOT / "src/lmppo/recipes/sentiment.yaml").read_text())
    cfg.update(output_dir=str(output_dir), seed=seed, total_episodes=EPISODES, overwrite=True)
    cfg["model"]["policy"] = str(CACHE / "policy")
    sources = [dict(s) for s in RECIPE_REWARD]
    sources[0]["path"] = str(CACHE / "reward")
    cfg["reward"]["sources"] = sources
    cfg["data"]["holdout"] = HOLDOUT
    cfg["kl"] = {**cfg.get("kl", {}), **kl}
    cfg["log"] = {"trackers": [], "sample_every": 0, "progress": False}
    cfg["checkpoint"] = {"every": 0}
    return cfg


def train_lmppo(args) -> Path:
    import yaml

    kl = {"controller": args.controller, "target": args.target}
    if args.kl_coef is not None:
        kl["coef"] = args.kl_coef
    name = (
        args.name
        or f"lmppo-{args.controller}-t{args.target:g}"
        + (f"-c{args.kl_coef:g}" if args.kl_coef is not None else "")
        + f"-s{args.seed}"
    )
    out = RUNS / name
    out.mkdir(parents=True, exist_ok=True)
    cfg = recipe(out / "run", args.seed, **kl)
    for dotted, value in args.set or []:  # `section.field` or a top-level field (total_episodes)
        section, _, field = dotted.rpartition(".")
        (cfg.setdefault(section, {}) if section else cfg)[field] = yaml.safe_load(value)
    (out / "recipe.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    t0 = time.time()
    subprocess.run(
        [sys.executable, "-m", "lmppo.apps.cli", "train", str(out / "recipe.yaml")],
        check=True,
        cwd=ROOT,
        stdout=open(out / "train.log", "w"),
        stderr=subprocess.STDOUT,
    )
    settings = kl | ({"overrides": {k: yaml.safe_load(v) for k, v in args.set}} if args.set else {})
    judge(out, out / "run", reference=None, train_seconds=time.time() - t0, side="lmppo", settings=settings)
    return out


# ----------------------------------------------------------------------------- TRL (TRL venv)
def train_trl(args) -> Path:
    import compare_trl  # the TRL worker of the speed benchmark, reused (benchmarks/speed)
    from transformers import AutoTokenizer

    name = args.name or f"trl-c{args.kl_coef:g}-s{args.seed}"
    out = RUNS / name
    out.mkdir(parents=True, exist_ok=True)
    prompts = trl_prompts(args.seed)
    (out / "prompts.json").write_text(json.dumps(prompts))
    cache = out / "cache"  # the shared cache's models, with this seed's prompt split
    cache.mkdir(exist_ok=True)
    for sub in ("tokenizer", "policy", "critic", "reward"):
        link = cache / sub
        if not link.exists():
            link.symlink_to(CACHE / sub)
    (cache / "prompts.json").write_text(json.dumps(prompts))
    AutoTokenizer.from_pretrained(CACHE / "tokenizer")
    cfg = dict(
        batch_size=32,
        num_mini_batches=2,
        ppo_epochs=2,
        response_length=24,
        learning_rate=args.lr,
        kl_coef=args.kl_coef,
        cliprange=0.2,
        cliprange_value=0.2,
        vf_coef=0.1,
        gamma=1.0,
        lam=0.95,
        temperature=0.7,
        stop_token="eos",
        missing_eos_penalty=None,
        threads=int(args.threads),
        dtype="float32",
        seed=args.seed,
        episodes=EPISODES,
        cache=str(cache),
        out_dir=str(out),
        lr_schedule="linear",
        save_policy_every=args.save_every,
        stop_after=args.stop_after,
    )
    t0 = time.time()
    res = compare_trl.run_trl(cfg)
    res["wall_seconds"] = time.time() - t0
    (out / "trl_result.json").write_text(json.dumps(res, indent=1, default=str))
    print(f"TRL done in {res['wall_seconds']:.0f} s; now run: python benchmarks/learning/learned_reward.py judge {out}")
    return out


def trl_prompts(seed: int) -> dict:
    """The training and held-out prompt ids of an lmppo run with this seed (written by `prompt-split`)."""
    path = CACHE / f"prompts-seed{seed}.json"
    if not path.exists():
        raise SystemExit(
            f"error: {path} is missing: run `python benchmarks/learning/learned_reward.py prompt-split "
            f"--seed {seed}` in lmppo's venv first"
        )
    return json.loads(path.read_text())


def prompt_split(seed: int) -> None:
    """lmppo's own tokenisation and held-out split for `seed`, saved for the TRL side."""
    from transformers import AutoTokenizer

    from lmppo.data.prompts import load_prompt_records, split_holdout, tokenize_prompts

    data_cfg = _data_config()
    tokenizer = AutoTokenizer.from_pretrained(CACHE / "tokenizer")
    prompts = tokenize_prompts(load_prompt_records(data_cfg), tokenizer, data_cfg)
    train, held = split_holdout(prompts, HOLDOUT, seed)
    (CACHE / f"prompts-seed{seed}.json").write_text(
        json.dumps({"train": [list(x) for x in train.ids], "eval": [list(x) for x in held.ids]})
    )


def _data_config():
    import yaml

    from lmppo.config import DataConfig

    d = DataConfig()
    for k, v in yaml.safe_load((ROOT / "src/lmppo/recipes/sentiment.yaml").read_text())["data"].items():
        setattr(d, k, v)
    d.holdout = HOLDOUT
    return d


# ----------------------------------------------------------------------------- eval + judges (lmppo venv)
def judge(
    out: Path,
    model: Path,
    reference: Path | None,
    train_seconds: float | None,
    side: str,
    settings: dict,
    config: Path | None = None,
) -> dict:
    """`lmppo eval` on the held-out prompts (4 samples each), then the MiniLM hacking checks on its samples."""
    cmd = [
        sys.executable,
        "-m",
        "lmppo.apps.cli",
        "eval",
        str(model),
        "--samples-per-prompt",
        "4",
        "--output",
        str(out / "eval.json"),
        "--show",
        "0",
    ]
    if reference is not None:
        cmd += ["--reference", str(reference)]
    if config is not None:
        cmd += ["--config", str(config)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=open(out / "eval.log", "w"), stderr=subprocess.STDOUT)
    ev = json.loads((out / "eval.json").read_text())
    samples = ev["samples"]
    prompts = [s["prompt"] for s in samples]
    result = {
        "side": side,
        "settings": settings,
        "train_seconds": train_seconds,
        "heldout": {"start": ev["start_point"], "trained": ev["trained"]},
        "judge": {
            "start": hacking_checks(prompts, [s["start"] for s in samples]),
            "trained": hacking_checks(prompts, [s["trained"] for s in samples]),
        },
    }
    metrics = out / "run" / "metrics.jsonl"
    if metrics.exists():
        rows = [json.loads(x) for x in metrics.read_text().splitlines()]
        kls = [r["objective/kl"] for r in rows]
        late = kls[len(kls) // 2 :]
        result["train"] = {
            "kl": kls,
            "kl_coef": [r["objective/kl_coef"] for r in rows],
            "scores": [r["objective/scores"] for r in rows],
            "kl_late_min": min(late),
            "kl_late_max": max(late),
            "kl_late_mean": sum(late) / len(late),
        }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    record(out)
    print(summary_line(out.name, result))
    return result


def compact(name: str, run: Path) -> dict:
    """A judged run's record: its result.json, its eval.json without the samples, and the per-prompt mean scores."""
    ev = json.loads((run / "eval.json").read_text())
    by_prompt, start_by_prompt = _by_prompt(run)
    return {
        "name": name,
        "result": json.loads((run / "result.json").read_text()),
        "eval": {k: v for k, v in ev.items() if k != "samples"},
        "by_prompt": by_prompt,
        "start_by_prompt": start_by_prompt,
    }


def read_records() -> dict[str, dict]:
    """The committed records by run name (NAME as in `collect`)."""
    if not RECORDS.exists():
        return {}
    return {r["name"]: r for r in map(json.loads, RECORDS.read_text().splitlines()) if r}


def record(out: Path) -> None:
    """Write a judged run's compact record into RECORDS (replacing an older one of the same name)."""
    name = str(out.relative_to(RUNS))
    records = read_records() | {name: compact(name, out)}
    RECORDS.parent.mkdir(parents=True, exist_ok=True)
    RECORDS.write_text("".join(json.dumps(records[n]) + "\n" for n in sorted(records, key=_record_order)))


def hacking_checks(prompts: list[str], completions: list[str]) -> dict:
    """MiniLM: prompt-relevance gap and mean pairwise self-similarity of the completions."""
    import torch

    from lmppo.rewards.builtin import embed

    unique = sorted(set(prompts))
    p = torch.as_tensor(embed(unique))
    c = torch.as_tensor(embed(completions))
    p = torch.nn.functional.normalize(p.float(), dim=-1)
    c = torch.nn.functional.normalize(c.float(), dim=-1)
    own = torch.tensor([unique.index(x) for x in prompts])
    sim = c @ p.T  # (N completions, P prompts)
    mine = sim[torch.arange(len(completions)), own]
    others = (sim.sum(1) - mine) / max(len(unique) - 1, 1)
    pair = c @ c.T
    n = len(completions)
    self_sim = (pair.sum() - pair.diagonal().sum()) / (n * (n - 1))
    return {"relevance_gap": float((mine - others).mean()), "self_similarity": float(self_sim)}


def judge_trl(args) -> None:
    """Every saved TRL policy of a run (`policy-iter-NNN`: the trajectory), evaluated as lmppo's runs are."""
    import yaml

    out = Path(args.run).resolve()
    res = json.loads((out / "trl_result.json").read_text()) if (out / "trl_result.json").exists() else {}
    saved = {int(p.name.split("-")[-1]): p for p in out.glob("policy-iter-*")}
    missing = sorted(set(args.iterations or ()) - set(saved))
    if missing:
        raise SystemExit(
            f"error: judge --iterations {' '.join(map(str, missing))}: no policy saved after that update "
            f"in {out} (saved: {' '.join(map(str, sorted(saved))) or 'none'})"
        )
    lm_cfg = out / "lmppo_view.yaml"
    lm_cfg.write_text(yaml.safe_dump(recipe(out / "unused", args.seed), sort_keys=False))
    for iteration, policy in sorted(saved.items()):
        if args.iterations is not None and iteration not in args.iterations:
            continue
        sub = out / f"eval-{policy.name[len('policy-') :]}"
        if (sub / "result.json").exists():
            record(sub)
            continue
        sub.mkdir(exist_ok=True)
        judge(
            sub,
            policy,
            reference=CACHE / "policy",
            train_seconds=res.get("train_seconds"),
            side="trl",
            settings={"kl_coef": args.kl_coef, "iteration": iteration},
            config=lm_cfg,
        )


# ----------------------------------------------------------------------------- interpolation toward the start
def interpolate(args) -> None:
    """WARP's interpolation step on a run: W0 + lam * (W - W0) for each `lam` (`lmppo merge --toward-start` on the
    one run), evaluated like any run."""
    out = Path(args.run).resolve()
    for lam in args.lambdas:
        sub = out / f"interp-{lam:g}"
        if (sub / "result.json").exists():
            continue
        shutil.rmtree(sub / "policy", ignore_errors=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "lmppo.apps.cli",
                "merge",
                str(out / "run"),
                "--toward-start",
                str(lam),
                "--output",
                str(sub / "policy"),
            ],
            check=True,
            cwd=ROOT,
        )
        settings = json.loads((out / "result.json").read_text())["settings"] | {"interpolation": lam}
        judge(
            sub,
            sub / "policy",
            reference=None,
            train_seconds=None,
            side="lmppo-interp",
            settings=settings,
            config=out / "run" / "config.yaml",
        )


def merge_runs(args) -> None:
    """WARP's merging step: `lmppo merge` of runs of one recipe, seeds apart, one held-out split (`data.holdout_seed`),
    evaluated like any run on that split; its cost is the runs' episodes and training time together."""
    out = RUNS / args.name
    runs = [RUNS / r for r in args.runs]
    if (out / "result.json").exists():
        return
    shutil.rmtree(out / "policy", ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "lmppo.apps.cli",
        "merge",
        *[str(r / "run") for r in runs],
        "--output",
        str(out / "policy"),
    ]
    if args.kl_budget is not None:  # lambda chosen by lmppo merge on the held-out KL
        cmd += ["--kl-budget", str(args.kl_budget)]
    elif args.toward_start != 1.0:
        cmd += ["--toward-start", str(args.toward_start)]
    t0 = time.time()
    subprocess.run(cmd, check=True, cwd=ROOT)
    record = json.loads((out / "policy" / "merge.json").read_text())
    settings = {"merge": args.runs, "toward_start": record["toward_start"]}
    if args.kl_budget is not None:
        settings |= {
            "kl_budget": args.kl_budget,
            "search": record["kl_budget"]["steps"],
            "search_seconds": round(time.time() - t0, 1),
        }
    results = [json.loads((r / "result.json").read_text()) for r in runs]
    seconds = sum(r.get("train_seconds") or 0.0 for r in results)
    judge(
        out,
        out / "policy",
        reference=None,
        train_seconds=seconds,
        side="lmppo-merge",
        settings=settings,
        config=runs[0] / "run" / "config.yaml",
    )


def warp_runs(args) -> None:
    """`lmppo warp` on the task, as a user runs it: two members of the recipe at `--target` (seeds S and S+1, the
    held-out split of S), trained once, merged at each of `--budgets` (NAME-bB-sS, judged like a run)."""
    import yaml

    base = RUNS / f"{args.name}-s{args.seed}"
    base.mkdir(parents=True, exist_ok=True)
    cfg = recipe(base / "warp", args.seed, controller="pi", target=args.target)
    (base / "recipe.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    for budget in args.budgets:
        out = RUNS / f"{args.name}-b{budget:g}-s{args.seed}"
        if (out / "result.json").exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        t0 = time.time()
        subprocess.run(
            [sys.executable, "-m", "lmppo.apps.cli", "warp", str(base / "recipe.yaml"), "--kl-budget", str(budget)],
            check=True,
            cwd=ROOT,
            stdout=open(out / "warp.log", "w"),
            stderr=subprocess.STDOUT,
        )
        merged = base / "warp" / f"merged-kl{budget:g}"
        record = json.loads((merged / "merge.json").read_text())
        settings = {
            "warp": {"members": 2, "target": args.target},
            "toward_start": record["toward_start"],
            "kl_budget": budget,
            "search": record["kl_budget"]["steps"],
            "warp_seconds": round(time.time() - t0, 1),
        }  # the first budget's includes training the members
        judge(
            out,
            merged,
            reference=None,
            train_seconds=None,
            side="lmppo-merge",
            settings=settings,
            config=base / "warp" / "member-0" / "config.yaml",
        )


# ----------------------------------------------------------------------------- report
def summary_line(name: str, r: dict) -> str:
    t, s = r["heldout"]["trained"], r["heldout"]["start"]
    jt, js = r["judge"]["trained"], r["judge"]["start"]
    late = (
        (
            f" train KL last half {r['train']['kl_late_min']:.1f}-{r['train']['kl_late_max']:.1f}"
            f" (mean {r['train']['kl_late_mean']:.1f})"
        )
        if "train" in r
        else ""
    )
    return (
        f"{name:32s} held-out rm {s['reward/rm']:.2f}->{t['reward/rm']:.2f} at KL {t['kl']:.2f}"
        f" | vader {s['reward/vader']:.2f}->{t['reward/vader']:.2f}"
        f" | relevance gap {js['relevance_gap']:.3f}->{jt['relevance_gap']:.3f}"
        f" | self-sim {js['self_similarity']:.2f}->{jt['self_similarity']:.2f}{late}"
    )


def _bootstrap_se(values: list[float], rounds: int = 2000, seed: int = 0) -> float:
    import random

    rng = random.Random(seed)
    n = len(values)
    means = [sum(values[rng.randrange(n)] for _ in range(n)) / n for _ in range(rounds)]
    mu = sum(means) / rounds
    return (sum((m - mu) ** 2 for m in means) / (rounds - 1)) ** 0.5


def collect() -> list[dict]:
    """Every judged run: those in the cache, then the committed records of runs the cache no longer holds."""
    points, seen = [], set()
    for path in (
        sorted(RUNS.glob("*/result.json"))
        + sorted(RUNS.glob("*/eval-iter-*/result.json"))
        + sorted(RUNS.glob("*/interp-*/result.json"))
    ):
        name = str(path.parent.relative_to(RUNS))
        seen.add(name)
        points.append(_point(name, json.loads(path.read_text()), *_by_prompt(path.parent)))
    records = read_records()
    for name in sorted(records, key=_record_order):
        if name not in seen:
            r = records[name]
            points.append(_point(name, r["result"], r["by_prompt"], r["start_by_prompt"]))
    return points


def _record_order(name: str) -> tuple:
    """`collect`'s order: whole runs, then TRL's checkpoints (eval-iter-*), then interpolations, each by path."""
    parts = name.split("/")
    kind = 0 if len(parts) == 1 else 1 if parts[1].startswith("eval-iter-") else 2
    return (kind, parts)


def _point(name: str, r: dict, by_prompt: dict[str, float], start_by_prompt: dict[str, float]) -> dict:
    return {
        "name": name,
        "side": r["side"],
        "settings": r["settings"],
        "result": r,
        "by_prompt": by_prompt,
        "start_by_prompt": start_by_prompt,
        "kl": r["heldout"]["trained"]["kl"],
        "rm": r["heldout"]["trained"]["reward/rm"],
        "rm_se": _bootstrap_se(list(by_prompt.values())),
    }


def _interpolate(points: list[dict], kl: float) -> tuple[float, float] | None:
    """TRL's held-out score at `kl`, linear between the two trajectory points around it (with its SE)."""
    pts = sorted(points, key=lambda p: p["kl"])
    for a, b in zip(pts, pts[1:]):
        if a["kl"] <= kl <= b["kl"]:
            w = (kl - a["kl"]) / max(b["kl"] - a["kl"], 1e-9)
            return (1 - w) * a["rm"] + w * b["rm"], ((1 - w) * a["rm_se"] ** 2 + w * b["rm_se"] ** 2) ** 0.5
    return None


def _seed(name: str) -> int | None:
    match = re.search(r"-s(\d+)(/|$)", name)
    return int(match.group(1)) if match else None


def _by_prompt(result_dir: Path) -> tuple[dict[str, float], dict[str, float]]:
    """Per held-out prompt: the mean reward-model score of the trained policy's samples, and of the start policy's."""
    ev = json.loads((result_dir / "eval.json").read_text())
    by: dict[str, list] = {}
    for s in ev["samples"]:
        by.setdefault(s["prompt"], []).append((s["trained_scores"]["rm"], s["start_scores"]["rm"]))
    return (
        {k: sum(t for t, _ in g) / len(g) for k, g in by.items()},
        {k: sum(b for _, b in g) / len(g) for k, g in by.items()},
    )


def _curve_at(points: list[tuple[float, dict[str, float]]], kl: float) -> dict[str, float] | None:
    """A policy family's per-prompt scores at held-out KL `kl`, linear in sqrt(KL) between the two points around
    it (Gao et al.'s d = sqrt(KL) is the natural axis of reward against KL); None outside the points' range."""
    pts = sorted(points, key=lambda x: x[0])
    for (ka, ra), (kb, rb) in zip(pts, pts[1:]):
        if ka <= kl <= kb:
            w = (kl**0.5 - ka**0.5) / max(kb**0.5 - ka**0.5, 1e-9)
            return {k: (1 - w) * ra[k] + w * rb[k] for k in ra}
    return None


def _trajectory(name: str) -> str:
    """The TRL run a checkpoint belongs to: a `-early` run (`trl --stop-after`, the same seed and schedule) joins
    the curve of its whole run."""
    return re.sub(r"-early(?=-s\d+$)", "", name.split("/")[0])


def _both_at(
    points: list[dict], start: tuple[float, dict], seed: int, kl: float, families: tuple[str, ...] = ("lmppo-",)
) -> tuple[dict | None, dict | None]:
    """(lmppo's, TRL's) per-prompt scores of `seed` at held-out KL `kl`. lmppo: one curve per family (the runs whose
    name starts with one of `families`: replicates of a recipe, trained apart), their per-prompt mean over the
    families that reach `kl`. TRL: its best trajectory there. None where no curve reaches `kl`."""
    curves = []
    for family in families:
        mine = [
            (p["kl"], p["by_prompt"])
            for p in points
            if p["side"].startswith("lmppo") and _seed(p["name"]) == seed and _family(p["name"], families) == family
        ]
        curve = _curve_at(mine + [start], kl) if mine else None
        if curve is not None:
            curves.append(curve)
    lm = {k: sum(c[k] for c in curves) / len(curves) for k in curves[0]} if curves else None
    runs: dict[str, list] = {}
    for p in points:
        if p["side"] == "trl" and _seed(p["name"]) == seed:
            runs.setdefault(_trajectory(p["name"]), []).append((p["kl"], p["by_prompt"]))
    trl = [c for c in (_curve_at(r + [start], kl) for r in runs.values()) if c is not None]
    return lm, max(trl, key=lambda c: sum(c.values()), default=None)


def _family(name: str, families: tuple[str, ...]) -> str | None:
    """The longest of `families` that `name` starts with (lmppo-kb- before lmppo-)."""
    return max((f for f in families if name.startswith(f)), key=len, default=None)


def frontier_table(
    points: list[dict], kls: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0), families: tuple[str, ...] = ("lmppo-",)
) -> list[str]:
    """lmppo against TRL at the same held-out KL, paired by seed and by held-out prompt.

    Each side's curve for a seed: the start policy (KL 0), then its points (lmppo: the runs of every KL target and
    their interpolations toward the start; TRL: the saved trajectory of each TRL run, one curve per run, the best
    TRL run at each KL kept). Both sides are read on the same held-out prompts (the seed fixes the split), so the
    difference is taken per prompt; its noise is the larger of the bootstrap SE over all prompts of all seeds and
    (with two or more seeds) the standard error of the per-seed mean differences."""
    seeds = sorted({s for s in (_seed(p["name"]) for p in points) if s is not None})
    start = {}
    for p in points:
        start.setdefault(_seed(p["name"]), (0.0, p["start_by_prompt"]))
    lines = [
        "",
        "frontier at fixed held-out KL: held-out reward-model score, lmppo minus TRL (paired by seed and prompt)",
        "| KL | " + " | ".join(f"seed {s}: lmppo / TRL" for s in seeds) + " | mean difference | noise (SE) |"
        " beyond 2 SE | seeds ahead | t over seeds (5% two-sided critical) |",
        "|---|" + "---|" * (len(seeds) + 5),
    ]
    for kl in kls:
        cells, per_seed, per_prompt = [], [], []
        for seed in seeds:
            lm, trl = _both_at(points, start[seed], seed, kl, families)
            mean = lambda c: sum(c.values()) / len(c)
            cells.append(
                ("-" if lm is None else f"{mean(lm):.2f}") + " / " + ("-" if trl is None else f"{mean(trl):.2f}")
            )
            if lm is not None and trl is not None:
                diff = [lm[k] - trl[k] for k in lm]
                per_prompt += diff
                per_seed.append(sum(diff) / len(diff))
        if not per_seed:
            lines.append(f"| {kl:g} | " + " | ".join(cells) + " | - | - | - | - | - |")
            continue
        mean_diff = sum(per_prompt) / len(per_prompt)
        within = _bootstrap_se(per_prompt)
        between = _se_of_mean(per_seed)
        noise = max(within, between)
        verdict = ("yes" if abs(mean_diff) > 2 * noise else "no") + ("" if len(per_seed) > 1 else " (one seed)")
        ahead = f"{sum(d > 0 for d in per_seed)} of {len(per_seed)}"
        lines.append(
            f"| {kl:g} | " + " | ".join(cells) + f" | {mean_diff:+.3f} ({len(per_seed)} seeds) | {noise:.3f} "
            f"| {verdict} | {ahead} | {_t_test(per_seed)} |"
        )
    return lines


# Student's t, two-sided 5%: the critical |t| for 1 to 30 degrees of freedom (above 30, 30's value: conservative).
T_CRITICAL_5 = {
    1: 12.71,
    2: 4.30,
    3: 3.18,
    4: 2.78,
    5: 2.57,
    6: 2.45,
    7: 2.36,
    8: 2.31,
    9: 2.26,
    10: 2.23,
    11: 2.20,
    12: 2.18,
    13: 2.16,
    14: 2.14,
    15: 2.13,
    16: 2.12,
    17: 2.11,
    18: 2.10,
    19: 2.09,
    20: 2.09,
    21: 2.08,
    22: 2.07,
    23: 2.07,
    24: 2.06,
    25: 2.06,
    26: 2.06,
    27: 2.05,
    28: 2.05,
    29: 2.05,
    30: 2.04,
}


def _se_of_mean(values: list[float]) -> float:
    """The standard error of the mean of `values` (sample sd / sqrt n); 0 for fewer than two."""
    n = len(values)
    if n < 2:
        return 0.0
    mean = sum(values) / n
    return (sum((v - mean) ** 2 for v in values) / (n - 1)) ** 0.5 / n**0.5


def _t_test(per_seed: list[float]) -> str:
    """The one-sample t-test of the per-seed mean differences against 0: each seed (its own prompt split, runs and
    TRL runs) is one independent replicate, so this is the test that does not lean on the prompts being independent."""
    df = len(per_seed) - 1
    if df < 1:
        return "-"
    critical = T_CRITICAL_5[min(df, 30)]
    t = (sum(per_seed) / len(per_seed)) / max(_se_of_mean(per_seed), 1e-12)
    return f"{t:.2f} ({critical:.2f}, {df} df): " + ("yes" if abs(t) > critical else "no")


# TRL's held-out score at each KL and seed (0, 1, 2) as recorded in docs/choosing.md before its per-prompt files
# were lost: the best of its runs at lr 1e-5, 5e-5 and 1e-4 at each KL.
TRL_RECORDED_BEST = {
    0.5: (0.50, 0.28, 0.27),
    1.0: (0.37, 0.32, 0.32),
    2.0: (0.39, 0.44, 0.37),
    5.0: (0.65, 0.68, 0.37),
    10.0: (0.76, 0.79, 0.68),
}


def recorded_floor_table(points: list[dict], families: tuple[str, ...] = ("lmppo-",)) -> list[str]:
    """lmppo against the larger of TRL's paired curve and TRL_RECORDED_BEST, per seed; the noise is the paired table's
    (bootstrap of the per-prompt differences to the fresh curve, or the SE over seeds), since the recorded part has
    no per-prompt scores."""
    seeds = sorted({s for s in (_seed(p["name"]) for p in points) if s is not None and s < 3})
    start = {}
    for p in points:
        start.setdefault(_seed(p["name"]), (0.0, p["start_by_prompt"]))
    lines = [
        "",
        "against the larger of TRL's paired curve and its recorded best learning rate (lmppo / TRL paired / "
        "TRL recorded)",
        "| KL | " + " | ".join(f"seed {s}" for s in seeds) + " | mean difference | noise (SE) | differences / noise |",
        "|---|" + "---|" * (len(seeds) + 3),
    ]
    for kl, recorded in TRL_RECORDED_BEST.items():
        cells, diffs, paired = [], [], []
        for seed in seeds:
            lm, trl = _both_at(points, start[seed], seed, kl, families)
            if lm is None or trl is None:
                cells.append("-")
                continue
            mean_lm, mean_trl = sum(lm.values()) / len(lm), sum(trl.values()) / len(trl)
            diffs.append(mean_lm - max(mean_trl, recorded[seed]))
            paired += [lm[k] - trl[k] for k in lm]
            cells.append(f"{mean_lm:.2f} / {mean_trl:.2f} / {recorded[seed]:.2f}")
        if not diffs:
            continue
        mean = sum(diffs) / len(diffs)
        noise = max(_se_of_mean(diffs), _bootstrap_se(paired))
        lines.append(
            f"| {kl:g} | " + " | ".join(cells) + f" | {mean:+.3f} ({len(diffs)} seeds) | {noise:.3f} | "
            f"{mean / noise:.1f} |"
        )
    return lines


def report(args) -> None:
    """Every run's line, then lmppo against TRL. `--lmppo PREFIX [PREFIX ...]` keeps only the lmppo runs (and their
    interpolations) whose folder name starts with PREFIX: one recipe's family, so runs of other settings kept in
    the cache do not enter its curve. TRL's runs all count (the best at each KL is kept)."""
    points = [p for p in collect() if p["side"] == "trl" or p["name"].startswith(tuple(args.lmppo))]
    for p in points:
        print(summary_line(p["name"], p["result"]) + f" | rm SE {p['rm_se']:.2f}")
    trl = [p for p in points if p["side"] == "trl"]
    lines = [
        "",
        "frontier: lmppo's held-out reward-model score against TRL's at the same held-out KL",
        "| lmppo run | KL | lmppo score (SE) | TRL at that KL (SE) | difference (SE) |",
        "|---|---|---|---|---|",
    ]
    for p in (p for p in points if p["side"].startswith("lmppo")):
        at = _interpolate(trl, p["kl"]) if trl else None
        if at is None:
            lines.append(
                f"| {p['name']} | {p['kl']:.2f} | {p['rm']:.2f} ({p['rm_se']:.2f}) | outside TRL's range | - |"
            )
            continue
        diff, se = p["rm"] - at[0], (p["rm_se"] ** 2 + at[1] ** 2) ** 0.5
        lines.append(
            f"| {p['name']} | {p['kl']:.2f} | {p['rm']:.2f} ({p['rm_se']:.2f}) | {at[0]:.2f} ({at[1]:.2f}) "
            f"| {diff:+.2f} ({se:.2f}) |"
        )
    print("\n".join(lines))
    families = tuple(args.lmppo)
    print("\n".join(frontier_table(points, families=families)))
    print("\n".join(recorded_floor_table(points, families)))
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "report.json").write_text(
        json.dumps(
            [
                {k: v for k, v in p.items() if k not in ("result", "by_prompt", "start_by_prompt")}
                | {"judge": p["result"]["judge"]}
                for p in points
            ],
            indent=1,
        )
    )
    _plot(points, CACHE / "frontier.png")
    print(f"wrote {CACHE / 'report.json'} and {CACHE / 'frontier.png'}")


def _plot(points: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for side, marker in (("lmppo", "o"), ("lmppo-interp", "^"), ("lmppo-merge", "D"), ("trl", "s")):
        pts = sorted((p for p in points if p["side"] == side), key=lambda p: p["kl"])
        if pts:
            ax.errorbar(
                [p["kl"] for p in pts],
                [p["rm"] for p in pts],
                yerr=[p["rm_se"] for p in pts],
                marker=marker,
                linestyle="none",
                label=side,
                capsize=3,
            )  # seeds mixed: no line
    ax.set_xlabel("held-out KL to the start policy (nats per response)")
    ax.set_ylabel("held-out reward-model score")
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--force", action="store_true")
    ps = sub.add_parser("prompt-split")
    ps.add_argument("--seed", type=int, default=0)
    lm = sub.add_parser("lmppo")
    lm.add_argument("--controller", default="pi", choices=["pi", "adaptive", "fixed"])
    lm.add_argument("--target", type=float, default=5.0)
    lm.add_argument("--kl-coef", type=float, default=None)
    lm.add_argument("--seed", type=int, default=0)
    lm.add_argument("--name", default=None)
    lm.add_argument("--set", nargs=2, action="append", metavar=("SECTION.FIELD", "VALUE"))
    tr = sub.add_parser("trl")
    tr.add_argument("--kl-coef", type=float, default=0.05)
    tr.add_argument("--lr", type=float, default=1e-5)
    tr.add_argument("--seed", type=int, default=0)
    tr.add_argument("--threads", type=int, default=2)
    tr.add_argument("--save-every", type=int, default=4, help="save the policy every N updates (the trajectory)")
    tr.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="end after N updates (the schedule stays that of the whole run): the start of a trajectory, saved finer",
    )
    tr.add_argument("--name", default=None)
    j = sub.add_parser("judge")
    j.add_argument("run")
    j.add_argument("--seed", type=int, default=0)
    j.add_argument("--kl-coef", type=float, default=0.05)
    j.add_argument(
        "--iterations",
        type=int,
        nargs="+",
        default=None,
        help="judge only the policies saved after these updates (default: every saved policy)",
    )
    ip = sub.add_parser("interpolate")
    ip.add_argument("run")
    ip.add_argument("--lambdas", type=float, nargs="+", default=[0.25, 0.5, 0.75])
    mg = sub.add_parser("merge")
    mg.add_argument("name", help="the merged policy's folder under the runs cache (its name's -sS: the split)")
    mg.add_argument("runs", nargs="+", help="runs of the cache to merge")
    mg.add_argument("--toward-start", type=float, default=1.0)
    mg.add_argument("--kl-budget", type=float, default=None, help="let lmppo merge choose lambda for this held-out KL")
    wp = sub.add_parser("warp", help="lmppo warp: two members trained once, merged at each budget")
    wp.add_argument("--target", type=float, default=20.0, help="the members' kl.target")
    wp.add_argument("--seed", type=int, default=0)
    wp.add_argument("--budgets", type=float, nargs="+", default=[2.0, 5.0, 10.0])
    wp.add_argument("--name", default="lmppo-w")
    rp = sub.add_parser("report")
    rp.add_argument(
        "--lmppo",
        default=["lmppo-"],
        nargs="+",
        metavar="PREFIX",
        help="only lmppo runs whose folder name starts with a PREFIX (default: every lmppo run)",
    )
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cmd == "build":
        build(args.force)
    elif args.cmd == "prompt-split":
        build()
        prompt_split(args.seed)
    elif args.cmd == "lmppo":
        build()
        train_lmppo(args)
    elif args.cmd == "trl":
        train_trl(args)
    elif args.cmd == "judge":
        judge_trl(args)
    elif args.cmd == "interpolate":
        interpolate(args)
    elif args.cmd == "merge":
        merge_runs(args)
    elif args.cmd == "warp":
        build()
        warp_runs(args)
    else:
        report(args)


if __name__ == "__main__":
    main()
