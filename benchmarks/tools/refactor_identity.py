"""Behaviour identity across a refactor: seeded tiny-model runs in-process, their metrics.jsonl and final weights.

    PYTHONPATH=src python benchmarks/tools/refactor_identity.py --out /tmp/before      # on the old code
    PYTHONPATH=src python benchmarks/tools/refactor_identity.py --out /tmp/after --compare /tmp/before

Each configuration trains a tiny Llama (built in-process, as in tests/conftest.py) for a few iterations: the shared
value head and a separate critic, with the native and the HF sampler, a KL term in the loss, a syncing reference,
checkpoints, the held-out evaluation during training, multi-turn episodes (the built-in `guess_number` game and the
built-in `tools` environment with a tool, each with a function reward on the last turn beside the environment's).
`--compare` prints, per configuration, whether every metric
except the wall-clock ones (`time/*`, and `eps` and `tokens_per_s`, which divide by seconds) and the final weights
are identical, and exits non-zero if not.

A baseline taken before commit c9e5e4d (the native sampler's noise moved to the device: the same seeds sample other
tokens, docs/performance.md "Native sampler noise") does not match runs after it: take the baseline again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

bench_path.put_first(bench_path.TESTS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

from conftest import PROMPTS, tiny_llama  # noqa: E402
from helpers_tokenizers import make_bpe_tokenizer  # noqa: E402
from lmppo import Config, PPOTrainer  # noqa: E402

TIME_KEYS = ("eps", "tokens_per_s")  # derived from wall-clock seconds


def length_reward(prompts, completions):
    return [min(len(c), 40) / 40.0 for c in completions]


CONFIGS = {
    "shared_native": {},
    "critic_native": {"value.mode": "critic"},
    "shared_hf_klloss": {
        "rollout.backend": "hf",
        "kl.placement": "both",
        "reference.mode": "sync",
        "reference.every": 1,
    },
    "critic_hf_bootstrap": {
        "value.mode": "critic",
        "rollout.backend": "hf",
        "reward.truncation": "bootstrap",
        "ppo.num_minibatches": 2,
        "reward.normalize": True,
    },
    "shared_reuse": {
        "ppo.num_minibatches": 1,
        "ppo.micro_batch_size": 8,
        "ppo.reuse_rollout_forward": True,
        "kl.controller": "adaptive",
    },
    "critic_resumed": {
        "value.mode": "critic",
        "reference.mode": "ema",
        "reference.ema_alpha": 0.5,
        "resume_after": 2,
    },  # 2 iterations, then `PPOTrainer.resume` for the other 2
    # the held-out evaluation during training (`eval/*`): under the run's bf16 autocast, and in fp32 on the HF engine
    "shared_native_eval": {"data.holdout": 4, "log.eval_every": 2},
    "shared_hf_eval_fp32": {"rollout.backend": "hf", "data.holdout": 4, "log.eval_every": 2, "precision": "fp32"},
    # a `full_logits` KL estimator: the rollout keeps the reference's logits and each state's KL (`Rollout`)
    "shared_full_logits_kl": {"kl.estimator": "exact", "kl.placement": "reward", "ppo.num_minibatches": 2},
    # multi-turn episodes (`environment.*`): the prompts are rows with the environment's columns (`ENV_ROWS`), the
    # held-out evaluation plays episodes too
    "env_guess_number": {
        "environment.path": "guess_number",
        "environment.max_turns": 3,
        "environment.max_episode_tokens": 160,
        "rollout.stop_token": "<|im_end|>",
        "data.holdout": 4,
        "log.eval_every": 2,
        "reward.normalize": True,
    },
    "env_tools_critic": {
        "environment.path": "tools",
        "environment.tools": [str(Path(__file__).with_name("identity_tools.py")) + ":multiply"],
        "environment.max_turns": 2,
        "environment.max_episode_tokens": 48,
        "rollout.stop_token": "<|im_end|>",
        "rollout.backend": "hf",
        "value.mode": "critic",
        "reward.truncation": "penalty",
    },
    # an environment that rewards every turn (tests/countdown_env.py: 0.25 a turn), the rollout's forward reused
    "env_countdown_reuse": {
        "environment.path": str(bench_path.TESTS / "countdown_env.py") + ":Countdown",
        "environment.max_turns": 3,
        "environment.max_episode_tokens": 80,
        "rollout.stop_token": "<|im_end|>",
        "ppo.num_minibatches": 1,
        "ppo.micro_batch_size": 8,
        "ppo.reuse_rollout_forward": True,
    },
}
ENV_ROWS = {
    "env_guess_number": [{"prompt": p, "secret": 1 + i % 8, "high": 8} for i, p in enumerate(PROMPTS * 2)],
    "env_countdown_reuse": [{"prompt": f"count down from {n}", "turns": n} for n in (1, 2, 3, 5) * 4],
    "env_tools_critic": [{"prompt": f"what is {i} * 3?", "answer": str(3 * i)} for i in range(16)],
}


def run(name: str, overrides: dict, out_root: str) -> None:
    from lmppo.config import apply_override

    tok = make_bpe_tokenizer()
    cfg = Config()
    cfg.output_dir = os.path.join(out_root, name)
    cfg.overwrite = True
    cfg.seed = 3
    cfg.total_episodes = 32
    cfg.rollout.batch_size = 8
    cfg.rollout.max_new_tokens = 8
    cfg.ppo.num_epochs = 2
    cfg.ppo.micro_batch_size = 2
    cfg.ppo.learning_rate = 1e-3
    cfg.log.trackers = []
    cfg.log.progress = False
    cfg.checkpoint.every = 2
    overrides = dict(overrides)
    resume_after = overrides.pop("resume_after", None)
    for dotted, value in overrides.items():
        apply_override(cfg, dotted, value)
    objects = dict(tokenizer=tok, prompts=ENV_ROWS.get(name, PROMPTS * 2), reward_functions=[length_reward])
    if resume_after:
        total = cfg.total_episodes
        cfg.total_episodes = resume_after * cfg.rollout.batch_size
        PPOTrainer(cfg, policy=tiny_llama(tok), **objects).train()
        trainer = PPOTrainer.resume(
            cfg.output_dir, overrides={"total_episodes": total}, policy=tiny_llama(tok), **objects
        )
    else:
        trainer = PPOTrainer(cfg, policy=tiny_llama(tok), **objects)
    trainer.train()
    h = hashlib.sha256()
    for key, value in sorted(trainer.policy.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().float().cpu().numpy().tobytes())
    with open(os.path.join(cfg.output_dir, "weights.sha256"), "w") as fh:
        fh.write(h.hexdigest() + "\n")


def comparable(path: str) -> list[dict]:
    with open(path) as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    return [{k: v for k, v in row.items() if not k.startswith("time/") and k not in TIME_KEYS} for row in rows]


def compare(name: str, before: str, after: str) -> bool:
    a, b = (comparable(os.path.join(d, name, "metrics.jsonl")) for d in (before, after))
    wa, wb = (open(os.path.join(d, name, "weights.sha256")).read().strip() for d in (before, after))
    keys = sorted({k for row in a for k in row})
    differing = sorted({k for ra, rb in zip(a, b) for k in set(ra) | set(rb) if ra.get(k) != rb.get(k)})
    same = len(a) == len(b) and not differing and wa == wb
    print(
        f"{name:22s} iterations {len(a)}/{len(b)}  keys compared {len(keys)}  "
        f"differing {differing or 'none'}  final weights {'identical' if wa == wb else 'DIFFER'}  "
        f"-> {'IDENTICAL' if same else 'DIFFERENT'}"
    )
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="folder of an earlier --out to compare against")
    parser.add_argument("--configs", default=",".join(CONFIGS))
    args = parser.parse_args()
    names = args.configs.split(",")
    for name in names:
        run(name, CONFIGS[name], args.out)
    if args.compare is None:
        return 0
    ok = [compare(name, args.compare, args.out) for name in names]
    print(f"{sum(ok)}/{len(ok)} configurations identical (all keys but time/*, eps, tokens_per_s; final weights)")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
