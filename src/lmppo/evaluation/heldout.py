"""A policy's responses to held-out prompts, scored and measured against a reference: the building block of
`lmppo eval`, the end-of-run summary and evaluation during training (`log.eval_every`).

``sample_and_score`` takes the run's road (`lmppo.episodes.road`: the run's sampling engine at its temperature and
precision, its reward sources) for one response per prompt, on evaluation's own random streams, and, given the
reference's next-token logits, measures the KL (k1 and k3 of the sampled tokens, and the exact KL over the
vocabulary, each summed per response). What evaluation adds is only its own choices (`EvalChoices`, which prompts,
which reference); log-probabilities come from `models.policy_forward`, the KL from `core.kl`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

import torch
from torch import nn

from lmppo.core.kl import KL_ESTIMATORS, exact_kl
from lmppo.core.logprobs import selective_log_softmax
from lmppo.core.masking import masked_sum
from lmppo.core.rewards import penalize_truncated
from lmppo.episodes.road import EpisodePrompts, ResponseNumbers, Road
from lmppo.errors import LmppoError
from lmppo.models.loading import policy_forward
from lmppo.sampling.engines import PromptBatch
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed

if TYPE_CHECKING:
    from lmppo.config import Config

EVAL_STREAM = 1 << 40
"""The `iteration` argument of `sampling.response_seed` for evaluation samples: never a training iteration, so
evaluation draws its own random streams (response i of a run with seed s always uses response_seed(s, EVAL_STREAM,
i))."""

RefLogits = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(input_ids (B, P + T), attention_mask (B, P + T), prompt length P) -> (B, T, V) the reference's next-token
logits at the response positions, divided by the sampling temperature."""


# ----------------------------------------------------------------------------- sampling and scoring


@dataclass
class PolicyEval:
    """One policy's responses to a prompt set, with their scores and (optionally) their KL to a reference."""

    prompts: list[str]  # N prompt texts, as the policy saw them
    responses: list[str]  # N completions (no stop token, no padding)
    scores: dict[str, torch.Tensor]  # source name -> (N,) unweighted score of each response
    total: (
        torch.Tensor
    )  # (N,) weighted sum of the sources, with the run's truncation penalty: the training score before normalisation
    lengths: torch.Tensor  # (N,) response tokens, stop token included
    terminated: torch.Tensor  # (N,) bool, the response ended with the stop token
    kl_k1: Optional[torch.Tensor] = None  # (N,) sum over the response's tokens of log pi - log pi_ref (k1)
    kl_k3: Optional[torch.Tensor] = None  # (N,) same with the k3 estimator; None when no reference was given
    kl_exact: Optional[torch.Tensor] = None  # (N,) sum over the response's states of KL(pi || pi_ref), whole vocabulary
    source_weights: dict[str, float] = field(default_factory=dict)

    def means(self) -> dict[str, Optional[float]]:
        """`score`, `reward/<name>`, `kl`, `kl_k3`, `kl_exact`, `length`, `terminated_frac`: means over the
        responses."""
        out: dict[str, Optional[float]] = {"score": _mean(self.total)}
        out.update({f"reward/{name}": _mean(v) for name, v in self.scores.items()})
        out["kl"] = _mean(self.kl_k1) if self.kl_k1 is not None else None
        out["kl_k3"] = _mean(self.kl_k3) if self.kl_k3 is not None else None
        out["kl_exact"] = _mean(self.kl_exact) if self.kl_exact is not None else None
        out["length"] = _mean(self.lengths.float())
        out["terminated_frac"] = _mean(self.terminated.float())
        return out


def _mean(x: torch.Tensor) -> float:
    return float(x.float().mean()) if x.numel() else float("nan")


