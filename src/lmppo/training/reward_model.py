"""`lmppo reward-model`: a reward model trained on preference pairs with the Bradley-Terry loss.

A sequence-classification model (one label) is made from a causal LM or an existing classifier (`base`), trained
whole or through LoRA adapters (the score head always trains) on the pairs of `lmppo.data.preference_pairs`, scored
as `reward.sources: [{kind: model}]` reads them (`lmppo.rewards.model.sequence_scores`: the last real token of the
right-padded text). Held-out pairs (the last `held_out` of a seeded shuffle) give the pair accuracy and the reward
margin before training, after each epoch and at the end.

The run folder follows `lmppo train`'s rules: a folder holding other files is refused unless `overwrite` (then only
what a reward-model run writes is removed); the folder is checked writable before any model loads; one process at a
time (`lmppo.run.outputs.result_output`: the run lock); checkpoints written whole or not at all
(`checkpoints/iter-STEP`, verified by their manifest); `--resume OUTPUT_DIR` continuing from the latest complete one
to the same weights as a run never stopped (the data order is a function of (seed, epoch), the loss has no
randomness: LoRA dropout is 0); the final model published at once as OUTPUT_DIR/model with its card.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
from safetensors.torch import load_file, save_file

from lmppo.core.bradley_terry import bradley_terry_loss, pair_accuracy_and_margin, pearson_correlation
from lmppo.data.preference_pairs import PreferencePair, load_preference_pairs, pair_texts
from lmppo.errors import CheckpointError, ConfigError
from lmppo.models.files import load_whole
from lmppo.models.loading import resolve_model_path
from lmppo.models.precision import PRECISIONS, choose_precision
from lmppo.rewards.model import sequence_scores
from lmppo.run import storage
from lmppo.run.folder import checkpoints_dir
from lmppo.run.layout import CHECKPOINTS, METRICS, OPTIMIZER, STATE, TRAINED, checkpoint_name
from lmppo.run.manifest import latest_checkpoint, prune_checkpoints, write_manifest
from lmppo.run.metrics_file import read_jsonl
from lmppo.run.model_card import lmppo_version
from lmppo.run.outputs import check_writable, result_output
from lmppo.run.state import RngState

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

SETTINGS, MODEL = "reward_model.json", "model"
OWN = (SETTINGS, METRICS, MODEL, CHECKPOINTS)
"""What a reward-model run writes in its folder (all that `overwrite` removes)."""


@dataclass
class RewardModelSettings:
    data: str = "builtin:polarity-mixed"
    """Preference pairs: a .jsonl file, a datasets folder, a .parquet / .arrow file, or a built-in set
    (`builtin:polarity-mixed`, `builtin:polarity`, `builtin:polarity-continuations`)."""
    base: str = "smollm2"
    """The model to start from: a local folder, a Hub id or a built-in name (as `model.policy`)."""
    output_dir: str = "runs/reward-model"
    lora: bool = True
    """Train LoRA adapters (merged into the saved model) and the score head; False: every weight."""
    lora_r: int = 16
    epochs: int = 2
    learning_rate: float = 2e-4
    batch_size: int = 8
    """Pairs per optimizer step."""
    held_out: int = 30
    """Pairs kept out of training for the accuracy and margin."""
    max_length: int = 128
    """Tokens per text at most (the start is cut: the end of an answer is always read)."""
    seed: int = 0
    checkpoint_every: int = 5
    """Optimizer steps between checkpoints (and one at the end of each epoch)."""
    overwrite: bool = False
    precision: str = "auto"
    """`auto` (bf16 autocast where the CPU or GPU computes bf16 natively, as `lmppo train`), `bf16` or `fp32`."""

    def check(self) -> None:
        """ConfigError naming the first field with a value that cannot work (before any model loads)."""
        positive = ("lora_r", "epochs", "batch_size", "held_out", "max_length", "checkpoint_every")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, value, "must be a whole number >= 1")
        if not (isinstance(self.learning_rate, (int, float)) and 0 < self.learning_rate < 1):
            raise ConfigError("learning_rate", self.learning_rate, "must be in (0, 1)")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError("seed", self.seed, "must be a whole number >= 0")
        if self.precision not in PRECISIONS:
            raise ConfigError("precision", self.precision, "must be one of " + ", ".join(PRECISIONS))


HeldOut = tuple[float, float, float]
"""Held-out (pair accuracy, mean margin, score-length correlation): the share of pairs ordered right, the mean of
r_chosen - r_rejected, and Pearson's r of every held-out text's score with its length in tokens (the length-bias
check: a reward model that rewards length, or the short fragments a truncated response is, shows it here)."""


@dataclass
class RewardModelResult:
    model_dir: str
    before: HeldOut  # held-out (pair accuracy, mean margin, score-length correlation) before training
    after: HeldOut
    steps: int
    seconds: float


def prepare_folder(settings: RewardModelSettings, resume: bool) -> None:
    """The run folder's rules, before any model loads (see the module docstring)."""
    out = settings.output_dir
    if resume:
        if not os.path.isfile(os.path.join(out, SETTINGS)):
            raise CheckpointError(f"cannot resume {out}: it holds no {SETTINGS} (not a reward-model run folder)")
        return
    present = sorted(os.listdir(out)) if os.path.isdir(out) else []
    if not present:
        return
    others = [name for name in present if name not in OWN and not name.startswith(".")]
    if not settings.overwrite or others:
        what = f"files that are not a reward-model run's ({', '.join(others[:3])})" if others else "a reward-model run"
        raise ConfigError(
            "output_dir",
            out,
            f"holds {what}; give another folder"
            + ("" if others else ", `--resume` it, or `--overwrite` (removes only what a reward-model run wrote)"),
        )
    for name in present:
        if name in OWN:
            storage.remove_tree(os.path.join(out, name), f"the old {name}")


