"""Scoring a batch of responses with the reward sources: each source called once on the batch, its outputs checked
and placed on the response tokens (`lmppo.rewards.placement`), summed with the sources' weights.

Design notes: docs/design.md, `lmppo.rewards.sources`."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from lmppo.errors import RewardError
from lmppo.rewards.placement import BadOutput, parse_output, place_one, token_char_offsets
from lmppo.rewards.sources import RewardSource, raised_text

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

ON_BAD_OUTPUT = ("error", "drop")


@dataclass
class RewardResult:
    token_scores: torch.Tensor  # (B, T) float, weighted sum over sources of placed scores; 0 where masked/invalid
    valid: torch.Tensor  # (B,) bool, False for samples some source gave a bad output (on_bad_output=drop)
    per_source: dict[str, torch.Tensor]  # name -> (B,) float, the source's unweighted total per response (0 if invalid)
    final_scores: torch.Tensor  # (B,) float, the weighted sum of the scalar outputs alone: the part of token_scores
    #                             that judges a response as a whole (on its last token); 0 where invalid
    num_invalid: int  # samples marked invalid
    problems: list[str] = field(default_factory=list)  # one line per bad output that was dropped


def score_rollout(
    sources: Sequence[RewardSource],
    prompts_text: Sequence[str],
    completions_text: Sequence[str],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer: PreTrainedTokenizerBase,
    on_bad_output: str = "error",
    terminated: torch.Tensor | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    columns: Sequence[dict[str, object]] | None = None,
) -> RewardResult:
    """Call every source on the batch, check and place its outputs, and sum them with the sources' weights.

    ``response_ids``: (B, T) long, right-padded; ``response_mask``: (B, T) bool, True on real response tokens
    (stop token included). ``terminated``: (B,) bool, the response ends with its stop token (that token is not in
    the completion text); None infers it per response by decoding. ``tokenizer``: the policy's (spans are mapped
    through it). With ``on_bad_output="error"`` a bad output raises RewardError naming the source, the sample
    and the value; with ``"drop"`` the sample is marked invalid (all its scores 0) and counted.
    ``prompt_ids``: each prompt's token ids without padding; needed by sources that read token ids
    (``wants_token_ids``, a reward model with ``input: tokens``). ``columns``: per response, its prompt's other
    columns (dicts; see ``lmppo.data.prompts.PromptSet.columns``), for sources that take them (``wants_columns``).
    """
    if on_bad_output not in ON_BAD_OUTPUT:
        raise ValueError(f"on_bad_output {on_bad_output!r}: must be one of {ON_BAD_OUTPUT}")
    mask = response_mask.bool()
    batch = ScoredBatch(
        prompts=list(prompts_text),
        completions=list(completions_text),
        ids=response_ids.detach().cpu(),
        lengths=mask.sum(dim=1).tolist(),
        width=mask.shape[1],
        prompt_ids=prompt_ids,
        columns=columns,
    )
    _check_batch(sources, batch)
    verdicts = Verdicts(len(batch.lengths), on_bad_output)
    offsets = SpanOffsets(tokenizer, batch, terminated)
    placed = [_score_source(source, batch, offsets, verdicts) for source in sources]
    return _weighted_sum(sources, placed, mask, verdicts, response_mask.device)


@dataclass
class ScoredBatch:
    """The batch as the sources see it (CPU): texts, token ids and lengths, the prompts' ids and columns."""

    prompts: list[str]  # B prompt texts
    completions: list[str]  # B completion texts
    ids: torch.Tensor  # (B, T) response token ids, right-padded
    lengths: list[int]  # B real response tokens (stop token included)
    width: int  # T
    prompt_ids: Sequence[Sequence[int]] | None
    columns: Sequence[dict[str, object]] | None


def _check_batch(sources: Sequence[RewardSource], batch: ScoredBatch) -> None:
    B = len(batch.lengths)
    if len(batch.prompts) != B or len(batch.completions) != B:
        raise ValueError(f"{len(batch.prompts)} prompts and {len(batch.completions)} completions for {B} responses")
    if batch.columns is not None and len(batch.columns) != B:
        raise ValueError(f"{len(batch.columns)} column rows for {B} responses")
    readers = [s.name for s in sources if s.wants_token_ids]
    if readers and (batch.prompt_ids is None or len(batch.prompt_ids) != B):
        raise ValueError(
            f"reward source `{readers[0]}` reads token ids: score_rollout needs the {B} prompts' ids (prompt_ids)"
        )


class Verdicts:
    """Which responses stay valid: a bad output raises RewardError (`on_bad_output: error`) or marks its response
    invalid, a failure of the whole call every response (`drop`), one problem line each."""

    def __init__(self, batch_size: int, on_bad_output: str):
        self.valid = [True] * batch_size
        self.problems: list[str] = []
        self.on_bad_output = on_bad_output

    def bad(self, source: RewardSource, i: int | None, msg: str, cause: BaseException | None = None) -> None:
        where = f"sample {i}" if i is not None else f"the whole batch of {len(self.valid)}"
        line = f"reward source `{source.name}`, {where}: {msg}"
        if self.on_bad_output == "error":
            raise RewardError(line) from cause
        self.problems.append(line)
        for j in [i] if i is not None else range(len(self.valid)):
            self.valid[j] = False


