"""`lmppo reward-model`: a reward model trained on preference pairs with the Bradley-Terry loss, on the run machinery
`lmppo train` uses.

A sequence-classification model (one label) is made from a causal LM or an existing classifier (`model.policy`),
trained whole or through LoRA adapters (the score head always trains) on the pairs of
`lmppo.data.preference_pairs`, scored as `reward.sources: [{kind: model}]` reads them
(`lmppo.rewards.model.sequence_scores`: the last real token of the right-padded text). The loss is TRL's
RewardTrainer's: -log sigmoid(r_chosen - r_rejected - margin) (the data's `margin` column, 0 without one), plus
`training.center_rewards_coefficient` x mean((r_chosen + r_rejected)^2). Held-out pairs (the last `data.holdout` of
a seeded shuffle) give the pair accuracy and the reward margin before training, after each epoch and at the end.

The settings are `lmppo.config.reward_model.RewardModelConfig` (a YAML file and dotted overrides, spelled as
`lmppo train`'s). The run is PPO's: accelerate picks the device (CUDA where present) and `precision` is chosen for it
(`lmppo.models.precision`); several processes each score their share of every batch and average their gradients
through the distribution strategy (`lmppo.distributed.strategy`); the run folder, its lock, ownership and
config.yaml are `lmppo.run.folder`'s; metrics.jsonl and `log.trackers` are `lmppo.training.metrics`'; checkpoints
are PPO's format (`lmppo.run.checkpoint`: written whole or not at all, verified by their manifest) and
`--resume OUTPUT_DIR` continues from the latest complete one to the same weights as a run never stopped (the data
order is a function of (seed, epoch), the loss has no randomness); the model is published at once as
OUTPUT_DIR/final/reward-model with its card.
"""

from __future__ import annotations

import json
import os
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

import torch

import lmppo.run.lock as lock
from lmppo.config import RewardModelConfig, load_root
from lmppo.core.bradley_terry import bradley_terry_loss, pair_accuracy_and_margin, pearson_correlation
from lmppo.data.preference_pairs import PreferencePair, load_preference_pairs, pair_texts
from lmppo.distributed.strategy import Strategy
from lmppo.errors import CheckpointError, ConfigError
from lmppo.models.files import load_whole
from lmppo.models.loading import resolve_model_path
from lmppo.models.precision import choose_precision
from lmppo.rewards.model import sequence_scores
from lmppo.run import storage
from lmppo.run.checkpoint import ModelParts, check_layout, frozen_fingerprint, read_checkpoint, save_checkpoint
from lmppo.run.config_file import redacted_config_dict
from lmppo.run.folder import prepare_output_dir, truncate_logs
from lmppo.run.layout import CONFIG, FINAL, METRICS, REWARD_MODEL
from lmppo.run.manifest import latest_checkpoint
from lmppo.run.metrics_file import read_jsonl
from lmppo.run.model_card import lmppo_version
from lmppo.run.ownership import publishing
from lmppo.run.state import RngState, TrainingState
from lmppo.training.metrics import MetricsLogger, make_trackers

if TYPE_CHECKING:
    from accelerate import Accelerator
    from transformers import PreTrainedTokenizerBase

RESUME_COMMAND = "lmppo reward-model --resume"
PREFIX = "reward_model."
"""The trained tensors' prefix in a checkpoint (PPO's are `actor.` and `critic.`)."""

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


