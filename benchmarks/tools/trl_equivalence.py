"""One PPO iteration of TRL's PPOTrainer and of lmppo on the *same* rollout: do the updates agree?

The speed benchmark (``compare_trl.py``) compares the two trainers over whole runs, where sampling noise
hides small differences in the update. This script removes the noise: it runs one TRL 1.12 iteration
(batch 8, 4 PPO epochs, one minibatch), records the prompts and the responses TRL sampled, then runs one
lmppo iteration whose sampler returns exactly those responses. With one minibatch the update is deterministic
given the rollout, so any difference in rewards, advantages, losses or the weights after the update is a
difference of algorithm, not of luck.

It prints both trainers' logged metrics side by side and the relative size of the difference between the
two weight updates, for the policy and the critic: ``|dW_lmppo - dW_trl| / |dW_trl|``. Float rounding
alone gives about 1e-6; an algorithmic difference gives 1e-2 or more.

The same is done for the TRL drop-in (``lmppo.trl.PPOTrainer``), built from the *same* PPOConfig fields as TRL's
(``compare_trl.trl_args`` with ``lmppo.trl.PPOConfig``) and the same kind of objects (policy, reference policy,
reward model and value model loaded with ``Auto*`` classes, a ``datasets.Dataset`` of ``input_ids``), with
``max_grad_norm=0`` given to both (TRL 1.12 never clips; the drop-in applies ``max_grad_norm``, 1.0 by default).

Needs an interpreter with TRL 1.12 and lmppo importable (``PYTHONPATH=src``); builds the speed benchmark's tiny
models and prompts first if they are not cached yet::

    PYTHONPATH=src .venv-trl/bin/python benchmarks/tools/trl_equivalence.py [--seed 0] [--iterations 1]
        [--plain-first-epoch]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
import common  # noqa: E402
import compare_trl  # noqa: E402

METRICS = [
    "objective/scores",
    "objective/kl",
    "objective/non_score_reward",
    "objective/rlhf_reward",
    "objective/entropy",
    "loss/policy_avg",
    "loss/value_avg",
    "policy/clipfrac_avg",
    "val/clipfrac_avg",
    "policy/approxkl_avg",
    "policy/entropy_avg",
    "val/ratio",
    "val/ratio_var",
    "val/num_eos_tokens",
]


def _settings(cache: Path, out: Path, seed: int, iterations: int) -> dict:
    """The benchmark's base configuration (``compare_trl.make_run_cfg``), for ``iterations`` batches."""
    episodes = common.BASE_SETTINGS["batch_size"] * iterations
    return compare_trl.make_run_cfg("base", "both", seed, episodes, cache, out)


def run_trl(cache: Path, s: dict, out: Path):
    """Train TRL for the given episodes; return (rollouts [(queries, responses) per iteration], metrics, models)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    transformers.set_seed(s["seed"])
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    tok.padding_side = "left"
    policy = AutoModelForCausalLM.from_pretrained(cache / "policy")
    ref = AutoModelForCausalLM.from_pretrained(cache / "policy")
    critic = AutoModelForSequenceClassification.from_pretrained(cache / "critic")
    reward = AutoModelForSequenceClassification.from_pretrained(cache / "reward")
    prompts = common.load_prompts(cache)
    args = compare_trl.trl_args(s, out / "trl", max_grad_norm=0.0)  # TRL 1.12 never clips; the drop-in would

    rollouts: list[tuple] = []
    original = trl_ppo.batch_generation

    def recording_generation(model, queries, *a, **kw):
        query_responses, logits = original(model, queries, *a, **kw)
        rollouts.append((queries.clone(), query_responses[:, queries.shape[1] :].clone()))
        return query_responses, logits

    trl_ppo.batch_generation = recording_generation

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=ref,
        reward_model=reward,
        train_dataset=Dataset.from_dict({"input_ids": prompts["train"]}),
        value_model=critic,
        eval_dataset=Dataset.from_dict({"input_ids": prompts["eval"][:8]}),
    )
    try:
        trainer.train()
    finally:
        trl_ppo.batch_generation = original
    wrapped = trainer.accelerator.unwrap_model(trainer.model)
    return rollouts, trainer.state.log_history, wrapped.policy, wrapped.value_model, tok


def run_lmppo(cache: Path, s: dict, out: Path, rollouts: list, tok):
    """One lmppo run over the same prompts whose sampler returns TRL's responses, iteration by iteration."""
    from transformers import AutoModelForCausalLM

    from lmppo.training.assembly import build_components
    from lmppo.training.trainer import PPOTrainer

    pad = tok.pad_token_id
    prompt_lists = []
    for queries, _ in rollouts:
        prompt_lists += [q[q != pad].tolist() for q in queries]
    replay = iter(rollouts)

    c = compare_trl.lmppo_config(s, out / "lmppo")
    c.data.shuffle = False  # the prompts are TRL's, in TRL's order
    c.ppo.reuse_rollout_forward = not s.get("plain_first_epoch", False)
    policy = AutoModelForCausalLM.from_pretrained(cache / "policy")
    parts = build_components(c, policy=policy, tokenizer=tok, prompts=prompt_lists)
    parts.sampling_engines[c.rollout.backend] = replay_engine(
        replay, c, parts.stop_ids, parts.tokenizer.pad_token_id, parts.accelerator
    )
    trainer = PPOTrainer(c, components=parts)
    history = trainer.train()
    return history, trainer.policy, trainer.accelerator.unwrap_model(trainer.critic).model