def split_pairs(pairs: list[PreferencePair], held_out: int, seed: int) -> tuple[list, list]:
    """(training pairs, held-out pairs): the held-out pairs are the last `held_out` of a shuffle seeded with
    `seed`; a pair sharing a response (its `chosen` or `rejected`) or an origin (`PreferencePair.origin`) with a
    held-out pair never trains, so the held-out accuracy is measured on responses the model has not seen, nor the
    sentences they were cut from (`builtin:polarity-continuations` uses each response in several pairs, and
    `builtin:polarity-mixed` each corpus line whole and cut)."""
    if held_out >= len(pairs):
        raise ConfigError("held_out", held_out, f"must leave pairs to train on: the data holds {len(pairs)}")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    heldout = [pairs[i] for i in order[-held_out:]]
    unseen = {key for p in heldout for key in _keys(p)}
    train = [pairs[i] for i in order[:-held_out] if unseen.isdisjoint(_keys(pairs[i]))]
    if not train:
        raise ConfigError(
            "held_out", held_out, "leaves no pair to train on: every other pair shares a response with a held-out one"
        )
    return train, heldout


def _keys(pair: PreferencePair) -> set[str]:
    """What a held-out pair must not share with a training one: its responses (a text, or chat messages as JSON)
    and the texts it was made from (`PreferencePair.origin`)."""
    sides = (pair.chosen, pair.rejected)
    return {s if isinstance(s, str) else json.dumps(s, sort_keys=True) for s in sides} | set(pair.origin)


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The training pairs' order in `epoch`: a function of (seed, epoch) only, so a resume draws the same."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1)).tolist()