def split_pairs(pairs: list[PreferencePair], held_out: int, seed: int) -> tuple[list, list]:
    """(training pairs, held-out pairs): the held-out pairs are the last `held_out` of a shuffle seeded with
    `seed`; a pair sharing a response (its `chosen` or `rejected`) or an origin (`PreferencePair.origin`) with a
    held-out pair never trains, so the held-out accuracy is measured on responses the model has not seen, nor the
    sentences they were cut from (`builtin:polarity-continuations` uses each response in several pairs, and
    `builtin:polarity-mixed` each corpus line whole and cut)."""
    if held_out >= len(pairs):
        raise ConfigError("data.holdout", held_out, f"must leave pairs to train on: the data holds {len(pairs)}")
    order = torch.randperm(len(pairs), generator=torch.Generator().manual_seed(seed)).tolist()
    heldout = [pairs[i] for i in order[-held_out:]]
    unseen = {key for p in heldout for key in _keys(p)}
    train = [pairs[i] for i in order[:-held_out] if unseen.isdisjoint(_keys(pairs[i]))]
    if not train:
        raise ConfigError(
            "data.holdout",
            held_out,
            "leaves no pair to train on: every other pair shares a response with a held-out one",
        )
    return train, heldout


def _keys(pair: PreferencePair) -> set[str]:
    """What a held-out pair must not share with a training one: its responses (a text, or chat messages as JSON)
    and the texts it was made from (`PreferencePair.origin`)."""
    sides = (pair.chosen, pair.rejected)
    return {s if isinstance(s, str) else json.dumps(s, sort_keys=True) for s in sides} | set(pair.origin)


def epoch_order(count: int, seed: int, epoch: int) -> list[int]:
    """The training pairs' order in `epoch`: a function of (seed, epoch) only, so a resume draws the same."""
    return torch.randperm(count, generator=torch.Generator().manual_seed(epoch_seed(seed, epoch))).tolist()