def run_dropin(cache: Path, s: dict, out: Path, rollouts: list, tok):
    """lmppo's TRL drop-in (``lmppo.trl``) with TRL's arguments and objects, its sampler replaying TRL's responses.
    Returns (TRL-named log history, policy, critic model)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from lmppo.data.prompts import PromptStream
    from lmppo.training.assembly import prompts_per_iteration
    from lmppo.trl import PPOConfig, PPOTrainer

    pad = tok.pad_token_id
    prompt_lists = []
    for queries, _ in rollouts:
        prompt_lists += [q[q != pad].tolist() for q in queries]
    replay = iter(rollouts)
    args = compare_trl.trl_args(s, out / "dropin", config_cls=PPOConfig, max_grad_norm=0.0)
    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=AutoModelForCausalLM.from_pretrained(cache / "policy"),
        ref_model=AutoModelForCausalLM.from_pretrained(cache / "policy"),
        reward_model=AutoModelForSequenceClassification.from_pretrained(cache / "reward"),
        value_model=AutoModelForSequenceClassification.from_pretrained(cache / "critic"),
        train_dataset=Dataset.from_dict({"input_ids": prompt_lists}),
    )
    lm = trainer.lmppo  # the prompts are TRL's, in TRL's order
    lm.stream = PromptStream(len(lm.prompt_set.ids), prompts_per_iteration(lm.config), lm.config.seed, False)
    lm.sampling_engines[lm.config.rollout.backend] = replay_engine(
        replay, lm.config, lm.stop_ids, lm.tokenizer.pad_token_id, lm.accelerator
    )
    trainer.train()
    return trainer.state.log_history, trainer.model.policy, trainer.model.value_model


def replay_engine(replay, *engine_args):
    """A sampling engine (lmppo.sampling.engines) that returns TRL's responses, iteration by iteration."""
    import torch

    from lmppo.core.masking import stop_token_mask
    from lmppo.sampling.engines import SamplingEngine

    class ReplayEngine(SamplingEngine):
        def sample(self, model, prompts):
            queries, responses = next(replay)
            assert torch.equal(prompts.ids, queries), "lmppo's prompts differ from TRL's"
            mask, terminated = stop_token_mask(responses, self.stop_ids)
            responses = torch.where(mask, responses, torch.full_like(responses, self.pad_id))
            return responses, mask, terminated, ~terminated & (mask.sum(1) >= self.config.rollout.max_new_tokens)

    return ReplayEngine(*engine_args)


