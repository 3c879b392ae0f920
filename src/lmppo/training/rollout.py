"""Phase 1 of an iteration: the prompts of this process, and the `Rollout` of their episodes (from the run's road,
`lmppo.episodes.road`) with the logprobs, reference logprobs and values of the rollout's weights."""

from __future__ import annotations

from typing import Callable, Optional, TypedDict

import torch

from lmppo.config import Config
from lmppo.core.kl import KL_ESTIMATORS, in_row_chunks
from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax
from lmppo.data.prompts import PromptSet
from lmppo.episodes.road import EpisodePrompts, Episodes
from lmppo.models.loading import PolicyOutput
from lmppo.sampling.engines import PromptBatch
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed
from lmppo.training.batch import Rollout


class RolloutPasses(TypedDict):
    """`rollout_passes`'s tensors (shapes there)."""

    logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: torch.Tensor
    entropy: Optional[torch.Tensor]
    ref_logits: Optional[torch.Tensor]
    full_logits_kl: Optional[torch.Tensor]


def prompt_batch(
    indices: list[int],
    prompt_set: PromptSet,
    cfg: Config,
    iteration: int,
    first_row: int,
    pad_id: int,
    device: torch.device,
) -> tuple[PromptBatch, torch.Tensor]:
    """This process's prompts `indices` (each already repeated `num_samples_per_prompt` times) as a left-padded
    batch with a seed per response, and (B,) the group id of each row (rows of one prompt share it); `first_row`:
    where this process's rows start in the global batch."""
    k = cfg.rollout.num_samples_per_prompt
    positions = list(range(first_row, first_row + len(indices)))
    group_ids = torch.tensor([p // k for p in positions], device=device)
    ids, mask = left_pad([prompt_set.ids[i] for i in indices], pad_id)
    seeds = [response_seed(cfg.seed, iteration, p) for p in positions]
    token_lists = [prompt_set.ids[i] for i in indices]
    return PromptBatch(ids=ids.to(device), mask=mask.to(device), token_lists=token_lists, seeds=seeds), group_ids


def reuses_rollout_forward(cfg: Config, strategy_allows: bool, processes: int, rows: int, chunk: int) -> bool:
    """Whether the rollout's policy/value pass doubles as the first epoch's training forward.

    Before the first optimizer step the weights are those that made the rollout, so with one minibatch that is
    one micro-batch (and one rollout chunk) the first epoch would recompute exactly the old logprobs and values.
    Then the rollout pass runs with its autograd graph kept and the first backward uses it: one policy and one
    critic forward fewer per iteration, the same update (`ppo.reuse_rollout_forward`). `rows`: this process's
    rows of the batch; `chunk`: the rows of one rollout pass."""
    p = cfg.ppo
    return (
        p.reuse_rollout_forward
        and strategy_allows
        and chunk >= rows
        and cfg.minibatch_size // processes == rows
        and p.micro_batch_size >= rows
    )


def rollout_passes(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    cfg: Config,
    reference_logits: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
    policy_and_values: Callable[[torch.Tensor, torch.Tensor, int], PolicyOutput],
    chunk: int,
) -> RolloutPasses:
    """The rollout's forward passes over chunks of `chunk` rows: `logprobs`, `ref_logprobs` (B, R), `values`
    (B, R + 1), `entropy` (B, R) with `log.token_stats`, and `ref_logits` (B, R, V) and `full_logits_kl` (B, R)
    with a `kl.estimator` with the trait `full_logits` (such as `exact`; `full_logits_kl` is its value at each state),
    each None when not computed. R: the response width; P = input width - R."""
    P = input_ids.shape[1] - response_ids.shape[1]
    full_logits = bool(KL_ESTIMATORS.trait(cfg.kl.estimator, "full_logits"))
    logprobs: list[torch.Tensor] = []
    ref_logprobs: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    entropies: list[torch.Tensor] = []
    ref_logits: list[torch.Tensor] = []
    full_logits_kls: list[torch.Tensor] = []
    for s in range(0, input_ids.shape[0], chunk):
        ids, att, resp = input_ids[s : s + chunk], attention_mask[s : s + chunk], response_ids[s : s + chunk]
        with torch.inference_mode():  # first: a LoRA reference adapter is swapped in place, which would
            # invalidate a graph kept from the policy pass (`reuses_rollout_forward`)
            ref = reference_logits(ids, att, P)
            ref_logprobs.append(selective_log_softmax(ref, resp))
        out = policy_and_values(ids, att, P)
        with torch.inference_mode():
            logprobs.append(selective_log_softmax(out.logits, resp))
            if cfg.log.token_stats:
                entropies.append(entropy_from_logits(out.logits))
            if full_logits:
                ref_logits.append(ref)
                full_logits_kls.append(in_row_chunks(KL_ESTIMATORS[cfg.kl.estimator], out.logits, ref, chunk_size=64))
            assert out.values is not None, "policy_and_values returns values"
            values.append(out.values)
        del ref
    # clone out of inference mode: these tensors enter the loss as constants
    return {
        "logprobs": torch.cat(logprobs).clone(),
        "ref_logprobs": torch.cat(ref_logprobs).clone(),
        "values": torch.cat(values).clone(),
        "entropy": torch.cat(entropies).clone() if entropies else None,
        "ref_logits": torch.cat(ref_logits) if full_logits else None,  # (cat already leaves inference mode: no copy)
        "full_logits_kl": torch.cat(full_logits_kls) if full_logits else None,
    }


def episode_prompts(batch: PromptBatch, index: list[int], prompt_set: PromptSet) -> EpisodePrompts:
    """The road's prompts of a rollout: the engine's batch with prompts `index` of `prompt_set` (texts, columns)."""
    columns = prompt_set.columns_of(index) if prompt_set.columns else None
    return EpisodePrompts(batch, [prompt_set.texts[i] for i in index], columns, rows=list(index))


def build_rollout(
    episodes: Episodes,
    passes: RolloutPasses,
    group_ids: torch.Tensor,
    index: list[int],
    prompt_set: PromptSet,
) -> Rollout:
    """The `Rollout` of a batch: the `episodes` of prompts `index` of `prompt_set` from the road (held, not copied),
    `passes` from `rollout_passes`; every per-token tensor 0 off the policy's tokens (past each response's end, and
    on an episode's observations)."""
    policy = episodes.policy_mask
    zeros = torch.zeros_like(passes["logprobs"])
    all_values = passes["values"]
    lengths = episodes.response_mask.sum(1)
    final_values = all_values.gather(1, lengths[:, None]).squeeze(1)  # V of the state after the last token
    state_kl, entropy = passes["full_logits_kl"], passes["entropy"]
    return Rollout(
        prompt_ids=episodes.prompts.batch.ids,
        prompt_mask=episodes.prompts.batch.mask,
        response_ids=episodes.response_ids,
        response_mask=episodes.response_mask,
        action_mask=policy,
        logprobs=torch.where(policy, passes["logprobs"], zeros),
        ref_logprobs=torch.where(policy, passes["ref_logprobs"], zeros),
        values=torch.where(policy, all_values[:, :-1], zeros),
        final_values=final_values,
        terminated=episodes.terminated,
        truncated=episodes.truncated,
        group_ids=group_ids,
        episodes=episodes,
        prompts_shown=[prompt_set.shown_text(i) for i in index],
        entropy=torch.where(policy, entropy, zeros) if entropy is not None else None,
        ref_logits=passes["ref_logits"],
        full_logits_kl=torch.where(policy, state_kl, zeros) if state_kl is not None else None,
    )