def load_model(cfg: RewardModelConfig) -> tuple[torch.nn.Module, PreTrainedTokenizerBase, bool]:
    """(model, tokenizer, decoder_head): `model.policy` as a one-label sequence classifier, LoRA-wrapped when asked."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = resolve_model_path(cfg.model.policy, "model.policy")
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side, tokenizer.truncation_side = "right", "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    torch.manual_seed(cfg.seed)  # the new score head's initial weights (and LoRA's)
    model = load_whole(  # a causal LM's `score` head is new by design, its `lm_head` goes; nothing else may differ
        AutoModelForSequenceClassification.from_pretrained, path, "reward-model base", True, ("score.",), num_labels=1
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    decoder_head = hasattr(model, "score") and hasattr(model, "base_model")
    if cfg.model.lora.enabled:
        from peft import LoraConfig, get_peft_model

        head = "score" if decoder_head else "classifier"
        lora = LoraConfig(
            task_type="SEQ_CLS",
            r=cfg.model.lora.r,
            lora_alpha=cfg.model.lora.alpha,  # type: ignore[arg-type]  # peft's hint says int; it divides by r
            lora_dropout=0.0,  # no randomness in the loss: a resume repeats the run exactly
            target_modules="all-linear",
            exclude_modules=[head],
            modules_to_save=[head],
        )
        model = get_peft_model(model, lora)
    return model, tokenizer, decoder_head


class RewardModelTrainer:
    """Trains one reward model; `train()` runs it to the end. `pairs`: preference rows (dicts in TRL's format, or a
    `datasets.Dataset`) instead of `data.pairs`. `RewardModelTrainer.resume(OUTPUT_DIR)` continues a stopped run."""

    def __init__(
        self,
        config: Optional[RewardModelConfig] = None,
        *,
        pairs: Optional[Sequence[object]] = None,
        say: Callable[[str], None] = print,
        resuming: bool = False,
    ):
        cfg = self.config = config if config is not None else RewardModelConfig()
        self.say, self.resuming = say, resuming
        loaded = load_preference_pairs(pairs if pairs is not None else cfg.data.pairs)
        self.train_pairs, self.heldout_pairs = split_pairs(loaded, cfg.data.holdout, cfg.seed)
        self.dropped = len(loaded) - len(self.train_pairs) - len(self.heldout_pairs)
        self.accelerator, self.strategy = start_processes(cfg)
        # `auto` becomes what this device runs faster; config.yaml keeps the resolved value (a resume computes alike)
        self.precision = choose_precision(cfg.precision, self.accelerator.device.type)
        cfg.precision = self.precision.precision
        self.main = self.accelerator.is_main_process
        if self.main:
            say(self.precision.reason)
        prepare_output_dir(cfg, self.main, resuming, [f"precision: {self.precision.reason}"], RESUME_COMMAND)
        if self.main:
            weakref.finalize(self, lock.release, cfg.output_dir)  # the run lock, also when this object is dropped
        self.logger: Optional[MetricsLogger] = None  # process 0 logs
        if self.main:
            trackers = make_trackers(cfg.log.trackers, cfg.output_dir, redacted_config_dict(cfg), _run_name(cfg))
            self.logger = MetricsLogger(cfg.output_dir, trackers, append=resuming)
        self.model, self.tokenizer, self.decoder_head = load_model(cfg)
        self.model.to(self.accelerator.device)
        self.trained = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trained, lr=cfg.training.learning_rate)
        self.steps_per_epoch = -(-len(self.train_pairs) // cfg.training.batch_size)
        self.step = 0
        self.frozen: Optional[str] = None  # the sha256 of the weights that do not train, hashed once

    @classmethod
    def resume(
        cls, output_dir: str, *, pairs: Optional[Sequence[object]] = None, say: Callable[[str], None] = print
    ) -> "RewardModelTrainer":
        """The run in `output_dir` with its own config (its config.yaml), ready to continue from its latest complete
        checkpoint; `pairs`: the rows it was started with through the API."""
        path = os.path.join(output_dir, CONFIG)
        if not os.path.isfile(path):
            raise CheckpointError(f"cannot resume {output_dir}: it holds no {CONFIG} (not a run folder)")
        try:
            cfg = load_root(RewardModelConfig, path, {"output_dir": output_dir})
        except ConfigError as err:
            raise CheckpointError(f"cannot resume {output_dir}: it is not a reward-model run ({err})") from None
        return cls(cfg, pairs=pairs, say=say, resuming=True)

    # ------------------------------------------------------------------ scores
    def scores(self, texts: list[str]) -> torch.Tensor:
        """(N,) scores of `texts`, right-padded and cut from the start to data.max_length tokens."""
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.config.data.max_length
        ).to(self.accelerator.device)
        inner = getattr(self.model, "get_base_model", lambda: self.model)()  # a PeftModel's, LoRA layers in
        device = self.accelerator.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.precision.precision == "bf16"):
            scores = sequence_scores(inner, enc["input_ids"], enc["attention_mask"], self.decoder_head)
        return scores.float()

    def pair_scores(self, pairs: list[PreferencePair]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen scores (N,), rejected scores (N,)), in one forward pass."""
        texts = [pair_texts(p, self.tokenizer) for p in pairs]
        scores = self.scores([c for c, _ in texts] + [r for _, r in texts])
        return scores[: len(pairs)], scores[len(pairs) :]

    @torch.no_grad()
    def evaluate(self) -> HeldOut:
        """Held-out (pair accuracy, mean margin, score-length correlation); every process scores them all."""
        self.model.eval()
        chosen, rejected = [], []
        for k in range(0, len(self.heldout_pairs), self.config.training.batch_size):
            c, r = self.pair_scores(self.heldout_pairs[k : k + self.config.training.batch_size])
            chosen.append(c.cpu())
            rejected.append(r.cpu())
        texts = [pair_texts(p, self.tokenizer) for p in self.heldout_pairs]
        lengths = self.token_counts([c for c, _ in texts] + [r for _, r in texts])  # (2N,): chosen, then rejected
        correlation = pearson_correlation(torch.cat(chosen + rejected), lengths)
        return (*pair_accuracy_and_margin(torch.cat(chosen), torch.cat(rejected)), correlation)

    def token_counts(self, texts: list[str]) -> torch.Tensor:
        """(N,) tokens of each text as the model reads it (cut to data.max_length)."""
        enc = self.tokenizer(texts, truncation=True, max_length=self.config.data.max_length)
        return torch.tensor([len(ids) for ids in enc["input_ids"]], dtype=torch.float64)

    def batch_loss(self, batch: list[PreferencePair]) -> tuple[torch.Tensor, float]:
        """(this process's loss to back-propagate, the batch's loss over every process): each process scores its
        share of `batch` (pairs rank, rank + W, ...), its mean loss weighted by that share, so the gradients'
        mean over the processes is the whole batch's."""
        acc = self.accelerator
        mine = batch[acc.process_index :: acc.num_processes]
        if not mine:  # a last batch smaller than the processes: this one adds a zero gradient
            return torch.zeros((), device=acc.device), self.strategy.process_mean(0.0)
        chosen, rejected = self.pair_scores(mine)
        margins = [p.margin for p in mine]
        margin = None if all(m is None for m in margins) else torch.tensor([m or 0.0 for m in margins])
        loss = bradley_terry_loss(
            chosen,
            rejected,
            margin if margin is None else margin.to(chosen.device),
            self.config.training.center_rewards_coefficient,
        )
        loss = loss * (len(mine) * acc.num_processes / len(batch))  # x 1.0 with one process
        return loss, self.strategy.process_mean(float(loss.detach()))

    # ------------------------------------------------------------------ the run
    def train(self) -> RewardModelResult:
        cfg, t = self.config, self.config.training
        try:
            start = time.time()
            before = self._begin()
            total = t.epochs * self.steps_per_epoch
            loss_sum = 0.0
            while self.step < total:
                epoch, index = divmod(self.step, self.steps_per_epoch)
                order = epoch_order(len(self.train_pairs), cfg.seed, epoch)
                batch = [self.train_pairs[i] for i in order[index * t.batch_size : (index + 1) * t.batch_size]]
                self.model.train()
                loss, batch_loss = self.batch_loss(batch)
                self.optimizer.zero_grad(set_to_none=True)
                if loss.requires_grad:
                    loss.backward()
                self.strategy.mean_gradients(self.trained)
                self.optimizer.step()
                self.step += 1
                loss_sum += batch_loss
                row: dict[str, float] = {"iteration": self.step, "epoch": epoch + 1, "loss": batch_loss}
                if self.step % self.steps_per_epoch == 0 or self.step == total:
                    held = self.evaluate()
                    row.update(heldout_row(held))
                    self._say(
                        f"epoch {epoch + 1}/{t.epochs}: {describe(held)}, mean training loss "
                        f"{loss_sum / (index + 1):.4f}"
                    )
                    loss_sum = 0.0
                self._log(row)
                if self.step % cfg.checkpoint.every == 0 or self.step % self.steps_per_epoch == 0:
                    self._checkpoint(time.time() - start)
            after = self.evaluate()
            model_dir = self._export(before, after)
            return RewardModelResult(model_dir, before, after, self.step, time.time() - start)
        finally:
            if self.logger is not None:
                self.logger.close()
            if self.main:
                lock.release(cfg.output_dir)

    def _say(self, line: str) -> None:
        if self.main:
            self.say(line)

    def _begin(self) -> HeldOut:
        """A new run: the held-out numbers before training. A resume: the latest complete checkpoint loaded, the
        metrics after it cut, the numbers before training read back."""
        out = self.config.output_dir
        if not self.resuming:
            self._say(
                f"{len(self.train_pairs)} training pairs, {len(self.heldout_pairs)} held out"
                + (
                    f" ({self.dropped} more left out: they share a response or its source text with a held-out pair)"
                    if self.dropped
                    else ""
                )
            )
            before = self.evaluate()
            self._log({"iteration": 0, **heldout_row(before)})
            self._say(f"before training: {describe(before)}")
            return before
        path = latest_checkpoint(out)
        if path is not None:
            self._load(path)
        if self.main:
            truncate_logs(out, self.step, 0)
        rows, _ = read_jsonl(os.path.join(out, METRICS)) if os.path.isfile(os.path.join(out, METRICS)) else ([], 0)
        first = next((r for r in rows if r.get("iteration") == 0 and "heldout/pair_accuracy" in r), None)
        if first is None:  # killed before its first row: measured again (nothing has trained yet)
            before = self.evaluate()
            self._log({"iteration": 0, **heldout_row(before)})
        else:
            before = (
                first["heldout/pair_accuracy"],
                first["heldout/margin"],
                first.get("heldout/length_correlation", float("nan")),
            )
        self._say(f"resuming {out} at step {self.step} of {self.config.training.epochs * self.steps_per_epoch}")
        return before

    def _log(self, row: dict[str, float]) -> None:
        if self.logger is not None:
            self.logger.log(row, int(row["iteration"]))

    def _parts(self) -> ModelParts:
        return ModelParts({PREFIX: self.model}, self.model, self.strategy, self.accelerator, False)

    def _fingerprint(self) -> str:
        if self.frozen is None:  # frozen weights never change: hashed once
            self.frozen = frozen_fingerprint(self._parts().modules)
        return self.frozen

    def _checkpoint(self, seconds: float) -> None:
        """PPO's checkpoint format (`lmppo.run.checkpoint`); the parts a reward model lacks (KL controller, score
        moments, LR schedule, reference) are empty, and the data order is a function of (seed, epoch)."""
        epoch = self.step // self.steps_per_epoch
        state = TrainingState(
            iteration=self.step,
            episode=self._pairs_seen(),
            train_seconds=seconds,
            nonfinite_in_a_row=0,
            stream={"epoch": epoch, "steps_per_epoch": self.steps_per_epoch},
            kl_controller={},
            score_moments={},
            scheduler={},
            reference={},
            update_generator=torch.Generator().manual_seed(epoch_seed(self.config.seed, epoch)).get_state(),
            rng=RngState.capture(),
            frozen_fingerprint=self._fingerprint(),
            optimizer=self.optimizer.state_dict(),
            config=redacted_config_dict(self.config),
        )
        save_checkpoint(self.config.output_dir, state, self._parts(), self.config.checkpoint.keep_last)

    def _pairs_seen(self) -> int:
        """Training pairs trained on by step `self.step` (every process together)."""
        epochs, index = divmod(self.step, self.steps_per_epoch)
        return epochs * len(self.train_pairs) + min(index * self.config.training.batch_size, len(self.train_pairs))

    def _load(self, path: str) -> None:
        from lmppo.run.checkpoint import read_state_file

        saved = read_state_file(path)
        if saved.get("frozen_fingerprint") != self._fingerprint():
            raise CheckpointError(
                f"checkpoint {path}: the frozen weights (the LoRA base model) differ from the ones it was trained "
                "with; resume from the same model.policy"
            )
        check_layout(saved, self.accelerator.num_processes, 0, path)
        state = read_checkpoint(path, self._parts())  # the trained tensors loaded in place
        if state.optimizer is not None:
            self.optimizer.load_state_dict(state.optimizer)
        self.step = state.iteration
        state.rng.restore()

    def _export(self, before: HeldOut, after: HeldOut) -> str:
        """OUTPUT_DIR/final/reward-model: the classifier (LoRA merged in) with its tokenizer and model card, published
        at once (process 0 writes it)."""
        final = os.path.join(self.config.output_dir, FINAL, REWARD_MODEL)
        self.accelerator.wait_for_everyone()
        if not self.main:
            return final
        model = getattr(self.model, "merge_and_unload", lambda: self.model)()  # LoRA merged into the weights
        os.makedirs(os.path.dirname(final), exist_ok=True)
        with storage.atomic_dir(final, "the reward model", before_publish=publishing) as tmp:
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
        cfg = self.config
        lora = cfg.model.lora
        how = f"LoRA r={lora.r}, alpha={lora.alpha:g} (merged) and the score head" if lora.enabled else "every weight"
        extras = "".join(
            f", {what}"
            for what, on in (
                ("the data's margins", any(p.margin is not None for p in self.train_pairs)),
                (
                    f"center_rewards_coefficient {cfg.training.center_rewards_coefficient:g}",
                    cfg.training.center_rewards_coefficient > 0,
                ),
            )
            if on
        )
        return (
            "---\nlibrary_name: transformers\npipeline_tag: text-classification\ntags: [lmppo, reward-model]\n---\n\n"
            f"# Reward model\n\nA one-label sequence classifier trained by lmppo {lmppo_version()} (`lmppo "
            f"reward-model`) with the Bradley-Terry loss{extras} on preference pairs from `{cfg.data.pairs}`: "
            f"{len(self.train_pairs)} pairs trained on, {len(self.heldout_pairs)} held out. Started from "
            f"`{cfg.model.policy}`; trained: {how}; {cfg.training.epochs} epochs of batches of "
            f"{cfg.training.batch_size} pairs, learning rate {cfg.training.learning_rate:g}, seed {cfg.seed}.\n\n"
            "| held out | pair accuracy | mean margin | score-length correlation |\n|---|---|---|---|\n"
            f"| before training | {before[0]:.3f} | {before[1]:+.3f} | {before[2]:+.3f} |\n"
            f"| after | {after[0]:.3f} | {after[1]:+.3f} | {after[2]:+.3f} |\n\n"
            "The score-length correlation is Pearson's r of each held-out text's score with its length in tokens: "
            "far from 0, the model rewards length (or shortness) and a policy trained on it can exploit that.\n\n"
            "The score of a text is the head's output at its last token (right padding). In lmppo:\n\n"
            f"```yaml\nreward:\n  sources:\n    - {{kind: model, path: "
            f"{os.path.join(cfg.output_dir, FINAL, REWARD_MODEL)}}}\n```\n\n"
            "Elsewhere: `AutoModelForSequenceClassification.from_pretrained(folder)` (num_labels=1).\n"
        )