def relative_update_difference(start, a, b) -> float:
    """|(a - start) - (b - start)| / |b - start| over all parameters (b is the reference)."""
    diff = sq_ref = 0.0
    sa, sb = dict(a.named_parameters()), dict(b.named_parameters())
    for name, p0 in start.named_parameters():
        da, db = sa[name].detach() - p0.detach(), sb[name].detach() - p0.detach()
        diff += float(((da - db) ** 2).sum())
        sq_ref += float((db**2).sum())
    return (diff / max(sq_ref, 1e-30)) ** 0.5


def max_abs_difference(a, b) -> float:
    """max |a - b| over all parameters of two models of the same architecture."""
    sb = dict(b.named_parameters())
    return max(float((p.detach() - sb[name].detach()).abs().max()) for name, p in a.named_parameters())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--iterations", type=int, default=1)
    ap.add_argument(
        "--plain-first-epoch",
        action="store_true",
        help="lmppo runs the first epoch's forward pass again (ppo.reuse_rollout_forward false)",
    )
    ap.add_argument("--cache", type=Path, default=common.DEFAULT_CACHE_ROOT / "tiny")
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.set_num_threads(1)
    compare_trl.build_cache(sys.executable, "tiny", a.cache, None, 3600)  # reused when already built
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        s = dict(_settings(a.cache, out, a.seed, a.iterations), plain_first_epoch=a.plain_first_epoch)
        rollouts, trl_logs, trl_policy, trl_critic, tok = run_trl(a.cache, s, out)
        history, lm_policy, lm_critic = run_lmppo(a.cache, s, out, rollouts, tok)
        dropin_logs, di_policy, di_critic = run_dropin(a.cache, s, out, rollouts, tok)
    start_policy = AutoModelForCausalLM.from_pretrained(a.cache / "policy")
    start_critic = AutoModelForSequenceClassification.from_pretrained(a.cache / "critic")
    trl_logs = [l for l in trl_logs if "objective/kl" in l]
    for it, (tl, ll, dl) in enumerate(zip(trl_logs, history, dropin_logs), 1):
        print(f"iteration {it}: {'metric':28} {'TRL':>12} {'lmppo':>12} {'drop-in':>12}")
        for name in METRICS:
            print(
                f"{'':13}{name:28} {tl.get(name, float('nan')):12.6f} {ll.get(name, float('nan')):12.6f} "
                f"{dl.get(name, float('nan')):12.6f}"
            )
    same = all(set(t) == set(d) for t, d in zip(trl_logs, dropin_logs)) and len(trl_logs) == len(dropin_logs)
    print(
        f"drop-in log_history: {len(dropin_logs)} entries, metric names {'the same as' if same else 'DIFFERENT from'}"
        f" TRL's ({len(trl_logs[0]) if trl_logs else 0} names)"
    )
    print(
        f"responses ending in the stop token: {sum(int((r == tok.eos_token_id).any(1).sum()) for _, r in rollouts)}"
        f" of {sum(len(r) for _, r in rollouts)}"
    )
    print(
        f"policy update: |dW_lmppo - dW_trl| / |dW_trl| = "
        f"{relative_update_difference(start_policy, lm_policy, trl_policy):.2e}"
    )
    print(
        f"critic update: |dW_lmppo - dW_trl| / |dW_trl| = "
        f"{relative_update_difference(start_critic, lm_critic, trl_critic):.2e}"
    )
    print(
        f"drop-in policy update: |dW_dropin - dW_trl| / |dW_trl| = "
        f"{relative_update_difference(start_policy, di_policy, trl_policy):.2e}"
    )
    print(
        f"drop-in critic update: |dW_dropin - dW_trl| / |dW_trl| = "
        f"{relative_update_difference(start_critic, di_critic, trl_critic):.2e}"
    )
    print(
        f"drop-in vs TRL weights after the update: max |W_dropin - W_trl| = "
        f"{max_abs_difference(di_policy, trl_policy):.2e}"
        f" (policy), {max_abs_difference(di_critic, trl_critic):.2e} (critic); largest weight change by TRL: "
        f"{max_abs_difference(trl_policy, start_policy):.2e} (policy), "
        f"{max_abs_difference(trl_critic, start_critic):.2e}"
        " (critic)"
    )


if __name__ == "__main__":
    main()