def win_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of pairs where `a` beats `b`, ties counted half: mean(1[a > b] + 0.5 * 1[a == b]).

    Naive equivalent: ``sum(1 if x > y else 0.5 if x == y else 0 for x, y in zip(a, b)) / len(a)``."""
    if a.shape != b.shape or a.numel() == 0:
        raise ValueError(
            f"win_rate needs two non-empty score vectors of one shape, got {tuple(a.shape)} and {tuple(b.shape)}"
        )
    return float(((a > b).float() + 0.5 * (a == b).float()).mean())


@dataclass
class EvalPrompts:
    """The prompts an evaluation samples (each repeated once per sample: `repeat_prompts`)."""

    ids: Sequence[Sequence[int]]  # N prompt token-id lists, no padding
    texts: Sequence[str]  # N prompt texts, as the policy saw them
    columns: Optional[Sequence[dict[str, object]]] = None  # N dicts, the records' other fields; None: none

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.texts):
            raise ValueError(f"{len(self.ids)} prompt id lists but {len(self.texts)} prompt texts")


@dataclass(frozen=True)
class EvalChoices:
    """What an evaluation chooses on the run's road: its random streams and how many prompts go in one pass."""

    seed: int  # response i draws response_seed(seed, EVAL_STREAM, first_position + i); a global-RNG engine seed + chunk
    batch_size: int = 16  # prompts per sampling and KL pass
    first_position: int = 0
    truncation_penalty: Optional[float] = None  # reward.penalty where reward.truncation is `penalty`, else None
    penalty_mode: str = "replace"  # reward.penalty_mode

    @classmethod
    def of_run(cls, cfg: Config, seed: int) -> EvalChoices:
        """The run's choices: its no-grad batch size and its truncation penalty, so the held-out `score` is the
        training score (before normalisation) that a cut response gets in training."""
        r = cfg.reward
        penalty = float(r.penalty) if r.truncation == "penalty" else None
        return cls(
            seed=seed, batch_size=cfg.no_grad_batch_size, truncation_penalty=penalty, penalty_mode=r.penalty_mode
        )


@contextmanager
def own_random_stream(seed: int, device: torch.device) -> Iterator[None]:
    """The global torch RNG seeded with `seed` inside the block and restored after: an engine that draws from it
    (`hf`) samples evaluation's own stream, and training's draws are untouched."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@dataclass
class ScoredChunk:
    """One pass of an evaluation: per-response numbers, what a table shows, and the tokens the KL is measured on."""

    numbers: ResponseNumbers
    shown: list[str]  # N responses (a multi-turn episode: its transcript)
    prompt_ids: torch.Tensor  # (N, P) left-padded prompts (an episode: its opening)
    prompt_mask: torch.Tensor  # (N, P) bool
    response_ids: torch.Tensor  # (N, T) right-padded responses (an episode: all its tokens after the opening)
    response_mask: torch.Tensor  # (N, T) bool, real tokens
    policy_mask: torch.Tensor  # (N, T) bool, the policy's own tokens (what lengths and the KL count)


def sample_and_score(
    road: Road,
    policy: nn.Module,
    prompts: EvalPrompts,
    choices: EvalChoices,
    reference_logits: Optional[RefLogits] = None,
) -> PolicyEval:
    """One response per prompt from `policy` on the run's road (its engine, at its temperature and precision),
    scored by the road's sources, and, given `reference_logits`, its KL to the reference per response: k1 and k3 of
    the sampled tokens, and the exact KL of each next-token distribution over the vocabulary, summed over the
    response's states (what k1 and k3 estimate, without their sampling noise).

    Response i draws from its own random stream `response_seed(seed, EVAL_STREAM, first_position + i)`, so two
    policies given the same seed and prompts are compared on common random numbers; an engine that draws from the
    global RNG runs under `torch.manual_seed(seed + chunk)` (the global RNG is restored after).
    A road whose producer plays multi-turn episodes (an environment) gives one episode per prompt: the sources score
    the last turn, the source `environment` the turns (`reward/environment`: the sum of the environment's turn
    rewards, in `total` with its weight), lengths and KL count the policy's tokens, `responses` are the transcripts."""
    device = next(policy.parameters()).device
    tokenizer = road.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    chunks: list[ScoredChunk] = []
    kls: list[ResponseKL] = []
    for chunk, start in enumerate(range(0, len(prompts.ids), choices.batch_size)):
        batch = _eval_batch(prompts, start, choices, pad_id, device)
        with own_random_stream(choices.seed + chunk, device):
            part = _sample_chunk(road, policy, batch)
        chunks.append(part)
        if reference_logits is not None:
            kls.append(response_kl(road, policy, part, reference_logits))
    n = ResponseNumbers.concat([c.numbers for c in chunks])
    total = n.total
    if choices.truncation_penalty is not None:  # training's EOS trick, on each response's total (one "token")
        total = penalize_truncated(
            total[:, None],
            torch.ones_like(total[:, None], dtype=torch.bool),
            n.truncated,
            choices.truncation_penalty,
            choices.penalty_mode,
        )[:, 0]
    kl = ResponseKL.concat(kls) if reference_logits is not None else None
    weights = {s.name: float(s.weight) for s in road.sources}
    return PolicyEval(
        prompts=list(prompts.texts),
        responses=[text for c in chunks for text in c.shown],
        scores=n.per_source,
        total=total,
        lengths=n.lengths,
        terminated=n.terminated,
        kl_k1=kl.k1 if kl is not None else None,
        kl_k3=kl.k3 if kl is not None else None,
        kl_exact=kl.exact if kl is not None else None,
        source_weights=weights,
    )