def start_processes(cfg: RewardModelConfig) -> tuple[Accelerator, Strategy]:
    """(accelerator, strategy) as `lmppo train` starts them: accelerate picks the device (`device`), one process or
    DDP (DeepSpeed is PPO's alone: a reward model of this size needs no sharding)."""
    from accelerate import Accelerator

    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "no CUDA GPU is visible to this process; use `auto` or `cpu`")
    accelerator = Accelerator(cpu=cfg.device == "cpu")
    return accelerator, Strategy(accelerator)


def _run_name(cfg: RewardModelConfig) -> str:
    return os.path.basename(os.path.abspath(cfg.output_dir))


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of the training pairs' order in `epoch`."""
    return seed * 1_000_003 + epoch + 1


def heldout_row(held: HeldOut) -> dict[str, float]:
    """The held-out numbers as metrics.jsonl keys."""
    return dict(zip(("heldout/pair_accuracy", "heldout/margin", "heldout/length_correlation"), held))


def describe(held: HeldOut) -> str:
    """The held-out numbers as one phrase of the console report."""
    return f"held-out pair accuracy {held[0]:.3f}, margin {held[1]:+.3f}, score-length correlation {held[2]:+.3f}"


def train_reward_model(
    config: Optional[RewardModelConfig] = None,
    *,
    pairs: Optional[Sequence[object]] = None,
    say: Callable[[str], None] = print,
) -> RewardModelResult:
    """Train a reward model (see the module docstring): `lmppo reward-model` from Python.

    from lmppo import RewardModelConfig, train_reward_model
    cfg = RewardModelConfig(output_dir="runs/rm")
    cfg.training.center_rewards_coefficient = 0.01
    result = train_reward_model(cfg, pairs=[{"chosen": "...", "rejected": "...", "margin": 1.0}, ...])
    result.model_dir  # OUTPUT_DIR/final/reward-model, what reward.sources [{kind: model}] takes"""
    return RewardModelTrainer(config, pairs=pairs, say=say).train()