def load_model(settings: RewardModelSettings) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, bool]:
    """(model, tokenizer, decoder_head): the base as a one-label sequence classifier, LoRA-wrapped when asked."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_model_path(settings.base, "base")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(settings.seed)  # the new score head's initial weights
    model = load_whole(  # a causal LM's `score` head is new by design, its `lm_head` goes; nothing else may differ
        AutoModelForSequenceClassification.from_pretrained, path, "reward-model base", True, ("score.",), num_labels=1
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    decoder_head = hasattr(model, "score") and hasattr(model, "base_model")
    if settings.lora:
        from peft import LoraConfig, get_peft_model

        head = "score" if decoder_head else "classifier"
        lora = LoraConfig(
            task_type="SEQ_CLS",
            r=settings.lora_r,
            lora_alpha=2 * settings.lora_r,
            lora_dropout=0.0,
            target_modules="all-linear",
            exclude_modules=[head],
            modules_to_save=[head],
        )
        model = get_peft_model(model, lora)
    return model, tokenizer, decoder_head


class RewardModelTrainer:
    """Trains one reward model; `train()` runs it to the end (resuming the latest checkpoint with `resume`)."""

    def __init__(self, settings: RewardModelSettings, resume: bool = False, say: Callable[[str], None] = print):
        if resume:  # the run's own settings: the same run, continued
            with open(os.path.join(settings.output_dir, SETTINGS), encoding="utf-8") as fh:
                settings = RewardModelSettings(**{**json.load(fh), "output_dir": settings.output_dir})
        settings.check()
        check_writable(os.path.join(settings.output_dir, MODEL), "the reward model")  # before any model loads
        prepare_folder(settings, resume)
        self.settings, self.say, self.resume = settings, say, resume
        pairs = load_preference_pairs(settings.data)
        self.train_pairs, self.heldout_pairs = split_pairs(pairs, settings.held_out, settings.seed)
        self.dropped = len(pairs) - len(self.train_pairs) - len(self.heldout_pairs)
        self.model, self.tokenizer, self.decoder_head = load_model(settings)
        self.precision = choose_precision(settings.precision, "cpu")
        say(self.precision.reason)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=settings.learning_rate)
        self.steps_per_epoch = -(-len(self.train_pairs) // settings.batch_size)
        self.step = 0

    # ------------------------------------------------------------------ scores
    def scores(self, texts: list[str]) -> torch.Tensor:
        """(N,) scores of `texts`, right-padded and cut from the start to max_length tokens."""
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.settings.max_length
        )
        inner = getattr(self.model, "get_base_model", lambda: self.model)()  # a PeftModel's, LoRA layers in
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.precision.precision == "bf16"):
            scores = sequence_scores(inner, enc["input_ids"], enc["attention_mask"], self.decoder_head)
        return scores.float()

    def pair_scores(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen scores (N,), rejected scores (N,)), in one forward pass."""
        texts = [pair_texts(p, self.tokenizer) for p in pairs]
        scores = self.scores([c for c, _ in texts] + [r for _, r in texts])
        return scores[: len(pairs)], scores[len(pairs) :]

    @torch.no_grad()
    def evaluate(self) -> HeldOut:
        """Held-out (pair accuracy, mean margin, score-length correlation)."""
        self.model.eval()
        chosen, rejected = [], []
        for k in range(0, len(self.heldout_pairs), self.settings.batch_size):
            c, r = self.pair_scores(self.heldout_pairs[k : k + self.settings.batch_size])
            chosen.append(c)
            rejected.append(r)
        texts = [pair_texts(p, self.tokenizer) for p in self.heldout_pairs]
        lengths = self.token_counts([c for c, _ in texts] + [r for _, r in texts])  # (2N,): chosen, then rejected
        correlation = pearson_correlation(torch.cat(chosen + rejected), lengths)
        return (*pair_accuracy_and_margin(torch.cat(chosen), torch.cat(rejected)), correlation)

    def token_counts(self, texts: list[str]) -> torch.Tensor:
        """(N,) tokens of each text as the model reads it (cut to max_length)."""
        enc = self.tokenizer(texts, truncation=True, max_length=self.settings.max_length)
        return torch.tensor([len(ids) for ids in enc["input_ids"]], dtype=torch.float64)

    # ------------------------------------------------------------------ the run
    def train(self) -> RewardModelResult:
        out, s = self.settings.output_dir, self.settings
        with result_output(os.path.join(out, MODEL), "the reward model", "lmppo reward-model", run_dir=out):
            start = time.time()
            before = self._begin()
            total = s.epochs * self.steps_per_epoch
            loss_sum = 0.0
            while self.step < total:
                epoch, index = divmod(self.step, self.steps_per_epoch)
                order = epoch_order(len(self.train_pairs), s.seed, epoch)
                batch = [self.train_pairs[i] for i in order[index * s.batch_size : (index + 1) * s.batch_size]]
                self.model.train()
                chosen, rejected = self.pair_scores(batch)
                loss = bradley_terry_loss(chosen, rejected)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.optimizer.step()
                self.step += 1
                loss_sum += float(loss.detach())
                row: dict[str, float] = {"step": self.step, "epoch": epoch + 1, "loss": float(loss.detach())}
                if self.step % self.steps_per_epoch == 0 or self.step == total:
                    held = self.evaluate()
                    row.update(heldout_row(held))
                    self.say(
                        f"epoch {epoch + 1}/{s.epochs}: {describe(held)}, mean training loss "
                        f"{loss_sum / (index + 1):.4f}"
                    )
                    loss_sum = 0.0
                self._log(row)
                if self.step % s.checkpoint_every == 0 or self.step % self.steps_per_epoch == 0:
                    self._checkpoint()
            after = self.evaluate()
            model_dir = self._export(before, after)
            return RewardModelResult(model_dir, before, after, self.step, time.time() - start)

    def _begin(self) -> HeldOut:
        """A new run: its settings written and the held-out numbers before training. A resume: the latest complete
        checkpoint loaded, the metrics after it cut, the numbers before training read back."""
        out = self.settings.output_dir
        if not self.resume:
            storage.write_json(os.path.join(out, SETTINGS), dataclasses.asdict(self.settings), SETTINGS, indent=1)
            self.say(
                f"{len(self.train_pairs)} training pairs, {len(self.heldout_pairs)} held out"
                + (
                    f" ({self.dropped} more left out: they share a response or its source text with a held-out pair)"
                    if self.dropped
                    else ""
                )
            )
            before = self.evaluate()
            self._log({"step": 0, **heldout_row(before)})
            self.say(f"before training: {describe(before)}")
            return before
        path = latest_checkpoint(out)
        if path is not None:
            self._load(path)
        rows, _ = read_jsonl(os.path.join(out, METRICS)) if os.path.isfile(os.path.join(out, METRICS)) else ([], 0)
        kept = [r for r in rows if int(r.get("step", -1)) <= self.step]
        storage.write_text(os.path.join(out, METRICS), "".join(json.dumps(r) + "\n" for r in kept), METRICS)
        first = next((r for r in kept if r.get("step") == 0), None)
        if first is None:  # killed before its first row: measured again (nothing has trained yet)
            before = self.evaluate()
            self._log({"step": 0, **heldout_row(before)})
        else:
            before = (
                first["heldout/pair_accuracy"],
                first["heldout/margin"],
                first.get("heldout/length_correlation", float("nan")),
            )
        self.say(f"resuming {out} at step {self.step} of {self.settings.epochs * self.steps_per_epoch}")
        return before

    def _log(self, row: dict[str, float]) -> None:
        path = os.path.join(self.settings.output_dir, METRICS)
        storage.append_lines(path, [json.dumps(row)], METRICS)

    def _checkpoint(self) -> None:
        root = checkpoints_dir(self.settings.output_dir)
        final = os.path.join(root, checkpoint_name(self.step))
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        with storage.atomic_dir(final, f"the checkpoint of step {self.step}") as tmp:
            save_file({n: p.detach().cpu().contiguous() for n, p in named.items()}, os.path.join(tmp, TRAINED))
            torch.save(self.optimizer.state_dict(), os.path.join(tmp, OPTIMIZER))
            rng = RngState.capture()
            save_file({"torch_cpu": rng.torch_cpu}, os.path.join(tmp, "rng.safetensors"))
            storage.write_json(os.path.join(tmp, STATE), {"step": self.step, "python": rng.python}, STATE)
            write_manifest(tmp, self.step)
        prune_checkpoints(self.settings.output_dir, 2, final)

    def _load(self, path: str) -> None:
        trained = load_file(os.path.join(path, TRAINED))
        named = {n: p for n, p in self.model.named_parameters() if p.requires_grad}
        if set(trained) != set(named):
            raise CheckpointError(f"checkpoint {path}: its trained tensors are not this model's")
        with torch.no_grad():
            for name, tensor in trained.items():
                named[name].copy_(tensor)
        self.optimizer.load_state_dict(torch.load(os.path.join(path, OPTIMIZER), weights_only=True))
        with open(os.path.join(path, STATE), encoding="utf-8") as fh:
            state = json.load(fh)
        self.step = int(state["step"])
        RngState(load_file(os.path.join(path, "rng.safetensors"))["torch_cpu"], [], state["python"]).restore()

    def _export(self, before: HeldOut, after: HeldOut) -> str:
        """OUTPUT_DIR/model: the classifier (LoRA merged in) with its tokenizer and model card, published at once."""
        model = getattr(self.model, "merge_and_unload", lambda: self.model)()  # LoRA merged into the weights
        final = os.path.join(self.settings.output_dir, MODEL)
        with storage.atomic_dir(final, "the reward model") as tmp:
            getattr(model, "save_pretrained")(tmp, safe_serialization=True)  # a transformers model
            self.tokenizer.save_pretrained(tmp)
            storage.write_text(os.path.join(tmp, "README.md"), self.card(before, after), "the model card")
        self.say(
            f"wrote {final}: held-out pair accuracy {before[0]:.3f} -> {after[0]:.3f}, margin {before[1]:+.3f} -> "
            f"{after[1]:+.3f}, score-length correlation {before[2]:+.3f} -> {after[2]:+.3f}; use it with "
            f"reward.sources: [{{kind: model, path: {final}}}]"
        )
        return final

    def card(self, before: HeldOut, after: HeldOut) -> str:
        s = self.settings
        how = f"LoRA r={s.lora_r} (merged) and the score head" if s.lora else "every weight"
        return (
            "---\nlibrary_name: transformers\npipeline_tag: text-classification\ntags: [lmppo, reward-model]\n---\n\n"
            f"# Reward model\n\nA one-label sequence classifier trained by lmppo {lmppo_version()} (`lmppo "
            f"reward-model`) with the Bradley-Terry loss on preference pairs from `{s.data}`: "
            f"{len(self.train_pairs)} pairs trained on, {len(self.heldout_pairs)} held out. Started from "
            f"`{s.base}`; trained: {how}; {s.epochs} epochs of batches of {s.batch_size} pairs, learning "
            f"rate {s.learning_rate:g}, seed {s.seed}.\n\n| held out | pair accuracy | mean margin | score-length "
            "correlation |\n|---|---|---|---|\n"
            f"| before training | {before[0]:.3f} | {before[1]:+.3f} | {before[2]:+.3f} |\n"
            f"| after | {after[0]:.3f} | {after[1]:+.3f} | {after[2]:+.3f} |\n\n"
            "The score-length correlation is Pearson's r of each held-out text's score with its length in tokens: "
            "far from 0, the model rewards length (or shortness) and a policy trained on it can exploit that.\n\n"
            "The score of a text is the head's output at its last token (right padding). In lmppo:\n\n"
            f"```yaml\nreward:\n  sources:\n    - {{kind: model, path: {os.path.join(s.output_dir, MODEL)}}}\n```\n\n"
            "Elsewhere: `AutoModelForSequenceClassification.from_pretrained(folder)` (num_labels=1).\n"
        )


def heldout_row(held: HeldOut) -> dict[str, float]:
    """The held-out numbers as metrics.jsonl keys."""
    return dict(zip(("heldout/pair_accuracy", "heldout/margin", "heldout/length_correlation"), held))


def describe(held: HeldOut) -> str:
    """The held-out numbers as one phrase of the console report."""
    return f"held-out pair accuracy {held[0]:.3f}, margin {held[1]:+.3f}, score-length correlation {held[2]:+.3f}"


def train_reward_model(
    settings: Optional[RewardModelSettings] = None, resume: bool = False, say: Callable[[str], None] = print
) -> RewardModelResult:
    """Train (or, with `resume`, continue) a reward model; see the module docstring."""
    return RewardModelTrainer(settings or RewardModelSettings(), resume=resume, say=say).train()
