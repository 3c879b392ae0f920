"""A policy's responses to held-out prompts, scored and measured against a reference: the building block of
`lmppo eval`, the end-of-run summary and evaluation during training (`log.eval_every`).

``sample_and_score`` samples one response per prompt by pure sampling at the training temperature, scores it
with every reward source (the prompts' columns included) and, given the reference's next-token logits, measures
the KL (k1 and k3 of the sampled tokens, and the exact KL over the vocabulary, each summed per response).
Nothing here re-implements the trainer's pieces: sampling is `lmppo.sampling.native.sample_native` (or `rollout`'s HF
backend), log-probabilities come from `models.policy_forward`, the KL from `core.kl`, scores from
`rewards.score_rollout`.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from lmppo.core.kl import KL_ESTIMATORS, exact_kl
from lmppo.core.logprobs import selective_log_softmax
from lmppo.core.masking import action_mask, masked_sum
from lmppo.environments.episodes import ENDED_BY_ENVIRONMENT, EpisodePlayer, transcript_text
from lmppo.errors import LmppoError
from lmppo.models.loading import policy_forward
from lmppo.rewards import decode_completion, score_rollout
from lmppo.sampling.hf import left_pad, pure_sampling_config, sample_responses
from lmppo.sampling.native import response_seed, sample_native
from lmppo.sampling.turns import CachedTurns

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
    total: torch.Tensor  # (N,) weighted sum of the sources: the training score before normalisation/truncation policy
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


def sample_and_score(
    policy: nn.Module,
    prompt_ids: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    *,
    tokenizer: Any,
    sources: Sequence[Any],
    temperature: float,
    max_new_tokens: int,
    stop_ids: torch.Tensor,
    seed: int,
    backend: str = "native",
    batch_size: int = 16,
    reference_logits: Optional[RefLogits] = None,
    autocast: Callable[[], Any] = nullcontext,
    first_position: int = 0,
    columns: Optional[Sequence[dict]] = None,
    episodes: Optional[EpisodePlayer] = None,
) -> PolicyEval:
    """Sample one response per prompt from `policy` by pure sampling at `temperature`, score it with every reward
    source, and, given `reference_logits`, measure its KL to the reference per response: k1 and k3 of the sampled
    tokens, and the exact KL of each next-token distribution over the vocabulary, summed over the response's
    states (what k1 and k3 estimate, without their sampling noise).

    Response i draws from its own random stream `response_seed(seed, EVAL_STREAM, first_position + i)` (backend
    `native`), so two policies given the same seed and prompts are compared on common random numbers. With backend
    `hf`, transformers' generate runs under `torch.manual_seed(seed + chunk)` (the global RNG is restored after).
    `autocast` is the precision context of the log-probability passes (as in training); sampling runs outside it.
    `columns`: per prompt, its record's other fields, for reward functions that take them by name.
    `episodes`: play one multi-turn episode per prompt with this environment instead (native engine, the KV cache
    kept across turns): the sources score the last turn, `reward/environment` is the sum of the environment's turn
    rewards (in `total` with weight 1), lengths and KL count the policy's tokens, `responses` are the transcripts.
    """

    if len(prompt_ids) != len(prompt_texts):
        raise ValueError(f"{len(prompt_ids)} prompt id lists but {len(prompt_texts)} prompt texts")
    device = next(policy.parameters()).device
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stop_ids = stop_ids.to(device)
    responses: list[str] = []
    per_source: dict[str, list[torch.Tensor]] = {}
    totals, lengths, terminated_all, k1_all, k3_all, exact_all = [], [], [], [], [], []
    for chunk, start in enumerate(range(0, len(prompt_ids), batch_size)):
        ids_list = prompt_ids[start : start + batch_size]
        texts = list(prompt_texts[start : start + batch_size])
        p_ids, p_mask = left_pad(ids_list, pad_id)
        p_ids, p_mask = p_ids.to(device), p_mask.to(device)
        positions = range(first_position + start, first_position + start + len(ids_list))
        chunk_columns = list(columns[start : start + batch_size]) if columns else None
        env_total = None
        if episodes is None:
            resp, resp_mask, terminated, _ = _sample(
                policy, p_ids, p_mask, temperature, max_new_tokens, stop_ids, pad_id, backend, seed, chunk, positions
            )
            trained = resp_mask
            completions = [
                decode_completion(tokenizer, (r[m][:-1] if t else r[m]).tolist())
                for r, m, t in zip(resp, resp_mask, terminated)
            ]
            shown, scored_ids, scored_mask = completions, resp, resp_mask
        else:
            sampler = CachedTurns(policy, temperature, max_new_tokens, stop_ids, pad_id)
            played = episodes.play(
                sampler,
                ids_list,
                [{"prompt": t, **(c or {})} for t, c in zip(texts, chunk_columns or [{}] * len(texts))],
                list(positions),
                [response_seed(seed, EVAL_STREAM, p) for p in positions],
            )
            p_ids, p_mask = (x.to(device) for x in left_pad([e.prompt for e in played], pad_id))
            resp, resp_mask, trained, terminated = _episode_tensors(played, pad_id, device)
            completions = [e.last_turn for e in played]
            shown = [transcript_text(e.transcript) for e in played]
            last = [e.tokens[e.turn_starts[-1] : e.turn_ends[-1] + 1] for e in played]
            scored_ids, scored_mask = (x.to(device) for x in _right_pad(last, pad_id))
            env_total = torch.tensor([sum(e.turn_rewards) for e in played])
        result = score_rollout(
            sources,
            texts,
            completions,
            scored_ids.cpu(),
            scored_mask.cpu(),
            tokenizer,
            "error",
            terminated=terminated.cpu() if episodes is None else None,
            prompt_ids=ids_list,
            columns=chunk_columns,
        )
        for name, values in result.per_source.items():
            per_source.setdefault(name, []).append(values.float().cpu())
        total = result.token_scores.sum(1).float().cpu()
        if env_total is not None:
            per_source.setdefault("environment", []).append(env_total)
            total = total + env_total
        totals.append(total)
        lengths.append(trained.sum(1).cpu())
        terminated_all.append(terminated.cpu())
        responses += shown
        if reference_logits is not None:
            P = p_ids.shape[1]
            input_ids, attention = torch.cat([p_ids, resp], 1), torch.cat([p_mask, resp_mask], 1)
            with torch.inference_mode(), autocast():
                logits = policy_forward(policy, input_ids, attention, P, temperature).logits
                ref_logits = reference_logits(input_ids, attention, P)
            logprobs, ref = selective_log_softmax(logits, resp), selective_log_softmax(ref_logits, resp)
            k1_all.append(masked_sum(KL_ESTIMATORS["k1"](logprobs, ref), trained, dim=1).float().cpu())
            k3_all.append(masked_sum(KL_ESTIMATORS["k3"](logprobs, ref), trained, dim=1).float().cpu())
            exact_all.append(masked_sum(exact_kl(logits, ref_logits, chunk_size=64), trained, dim=1).float().cpu())
    cat = lambda xs: torch.cat(xs) if xs else torch.zeros(0)
    return PolicyEval(
        prompts=list(prompt_texts),
        responses=responses,
        scores={k: torch.cat(v) for k, v in per_source.items()},
        total=cat(totals),
        lengths=cat(lengths),
        terminated=cat(terminated_all).bool(),
        kl_k1=cat(k1_all) if reference_logits is not None else None,
        kl_k3=cat(k3_all) if reference_logits is not None else None,
        kl_exact=cat(exact_all) if reference_logits is not None else None,
        source_weights={s.name: float(s.weight) for s in sources} | ({"environment": 1.0} if episodes else {}),
    )


def _right_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Id lists -> (N, T) ids padded on the right and (N, T) bool mask."""
    width = max(1, max(len(r) for r in rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
        mask[i, : len(r)] = True
    return ids, mask


def _episode_tensors(played: Sequence[Any], pad_id: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Episodes -> response ids (N, T), their real-token mask, the policy tokens' mask, ended by the environment."""
    ids, mask = _right_pad([e.tokens for e in played], pad_id)
    K = max(len(e.turn_ends) for e in played)
    starts = torch.tensor([e.turn_starts + [-1] * (K - len(e.turn_starts)) for e in played])
    ends = torch.tensor([e.turn_ends + [-1] * (K - len(e.turn_ends)) for e in played])
    policy = action_mask(starts, ends, ids.shape[1])
    ended = torch.tensor([e.stop_reason == ENDED_BY_ENVIRONMENT for e in played])
    return ids.to(device), mask.to(device), policy.to(device), ended.to(device)


def _sample(
    policy, prompt_ids, prompt_mask, temperature, max_new_tokens, stop_ids, pad_id, backend, seed, chunk, positions
):
    if backend == "hf":
        gen = pure_sampling_config(policy, temperature, max_new_tokens, stop_ids.tolist(), pad_id)
        devices = [prompt_ids.device] if prompt_ids.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed + chunk)
            return sample_responses(policy, prompt_ids, prompt_mask, gen, stop_ids, max_new_tokens)

    seeds = [response_seed(seed, EVAL_STREAM, p) for p in positions]
    return sample_native(policy, prompt_ids, prompt_mask, temperature, max_new_tokens, stop_ids, pad_id, seeds)


def repeat_prompts(ids: Sequence[Sequence[int]], texts: Sequence[str], k: int) -> tuple[list, list[str]]:
    """Each prompt `k` times in a row (response i then has its own random stream: see `sample_and_score`)."""
    if k < 1:
        raise LmppoError(f"samples per prompt = {k}: must be >= 1")
    return [x for x in ids for _ in range(k)], [t for t in texts for _ in range(k)]


def repeat_columns(columns: Sequence[dict], k: int) -> Optional[list[dict]]:
    """The prompts' columns repeated like `repeat_prompts` repeats the prompts; None when there are none."""
    return [c for c in columns for _ in range(k)] if columns else None


def compare(trained: PolicyEval, start: PolicyEval) -> dict[str, float]:
    """Win rate of `trained` over `start` by every reward source (prompt by prompt, ties counted half)."""
    return {name: win_rate(trained.scores[name], start.scores[name]) for name in trained.scores if name in start.scores}
