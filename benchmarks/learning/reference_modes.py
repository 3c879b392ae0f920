"""One run per reference policy on the same small task, final score and KL side by side.

Task: a tiny random Llama (2 layers, hidden 64, the test suite's ~400-token BPE vocabulary, built in-process) learns
to emit tokens from the first quarter of the vocabulary (reward = fraction of such tokens in the completion). Same
seed, prompts, budget and hyperparameters for every run; only the reference policy differs:

    frozen      a full copy of the initial policy
    sync        the copy is overwritten with the policy every `--every` iterations
    ema         ref <- (1 - alpha) ref + alpha policy every `--every` iterations
    lora        LoRA adapters trained, reference = the base model with the adapters off (no copy)
    lora-sync   LoRA, reference adapter synced every `--every` iterations
    lora-ema    LoRA, reference adapter EMA

Reported per run: the mean score and the mean KL to the run's *own* reference over the last `--tail` iterations, and
the KL to the *initial* policy at the end (exact per-token KL, averaged over fresh samples), which is what the
reference is meant to bound. Usage::

    PYTHONPATH=src python benchmarks/learning/reference_modes.py [--iterations 30] [--modes frozen,sync,ema,lora]
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

bench_path.put_first(bench_path.TESTS)

MODES = {
    "frozen": dict(mode="frozen", lora=False),
    "sync": dict(mode="sync", lora=False),
    "ema": dict(mode="ema", lora=False),
    "lora": dict(mode="frozen", lora=True),
    "lora-sync": dict(mode="sync", lora=True),
    "lora-ema": dict(mode="ema", lora=True),
}


def build_policy(tokenizer, seed: int):
    from conftest import tiny_llama

    return tiny_llama(tokenizer, seed=seed, hidden=64, layers=2)


@torch.no_grad()
def kl_to(policy, reference, tokenizer, prompts, temperature: float, max_new_tokens: int, n: int = 256) -> float:
    """Mean per-response KL(policy || reference): exact per-token KL summed along responses sampled from policy."""
    from lmppo.models.loading import policy_forward
    from lmppo.sampling.hf import left_pad
    from lmppo.sampling.native import sample_native

    ids, mask = left_pad([tokenizer.encode(p) for p in (prompts * n)[:n]], tokenizer.pad_token_id)
    no_stop = torch.tensor([], dtype=torch.long)
    resp, rmask, _, _ = sample_native(
        policy, ids, mask, temperature, max_new_tokens, no_stop, tokenizer.pad_token_id, range(10_000, 10_000 + n)
    )
    full, att = torch.cat([ids, resp], 1), torch.cat([mask, rmask], 1)
    lp = torch.log_softmax(policy_forward(policy, full, att, ids.shape[1], temperature).logits, -1)
    lr = torch.log_softmax(policy_forward(reference, full, att, ids.shape[1], temperature).logits, -1)
    per_token = (lp.exp() * (lp - lr)).sum(-1)
    return (per_token * rmask).sum(1).mean().item()


def run(name: str, args) -> dict:
    from conftest import PROMPTS
    from helpers_tokenizers import make_bpe_tokenizer
    from lmppo.config import Config
    from lmppo.training.trainer import PPOTrainer

    torch.set_num_threads(args.threads)
    tok = make_bpe_tokenizer()
    target = set(range(len(tok) // 4))

    def frac_target(prompts, completions):
        ids = [tok.encode(c, add_special_tokens=False) for c in completions]
        return [sum(i in target for i in x) / max(len(x), 1) for x in ids]

    spec = MODES[name]
    cfg = Config()
    cfg.seed, cfg.output_dir, cfg.overwrite = args.seed, tempfile.mkdtemp(prefix=f"refmode-{name}-"), True
    cfg.log.trackers, cfg.log.sample_every = [], 0
    cfg.total_episodes, cfg.rollout.batch_size = args.iterations * args.batch, args.batch
    cfg.rollout.max_new_tokens, cfg.rollout.temperature, cfg.rollout.stop_token = args.max_new_tokens, 1.0, "none"
    cfg.ppo.learning_rate = args.lora_lr if spec["lora"] else args.lr
    cfg.ppo.micro_batch_size, cfg.ppo.num_minibatches = args.batch // 2, 2
    cfg.kl.controller, cfg.kl.coef = "fixed", args.kl_coef
    cfg.reference.mode, cfg.reference.every, cfg.reference.ema_alpha = spec["mode"], args.every, args.alpha
    cfg.model.lora.enabled = spec["lora"]
    cfg.model.lora.target_modules = args.lora_targets.split(",")
    policy = build_policy(tok, args.seed)
    initial = copy.deepcopy(policy)
    start = time.perf_counter()
    trainer = PPOTrainer(cfg, policy=policy, tokenizer=tok, prompts=list(PROMPTS), reward_functions=[frac_target])
    history = trainer.train()
    seconds = time.perf_counter() - start
    tail = history[-args.tail :]
    return {
        "name": name,
        "score_first": history[0]["objective/scores"],
        "score": sum(m["objective/scores"] for m in tail) / len(tail),
        "kl_ref": sum(m["objective/kl"] for m in tail) / len(tail),
        "kl_initial": kl_to(trainer.policy, initial, tok, list(PROMPTS), 1.0, args.max_new_tokens),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="frozen,sync,ema,lora")
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--lora-lr", type=float, default=1e-2)
    parser.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj,lm_head",
        help="LoRA target modules; the LM head is included because this tiny random model's logits "
        "can hardly move through its trunk alone (RMSNorm bounds the final hidden state)",
    )
    parser.add_argument("--kl-coef", type=float, default=0.05)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--alpha", type=float, default=0.2)
    parser.add_argument("--tail", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    rows = [run(name, args) for name in args.modes.split(",")]
    print(
        f"\n{args.iterations} iterations x {args.batch} episodes, kl.coef {args.kl_coef} (fixed), every "
        f"{args.every}, ema_alpha {args.alpha}, lr {args.lr} (LoRA {args.lora_lr}); score and KL-to-reference: "
        f"mean of the last {args.tail} iterations\n"
    )
    print("| reference | score (iter 1) | score (final) | KL to own reference | KL to initial policy | seconds |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['name']} | {r['score_first']:.3f} | {r['score']:.3f} | {r['kl_ref']:.3f} | {r['kl_initial']:.3f} "
            f"| {r['seconds']:.1f} |"
        )


if __name__ == "__main__":
    main()
