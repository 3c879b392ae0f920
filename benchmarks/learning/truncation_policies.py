"""Truncation policies side by side: none, penalty (EOS trick), bootstrap and drop on one task where cuts matter.

The task. A tiny Llama (built here, ~0.1M parameters) is first taught by a few seconds of supervised training to
continue openings such as "The movie was" with 1 to 4 clauses (" great and the music sounded sad.") and end with
<eos>; `rollout.max_new_tokens` = 8 cuts every answer longer than two clauses: about 70% at the start.
The reward prefers certain content: +1 for each positive adjective in the completion, -1 for each negative one
(a scalar on the last token). Once the policy has learned to be positive, every extra clause earns more, so a
trainer that scores a cut response like a finished one (`none`) pays it to run into the length limit.

Each policy trains from the same supervised model with the same seed and budget; then 64 fresh responses are
sampled from the trained policy and measured:

  score       the reward function's score of those responses (for cut ones: of the text that was produced)
  truncated   fraction that hit max_new_tokens without <eos>
  KL          mean summed per-token KL to the reference over the last 3 training iterations
  length      mean response length in tokens (<eos> included)
  proper      fraction that ended with <eos> and are well-formed (" adj( and subject verb adj)*."): a policy
              that repeats positive adjectives until it is cut scores well and writes nothing proper

    python benchmarks/learning/truncation_policies.py [--seeds 0,1,2] [--iterations 30] [--kl-coef 0.05] [--penalty -1]

Prints mean +- sd over seeds. About 10 s per run on one CPU core (plus 12 s per seed for the supervised start).
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

ROOT = bench_path.ROOT
bench_path.put_first(bench_path.SRC)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SUBJECTS = ["the movie", "this film", "the story", "my friend", "the actor", "the music", "the ending", "our team"]
VERBS = ["was", "is", "felt", "seemed", "looked", "sounded"]
POSITIVE = ["good", "great", "wonderful", "funny", "bright", "beautiful", "happy", "clever", "exciting"]
NEGATIVE = ["bad", "boring", "terrible", "slow", "strange", "sad", "dull", "long", "weak"]
POLICIES = {  # name -> reward.* settings
    "none": {"truncation": "none"},
    "penalty": {"truncation": "penalty", "penalty_mode": "replace"},  # reward.penalty from --penalty
    "bootstrap": {"truncation": "bootstrap"},
    "drop": {"truncation": "drop"},
}
MAX_NEW_TOKENS = 8
BATCH = 32


def clause(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(POSITIVE + NEGATIVE)}"


def example(rng: random.Random) -> tuple[str, str]:
    """(prompt, completion): the opening of a first clause and 1-4 clauses in all, ending with a full stop."""
    subject, verb = rng.choice(SUBJECTS), rng.choice(VERBS)
    first = rng.choice(POSITIVE + NEGATIVE)
    more = "".join(f" and {clause(rng)}" for _ in range(rng.randint(0, 3)))
    return f"{subject[0].upper()}{subject[1:]} {verb}", f" {first}{more}."


def proper_sentence() -> re.Pattern:
    adj = "(?:" + "|".join(POSITIVE + NEGATIVE) + ")"
    clause = f"(?:{'|'.join(SUBJECTS)}) (?:{'|'.join(VERBS)}) {adj}"
    return re.compile(f"^ {adj}(?: and {clause})*\\.$")


def content_score(prompts: list[str], completions: list[str]) -> list[float]:
    """+1 per positive adjective, -1 per negative one."""
    out = []
    for text in completions:
        words = text.replace(".", " ").split()
        out.append(float(sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)))
    return out


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(1234)
    texts = ["".join(example(rng)) for _ in range(3000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<pad>", "<eos>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def supervised_policy(tokenizer, seed: int, steps: int = 300):
    """A tiny Llama taught the format (openings -> clauses -> <eos>) by supervised training."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    policy = LlamaForCausalLM(
        LlamaConfig(
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
    )
    rng = random.Random(seed)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=3e-3)
    policy.train()
    for _ in range(steps):
        batch = tokenizer(
            ["".join(example(rng)) + tokenizer.eos_token for _ in range(64)], return_tensors="pt", padding=True
        )
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        policy(**batch, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return policy.eval()


def run_policy(
    name: str,
    policy,
    tokenizer,
    seed: int,
    iterations: int,
    output_dir: str,
    kl_coef: float = 0.05,
    penalty: float = -1.0,
) -> dict[str, float]:
    import torch

    from lmppo.config import Config
    from lmppo.rewards import FunctionSource
    from lmppo.training.trainer import PPOTrainer

    cfg = Config()
    cfg.output_dir = output_dir
    cfg.overwrite = True
    cfg.seed = seed
    cfg.total_episodes = BATCH * iterations
    cfg.data.max_prompt_length = 16
    cfg.rollout.batch_size = BATCH
    cfg.rollout.max_new_tokens = MAX_NEW_TOKENS
    cfg.rollout.stop_token = "eos"
    cfg.ppo.learning_rate = 1e-3
    cfg.ppo.micro_batch_size = BATCH
    cfg.ppo.num_epochs = 4
    cfg.ppo.lr_schedule = "constant"
    cfg.kl.controller = "fixed"
    cfg.kl.coef = kl_coef
    cfg.log.trackers = []
    cfg.log.sample_every = 0
    cfg.reward.penalty = penalty
    for key, value in POLICIES[name].items():
        setattr(cfg.reward, key, value)
    rng = random.Random(seed)
    prompts = sorted({example(rng)[0] for _ in range(200)})
    trainer = PPOTrainer(
        cfg,
        policy=copy.deepcopy(policy),
        tokenizer=tokenizer,
        prompts=prompts,
        reward_functions=[FunctionSource.from_callable(content_score, name="content")],
    )
    history = trainer.train()
    scores, cut, lengths, proper = [], [], [], []
    grammar = proper_sentence()
    with torch.no_grad():
        for _ in range(2):  # 64 fresh responses from the trained policy
            rollout = trainer.collect_rollout()
            scores += content_score(rollout.episodes.prompts.texts, rollout.episodes.side.texts)
            cut += rollout.truncated.float().tolist()
            lengths += rollout.response_mask.sum(1).float().tolist()
            proper += [
                float(bool(done) and grammar.match(text) is not None)
                for done, text in zip(rollout.terminated.tolist(), rollout.episodes.side.texts)
            ]
    mean = statistics.mean
    return {
        "score": mean(scores),
        "truncated": mean(cut),
        "length": mean(lengths),
        "proper": mean(proper),
        "kl": mean(m["objective/kl"] for m in history[-3:]),
        "first_truncated": history[0]["response/truncated_frac"],
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    parser.add_argument("--iterations", type=int, default=30, help="PPO iterations of 32 episodes")
    parser.add_argument("--kl-coef", type=float, default=0.05, help="fixed KL coefficient")
    parser.add_argument("--penalty", type=float, default=-1.0, help="reward.penalty of the `penalty` policy (replace)")
    parser.add_argument(
        "--policies", default=",".join(POLICIES), help="comma-separated subset of " + ",".join(POLICIES)
    )
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    seeds = [int(s) for s in args.seeds.split(",")]
    names = args.policies.split(",")
    tokenizer = build_tokenizer()
    results: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            policy = supervised_policy(tokenizer, seed)
            for name in names:
                r = run_policy(
                    name,
                    policy,
                    tokenizer,
                    seed,
                    args.iterations,
                    os.path.join(tmp, f"{name}-{seed}"),
                    args.kl_coef,
                    args.penalty,
                )
                results[name].append(r)
                print(
                    f"  seed {seed} {name:>9}: score {r['score']:+.2f}  truncated {r['truncated']:.2f} "
                    f"(first iteration {r['first_truncated']:.2f})  KL {r['kl']:.2f}  length {r['length']:.1f}  "
                    f"proper {r['proper']:.2f}",
                    flush=True,
                )

    def ms(rows, key, fmt):
        xs = [r[key] for r in rows]
        sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
        return f"{format(statistics.mean(xs), fmt)} ± {format(sd, fmt.lstrip('+'))}"

    print(
        f"\nTruncation policies: {len(seeds)} seeds x {args.iterations} iterations x {BATCH} episodes, "
        f"max_new_tokens {MAX_NEW_TOKENS}, kl.coef {args.kl_coef}, penalty {args.penalty}; measured on 64 fresh "
        f"responses after training"
    )
    print("| policy | score | truncated fraction | KL | response length | proper | truncated, first iteration |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in names:
        rows = results[name]
        print(
            f"| {name} | {ms(rows, 'score', '+.2f')} | {ms(rows, 'truncated', '.2f')} | {ms(rows, 'kl', '.1f')} | "
            f"{ms(rows, 'length', '.1f')} | {ms(rows, 'proper', '.2f')} | {ms(rows, 'first_truncated', '.2f')} |"
        )
    print(f"\n({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