class SpanOffsets:
    """The character span of each response token, computed once per response, when a source returns spans."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, batch: ScoredBatch, terminated: torch.Tensor | None):
        self.tokenizer, self.batch, self.terminated = tokenizer, batch, terminated
        self.cache: dict[int, list[tuple[int, int]]] = {}

    def __call__(self, i: int) -> list[tuple[int, int]]:
        if i not in self.cache:
            b = self.batch
            has_stop = bool(self.terminated[i]) if self.terminated is not None else None
            try:
                self.cache[i] = token_char_offsets(
                    self.tokenizer, b.ids[i, : b.lengths[i]].tolist(), text=b.completions[i], has_stop=has_stop
                )
            except ValueError as err:  # the rollout decoded differently: not the source's fault
                raise RewardError(f"sample {i}: cannot map spans to tokens: {err}") from None
        return self.cache[i]


@dataclass
class PlacedScores:
    """One source's outputs on the batch: (B, T) placed on the tokens, and (B,) its scalar outputs (0 where it
    gave another form)."""

    rows: torch.Tensor
    scalar: torch.Tensor


def _score_source(source: RewardSource, batch: ScoredBatch, offsets: SpanOffsets, verdicts: Verdicts) -> PlacedScores:
    """Call `source` once on the batch, check its outputs and place each on its response's tokens."""
    B = len(batch.lengths)
    placed = PlacedScores(torch.zeros(B, batch.width, dtype=torch.float32), torch.zeros(B, dtype=torch.float32))
    outputs = _call_source(source, batch, verdicts)
    for i, out in enumerate(outputs or []):
        try:
            parsed = parse_output(out, batch.lengths[i], len(batch.completions[i]))
        except BadOutput as err:
            verdicts.bad(source, i, f"{err} (value {_short(out)})")
            continue
        off = offsets(i) if parsed[0] == "spans" and parsed[1] else None
        placed.rows[i] = place_one(parsed, batch.lengths[i], batch.width, off, source.span_placement)
        if parsed[0] == "scalar":
            placed.scalar[i] = parsed[1]
    return placed


def _source_inputs(source: RewardSource, batch: ScoredBatch) -> dict[str, object]:
    """The keyword arguments `source` asks for: token ids (prompt and response, or the response's), columns."""
    ids, lengths = batch.ids, batch.lengths
    extra: dict[str, object] = {}
    if source.wants_token_ids:
        assert batch.prompt_ids is not None, "checked by _check_batch"
        extra["token_ids"] = [list(batch.prompt_ids[i]) + ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
    elif source.wants_completion_ids:
        extra["completion_ids"] = [ids[i, : lengths[i]].tolist() for i in range(len(lengths))]
    if source.wants_columns and batch.columns is not None:
        extra["columns"] = [dict(row) for row in batch.columns]  # a copy: user code cannot change the data
    return extra


def _call_source(source: RewardSource, batch: ScoredBatch, verdicts: Verdicts) -> list[object] | None:
    """The source's B outputs, or None (every response judged by `verdicts`) when it raised or returned no list of
    B."""
    B = len(batch.lengths)
    try:
        outputs: object = source(list(batch.prompts), list(batch.completions), **_source_inputs(source, batch))
    except (Exception, SystemExit) as err:  # noqa: BLE001 - any failure of user code is reported, not re-thrown raw
        verdicts.bad(source, None, f"raised {raised_text(err)}", err)
        return None
    if isinstance(outputs, torch.Tensor) or type(outputs).__module__ == "numpy":
        outputs = outputs.tolist()  # type: ignore[attr-defined]
    if not isinstance(outputs, (list, tuple)) or len(outputs) != B:
        got = (
            f"{len(outputs)} outputs"
            if isinstance(outputs, (list, tuple))
            else f"a {type(outputs).__name__} ({_short(outputs)})"
        )
        verdicts.bad(source, None, f"returned {got}; expected a list of {B} (one per response)")
        return None
    return list(outputs)


def _weighted_sum(
    sources: Sequence[RewardSource],
    placed: Sequence[PlacedScores],
    mask: torch.Tensor,
    verdicts: Verdicts,
    device: torch.device,
) -> RewardResult:
    """The sources' placed scores summed with their weights, 0 past each response's end and on invalid rows."""
    B, T = mask.shape
    keep = torch.tensor(verdicts.valid, dtype=torch.bool)
    token_scores = torch.zeros(B, T, dtype=torch.float32)
    final_scores = torch.zeros(B, dtype=torch.float32)
    per_source = {}
    for source, p in zip(sources, placed):
        rows = p.rows * mask.cpu() * keep[:, None]
        token_scores += source.weight * rows
        final_scores += source.weight * p.scalar * keep
        per_source[source.name] = rows.sum(dim=1)
    if verdicts.problems:
        dropped = B - int(keep.sum())
        logger.warning("dropped %d of %d samples with bad reward outputs; first: %s", dropped, B, verdicts.problems[0])
    return RewardResult(
        token_scores=token_scores.to(device),
        valid=keep.to(device),
        per_source={k: v.to(device) for k, v in per_source.items()},
        final_scores=final_scores.to(device),
        num_invalid=B - int(keep.sum()),
        problems=verdicts.problems,
    )


def _short(x: object, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."
