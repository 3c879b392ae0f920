"""Reward the tokens of the larger number, penalise those of the smaller (trlx issue #79).

A rollout is a short dialogue in which two people each say a number:

    Round 7. Alice: 42
    Bob: 17

The reward can only be computed once the whole rollout exists (which number is larger depends on both), and it
is not one number for the response: the characters of the larger number get +1, those of the smaller -1. The
reward function returns character spans `(start_char, end_char, value)` over the completion text; lmppo maps them
onto the policy's tokens (here a number is one or two tokens) and spreads each value over its tokens.

Everything is built in this script, on CPU, in well under a minute: a byte-level BPE tokenizer and a tiny Llama
(0.12M parameters) that is first taught the dialogue format by a few seconds of supervised training (numbers
uniform in 1..99, so Bob's is the larger one half the time), then trained with PPO on the span rewards. The script
prints where the rewards landed, token by token, for two samples before and after training, and a table of how
the dialogues change.

    python examples/per_token_rewards/train.py [--iterations 40] [--gamma 1.0] [--scalar]

What PPO makes of the rewards: with gamma = 1 (the default) each token is credited with every reward from itself
to the end of the response. The token that ends Alice's number (the newline) is followed only by Bob's number,
whose reward is +1 exactly when hers is -1, so PPO learns that Alice should stop after one digit and Bob should
say more: Bob's number ends up the larger one in almost every dialogue. With `--gamma 0` each token is credited
with its own reward only, so each number is judged on its own tokens and both speakers move to large numbers.
The summed score of every well-formed dialogue is 0, so `--scalar` (one number per response, all trlx offered
in #79) has nothing to learn from. See README.md in this folder for the figures.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import time

try:
    import lmppo  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))

import torch

from lmppo.config import Config
from lmppo.rewards import FunctionSource
from lmppo.training.trainer import PPOTrainer

NUMBER = re.compile(r"\d+")


# ----------------------------------------------------------------------------- the reward (what issue #79 asks)


def larger_number_spans(prompts: list[str], completions: list[str]) -> list:
    """+1 on the characters of the larger of the two numbers in each completion, -1 on the smaller.

    A completion that does not hold exactly two numbers gets one score, -1, on its last token (a reward function
    may mix output forms in one batch). A tie gets no reward anywhere (an empty list of spans)."""
    out: list = []
    for text in completions:
        numbers = list(NUMBER.finditer(text))
        if len(numbers) != 2:
            out.append(-1.0)
            continue
        first, second = numbers
        if int(first.group()) == int(second.group()):
            out.append([])
            continue
        win, lose = (first, second) if int(first.group()) > int(second.group()) else (second, first)
        out.append([(win.start(), win.end(), 1.0), (lose.start(), lose.end(), -1.0)])
    return out


def summed(prompts: list[str], completions: list[str]) -> list[float]:
    """The same signal as one number per response (what a scalar-only trainer would get)."""
    return [
        sum(v for _, _, v in spans) if isinstance(spans, list) else spans
        for spans in larger_number_spans(prompts, completions)
    ]


# ----------------------------------------------------------------------------- a tiny world to play in


def dialogue(rng: random.Random, round_no: int) -> tuple[str, str]:
    """(prompt, completion) of one dialogue with numbers uniform in 1..99."""
    return f"Round {round_no}. Alice:", f" {rng.randint(1, 99)}\nBob: {rng.randint(1, 99)}"


def build_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<pad>", "<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def build_policy(tokenizer, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg)


def teach_the_format(policy, tokenizer, seed: int, steps: int) -> None:
    """Supervised training on random dialogues (each ends with <eos>), so the policy speaks the format."""
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    policy.train()
    for _ in range(steps):
        texts = ["".join(dialogue(rng, rng.randint(1, 32))) + tokenizer.eos_token for _ in range(64)]
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        loss = policy(**batch, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    policy.eval()


# ----------------------------------------------------------------------------- looking at the rewards


def show_token_rewards(trainer: PPOTrainer, count: int) -> None:
    """Sample a batch with the current policy and print, for `count` dialogues, each response token with its
    placed score and its reward (score - beta * KL, as PPO sees it)."""
    rollout = trainer.collect_rollout()  # 1. generate
    scored = trainer.score(rollout)  # 2. the spans, placed on tokens
    rewards = trainer.token_rewards(rollout, scored)  # 3. minus beta * KL
    shown = 0
    for i in range(rollout.batch_size):
        if len(NUMBER.findall(rollout.episodes.side.texts[i])) != 2 and shown < count - 1:
            continue  # prefer well-formed dialogues
        n = int(rollout.response_mask[i].sum())
        print(f"  {rollout.episodes.prompts.texts[i]}{rollout.episodes.side.texts[i]!r}".replace("\\n", "\u21b5"))
        print(f"    {'token':>10} {'score':>7} {'reward':>8}")
        for k in range(n):
            token = tokenizer_text(trainer.tokenizer, int(rollout.response_ids[i, k]))
            print(f"    {token!r:>10} {scored.token_scores[i, k].item():+7.2f} {rewards.rewards[i, k].item():+8.3f}")
        shown += 1
        if shown == count:
            break


def tokenizer_text(tokenizer, token_id: int) -> str:
    if token_id == tokenizer.eos_token_id:
        return tokenizer.eos_token
    return tokenizer.decode([token_id])


class DialogueStats:
    """Wraps a reward function to count, per call (one call per iteration), how often Bob's number is larger."""

    def __init__(self, fn):
        self.fn, self.rows = fn, []
        self.__name__ = fn.__name__

    def __call__(self, prompts, completions):
        pairs = [[int(x) for x in NUMBER.findall(text)] for text in completions]
        pairs = [p for p in pairs if len(p) == 2]
        n = max(len(pairs), 1)
        self.rows.append(
            {
                "bob_wins": sum(b > a for a, b in pairs) / n,
                "alice_median": _median([a for a, _ in pairs]),
                "bob_median": _median([b for _, b in pairs]),
                "well_formed": len(pairs) / len(completions),
            }
        )
        return self.fn(prompts, completions)


