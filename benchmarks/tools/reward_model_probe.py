"""What a reward model folder rewards besides sentiment: fragments, short and long sentences, the polarity corpus
whole and cut to its first words, and PPO's case: the prompts of the training run's held-out pairs alone, and with
the chosen or the rejected continuation (for the built-in sets, a positive or a negative one). The probe figures
of docs/stages.md come from this script.

    python benchmarks/tools/reward_model_probe.py runs/reward-model/final/reward-model [--data PAIRS] [--threads 1]

One process, CPU, fp32; prints one line per probe (mean score, then each text's score for the short lists)."""

from __future__ import annotations

import argparse
import time

PROBES = {
    "fragment": ["The film is", "This movie", "It was a", "The story of", "As a remake, it's a"],
    "short positive": ["A gem.", "Wonderful film.", "I loved it.", "Brilliant and moving.", "A delight."],
    "short negative": ["A mess.", "Dull and boring.", "I hated it.", "Awful.", "A waste of time."],
    "long positive": [
        "This is a wonderful, warm and beautifully acted film that I will remember for years, with a story that "
        "moves and a cast that shines.",
        "One of the best movies of the year: funny, smart, touching, and made with real love for its characters "
        "and their world.",
    ],
    "long negative": [
        "This is a dull, lifeless and badly acted film that I will forget by tomorrow, with a story that drags and "
        "a cast that looks bored.",
        "One of the worst movies of the year: unfunny, stupid, tedious, and made with no care at all for its "
        "characters or its audience.",
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "model", help="a reward-model folder (what `lmppo reward-model` writes as OUTPUT_DIR/final/reward-model)"
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--data",
        default="builtin:polarity-mixed",
        help="the model's training pairs: PPO's case is scored on their held-out pairs that have a prompt",
    )
    parser.add_argument("--held-out", type=int, default=30, help="as `lmppo reward-model --data.holdout`")
    parser.add_argument("--seed", type=int, default=0, help="as `lmppo reward-model --seed`")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from lmppo.core.bradley_terry import pair_accuracy_and_margin, pearson_correlation
    from lmppo.data.preference_pairs import load_preference_pairs
    from lmppo.models.assets import polarity_sentences
    from lmppo.rewards.model import sequence_scores
    from lmppo.training.reward_model import split_pairs

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    tokenizer.padding_side = "right"
    model = AutoModelForSequenceClassification.from_pretrained(args.model).eval()

    def scores(texts: list[str]) -> torch.Tensor:
        out = []
        for k in range(0, len(texts), 16):
            enc = tokenizer(texts[k : k + 16], return_tensors="pt", padding=True)
            with torch.inference_mode():
                out.append(sequence_scores(model, enc["input_ids"], enc["attention_mask"], True).float())
        return torch.cat(out)  # (N,)

    def tokens(texts: list[str]) -> torch.Tensor:
        return torch.tensor([len(tokenizer(t)["input_ids"]) for t in texts], dtype=torch.float64)  # (N,)

    start = time.time()
    for name, texts in PROBES.items():
        s = scores(texts)
        print(f"{name:15s} mean {float(s.mean()):+.3f}  " + "  ".join(f"{x:+.2f}" for x in s.tolist()))
    texts, labels = polarity_sentences()
    positive = torch.tensor(labels, dtype=torch.bool)  # (200,)

    def by_label(s: torch.Tensor) -> str:
        return f"positive {float(s[positive].mean()):+.3f}, negative {float(s[~positive].mean()):+.3f}"

    whole = scores(texts)
    print(f"200 corpus sentences: {by_label(whole)}; r(score, tokens) {pearson_correlation(whole, tokens(texts)):+.3f}")
    for n in (3, 5, 8, 12):
        cut = scores([" ".join(t.split()[:n]) for t in texts])
        print(f"  cut to their first {n:2d} words: mean {float(cut.mean()):+.3f} ({by_label(cut)})")
    print(f"  whole: mean {float(whole.mean()):+.3f}")

    _, held = split_pairs(load_preference_pairs(args.data), args.held_out, args.seed)  # the run's held-out pairs
    held = [p for p in held if p.prompt is not None]
    chosen = scores([str(p.prompt) + str(p.chosen) for p in held])
    rejected = scores([str(p.prompt) + str(p.rejected) for p in held])
    accuracy, margin = pair_accuracy_and_margin(chosen, rejected)
    both = [str(p.prompt) + str(p.chosen) for p in held] + [str(p.prompt) + str(p.rejected) for p in held]
    r = pearson_correlation(torch.cat([chosen, rejected]), tokens(both))
    print(
        f"{args.data} held-out pairs with a prompt ({len(held)}): accuracy {accuracy:.3f}, margin {margin:+.3f}, "
        f"r(score, tokens) {r:+.3f}"
    )
    alone = scores([str(p.prompt) for p in held])
    print(
        f"  prompts alone {float(alone.mean()):+.3f}; + positive continuation {float(chosen.mean()):+.3f}, "
        f"+ negative {float(rejected.mean()):+.3f}"
    )
    for n in (2, 4, 8):
        c = scores([str(p.prompt) + " " + " ".join(str(p.chosen).split()[:n]) for p in held])
        j = scores([str(p.prompt) + " " + " ".join(str(p.rejected).split()[:n]) for p in held])
        print(
            f"  continuations cut to {n} words: positive {float(c.mean()):+.3f}, negative {float(j.mean()):+.3f}, "
            f"accuracy {pair_accuracy_and_margin(c, j)[0]:.3f}"
        )
    print(f"{time.time() - start:.0f} s")


if __name__ == "__main__":
    main()
