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

`--reward-model rm_tiny,rm_builtin` adds the reward-model stage (`lmppo reward-model`; written against its API
before and after issue 51, so one script runs on both): `rm_tiny` a tiny Llama on 48 generated pairs, LoRA and
checkpoints, in seconds; `rm_builtin` the command's own default (the built-in pairs on SmolLM2-135M, minutes).
Compared: the held-out figures before and after training, every step's loss and held-out row, the final weights.

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


# ----------------------------------------------------------------------------- the reward-model stage
REWARD_MODEL_RUNS = ("rm_tiny", "rm_builtin")


def run_reward_model(name: str, out_root: str) -> None:
    """One reward-model run through whichever API the code has (`RewardModelConfig` since issue 51, else the
    stage's own `RewardModelSettings`); writes heldout.json and weights.sha256 beside its run folder's files."""
    out = os.path.join(out_root, name)
    small = {"epochs": 2, "batch_size": 8, "held_out": 8, "learning_rate": 3e-3, "checkpoint_every": 2, "lora_r": 4}
    fields = {"data": "builtin:polarity-mixed", "base": "smollm2"} if name == "rm_builtin" else _tiny_inputs(out_root)
    fields.update({} if name == "rm_builtin" else small)
    try:
        from lmppo import RewardModelConfig, train_reward_model
    except ImportError:  # the code before issue 51
        from lmppo.training.reward_model import RewardModelSettings
        from lmppo.training.reward_model import train_reward_model as train_old

        result = train_old(RewardModelSettings(output_dir=out, overwrite=True, **fields))
    else:
        from lmppo.config import apply_override

        cfg = RewardModelConfig(output_dir=out, overwrite=True)
        cfg.log.trackers = []
        new_names = {"data": "data.pairs", "base": "model.policy", "epochs": "training.epochs",
                     "batch_size": "training.batch_size", "held_out": "data.holdout",
                     "learning_rate": "training.learning_rate", "checkpoint_every": "checkpoint.every",
                     "lora_r": "model.lora.r"}  # fmt: skip
        for key, value in fields.items():
            apply_override(cfg, new_names[key], value)
        cfg.model.lora.alpha = 2 * cfg.model.lora.r  # the stage's LoRA alpha before issue 51 (32 at the default r)
        result = train_reward_model(cfg)
    with open(os.path.join(out, "heldout.json"), "w") as fh:
        json.dump({"before": list(result.before), "after": list(result.after), "steps": result.steps}, fh)
    from safetensors.torch import load_file

    h = hashlib.sha256()
    for key, value in sorted(load_file(os.path.join(result.model_dir, "model.safetensors")).items()):
        h.update(key.encode())
        h.update(value.float().numpy().tobytes())
    with open(os.path.join(out, "weights.sha256"), "w") as fh:
        fh.write(h.hexdigest() + "\n")


def _tiny_inputs(out_root: str) -> dict:
    """A tiny Llama's folder and 48 pairs any model can learn, written once under `out_root`."""
    base, data = os.path.join(out_root, "rm_tiny_base"), os.path.join(out_root, "rm_tiny_pairs.jsonl")
    tok = make_bpe_tokenizer()
    torch.manual_seed(0)
    tiny_llama(tok).save_pretrained(base)
    tok.save_pretrained(base)
    with open(data, "w") as fh:
        for i in range(48):
            fh.write(json.dumps({"chosen": f"the film was great {i}", "rejected": f"the film was awful {i}"}) + "\n")
    return {"data": data, "base": base}


def reward_model_rows(folder: str) -> list[dict]:
    """metrics.jsonl's rows with the step under one name (`step` before issue 51, `iteration` after)."""
    return [{("iteration" if k == "step" else k): v for k, v in row.items()} for row in comparable(folder)]


def compare_reward_model(name: str, before: str, after: str) -> bool:
    a, b = (reward_model_rows(os.path.join(d, name, "metrics.jsonl")) for d in (before, after))
    ha, hb = (json.load(open(os.path.join(d, name, "heldout.json"))) for d in (before, after))
    wa, wb = (open(os.path.join(d, name, "weights.sha256")).read().strip() for d in (before, after))
    same = a == b and ha == hb and wa == wb
    print(
        f"{name:22s} steps {ha['steps']}/{hb['steps']}  held out before {ha['before']} / {hb['before']}  after "
        f"{ha['after']} / {hb['after']}  metrics rows {'identical' if a == b else 'DIFFER'}  final weights "
        f"{'identical' if wa == wb else 'DIFFER'}  -> {'IDENTICAL' if same else 'DIFFERENT'}"
    )
    return same


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare", default=None, help="folder of an earlier --out to compare against")
    parser.add_argument("--configs", default=",".join(CONFIGS), help="PPO configurations ('' for none)")
    parser.add_argument(
        "--reward-model", default="", help="reward-model runs, of " + ", ".join(REWARD_MODEL_RUNS) + " (default none)"
    )
    args = parser.parse_args()
    names = [n for n in args.configs.split(",") if n]
    reward_models = [n for n in args.reward_model.split(",") if n]
    for name in names:
        run(name, CONFIGS[name], args.out)
    for name in reward_models:
        run_reward_model(name, args.out)
    if args.compare is None:
        return 0
    ok = [compare(name, args.compare, args.out) for name in names]
    ok += [compare_reward_model(name, args.compare, args.out) for name in reward_models]
    print(f"{sum(ok)}/{len(ok)} configurations identical (all keys but time/*, eps, tokens_per_s; final weights)")
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