def _median(xs: list[int]) -> float:
    xs = sorted(xs)
    return float("nan") if not xs else (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2


# ----------------------------------------------------------------------------- main


def make_trainer(args, tokenizer, policy, prompts, reward) -> PPOTrainer:
    cfg = Config()
    cfg.output_dir = args.output_dir + ("-scalar" if args.scalar else "")
    cfg.overwrite = True
    cfg.seed = args.seed
    cfg.total_episodes = args.iterations * args.batch_size
    cfg.rollout.batch_size = args.batch_size
    cfg.data.max_prompt_length = 16
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.stop_token = "eos"
    cfg.ppo.learning_rate = args.lr
    cfg.ppo.micro_batch_size = args.batch_size
    cfg.ppo.num_epochs = 4
    cfg.ppo.gamma = args.gamma
    cfg.ppo.lr_schedule = "constant"
    cfg.kl.controller = "fixed"
    cfg.kl.coef = args.kl_coef
    cfg.log.trackers = []
    cfg.log.sample_every = 0
    source = FunctionSource.from_callable(reward, name="larger_number", span_placement="spread")
    return PPOTrainer(cfg, policy=policy, tokenizer=tokenizer, prompts=prompts, reward_functions=[source])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=40, help="PPO iterations")
    parser.add_argument("--batch-size", type=int, default=32, help="dialogues per iteration")
    parser.add_argument("--format-steps", type=int, default=300, help="supervised steps teaching the format")
    parser.add_argument("--lr", type=float, default=1e-3, help="PPO learning rate")
    parser.add_argument("--kl-coef", type=float, default=0.1, help="KL penalty coefficient (fixed)")
    parser.add_argument(
        "--gamma",
        type=float,
        default=1.0,
        help="discount: 1 credits a token with every reward after it, 0 with its own reward only",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--scalar",
        action="store_true",
        help="train on the summed score instead of the spans (for comparison: nothing to learn)",
    )
    parser.add_argument("--output-dir", default="runs/per_token_rewards")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a tiny model: more threads only add overhead (and fight over shared cores)
    started = time.perf_counter()

    rng = random.Random(args.seed)
    corpus = ["".join(dialogue(rng, rng.randint(1, 32))) for _ in range(2000)]
    tokenizer = build_tokenizer(corpus)
    policy = build_policy(tokenizer, args.seed)
    teach_the_format(policy, tokenizer, args.seed, args.format_steps)
    print(
        f"taught the dialogue format in {time.perf_counter() - started:.0f} s "
        f"({sum(p.numel() for p in policy.parameters()) / 1e6:.2f}M parameters)"
    )

    prompts = [f"Round {k}. Alice:" for k in range(1, 33)]
    reward = DialogueStats(summed if args.scalar else larger_number_spans)
    trainer = make_trainer(args, tokenizer, policy, prompts, reward)
    print("\nwhere the rewards land, before training:")
    show_token_rewards(trainer, 2)
    reward.rows.clear()

    history = trainer.train()
    rows = reward.rows[: len(history)]
    print(f"\n{'iteration':>9} {'Bob wins':>9} {'median Alice':>13} {'median Bob':>11} {'well formed':>12} {'KL':>6}")
    for k, (m, row) in enumerate(zip(history, rows), 1):
        if k <= 3 or k % 5 == 0 or k == len(history):
            print(
                f"{k:>9} {row['bob_wins']:>9.2f} {row['alice_median']:>13.1f} {row['bob_median']:>11.1f} "
                f"{row['well_formed']:>12.2f} {m['objective/kl']:>6.2f}"
            )
    print("\nwhere the rewards land, after training:")
    show_token_rewards(trainer, 2)
    first, last = rows[0]["bob_wins"], sum(r["bob_wins"] for r in rows[-5:]) / 5
    print(
        f"\nBob's number is the larger one in {first:.0%} of the dialogues of the first iteration and "
        f"{last:.0%} of the last 5 ({'summed scalar' if args.scalar else 'span'} rewards; "
        f"{time.perf_counter() - started:.0f} s in all). Metrics: {trainer.config.output_dir}/metrics.jsonl"
    )


if __name__ == "__main__":
    main()