def _sample_chunk(road: Road, policy: nn.Module, batch: EpisodePrompts) -> ScoredChunk:
    scored = road.run(policy, batch)
    e = scored.episodes
    p = e.prompts.batch  # (an episode's opening)
    return ScoredChunk(scored.numbers, e.side.shown, p.ids, p.mask, e.response_ids, e.response_mask, e.policy_mask)


def _eval_batch(
    prompts: EvalPrompts, start: int, choices: EvalChoices, pad_id: int, device: torch.device
) -> EpisodePrompts:
    stop = min(start + choices.batch_size, len(prompts.ids))
    token_lists = [list(ids) for ids in prompts.ids[start:stop]]
    ids, mask = left_pad(token_lists, pad_id)
    first = choices.first_position + start
    seeds = [response_seed(choices.seed, EVAL_STREAM, p) for p in range(first, first + len(token_lists))]
    batch = PromptBatch(ids=ids.to(device), mask=mask.to(device), token_lists=token_lists, seeds=seeds)
    columns = [dict(c) for c in prompts.columns[start:stop]] if prompts.columns else None
    return EpisodePrompts(batch, list(prompts.texts[start:stop]), columns)


@dataclass
class ResponseKL:
    """Per response, its KL to a reference summed over its tokens (N responses)."""

    k1: torch.Tensor  # (N,) sum of log pi - log pi_ref of the sampled tokens
    k3: torch.Tensor  # (N,) the same with the k3 estimator
    exact: torch.Tensor  # (N,) sum over the response's states of KL(pi || pi_ref) over the whole vocabulary

    @classmethod
    def concat(cls, parts: Sequence[ResponseKL]) -> ResponseKL:
        def cat(xs: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(xs) if xs else torch.zeros(0)

        return cls(cat([p.k1 for p in parts]), cat([p.k3 for p in parts]), cat([p.exact for p in parts]))


def response_kl(road: Road, policy: nn.Module, part: ScoredChunk, reference_logits: RefLogits) -> ResponseKL:
    """The KL of a pass's responses from `policy` to the reference, summed over the policy's tokens, in the road's
    precision."""
    resp, counted = part.response_ids, part.policy_mask
    P = part.prompt_ids.shape[1]
    input_ids = torch.cat([part.prompt_ids, resp], 1)  # (N, P + T)
    attention = torch.cat([part.prompt_mask, part.response_mask], 1)
    with torch.inference_mode(), road.precision():
        logits = policy_forward(policy, input_ids, attention, P, road.temperature).logits  # (B, T, V)
        ref_logits = reference_logits(input_ids, attention, P)  # (B, T, V)
    logprobs, ref = selective_log_softmax(logits, resp), selective_log_softmax(ref_logits, resp)
    return ResponseKL(
        k1=masked_sum(KL_ESTIMATORS["k1"](logprobs, ref), counted, dim=1).float().cpu(),
        k3=masked_sum(KL_ESTIMATORS["k3"](logprobs, ref), counted, dim=1).float().cpu(),
        exact=masked_sum(exact_kl(logits, ref_logits, chunk_size=64), counted, dim=1).float().cpu(),
    )


def repeat_prompts(ids: Sequence[Sequence[int]], texts: Sequence[str], k: int) -> tuple[list[list[int]], list[str]]:
    """Each prompt `k` times in a row (response i then has its own random stream: see `sample_and_score`)."""
    if k < 1:
        raise LmppoError(f"samples per prompt = {k}: must be >= 1")
    return [list(x) for x in ids for _ in range(k)], [t for t in texts for _ in range(k)]


def repeat_columns(columns: Sequence[dict[str, object]], k: int) -> Optional[list[dict[str, object]]]:
    """The prompts' columns repeated like `repeat_prompts` repeats the prompts; None when there are none."""
    return [c for c in columns for _ in range(k)] if columns else None


def compare(trained: PolicyEval, start: PolicyEval) -> dict[str, float]:
    """Win rate of `trained` over `start` by every reward source (prompt by prompt, ties counted half)."""
    return {name: win_rate(trained.scores[name], start.scores[name]) for name in trained.scores if name in start.scores}
