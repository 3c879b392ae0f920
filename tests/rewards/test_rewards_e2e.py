"""Rewards at every granularity through the trainer's phases 2-3 (`score`, `token_rewards`), by hand.

Most tests build one hand-made rollout (`hand_rollout`) whose tokens, KL and values are known, run the trainer's
own `score` and `token_rewards` on it with a fixed KL coefficient, and compare with tensors worked out by hand.
The rest train a tiny model for an iteration or two: several weighted sources, a weight-0 judge, a reward model
with its own tokenizer, bad reward outputs (error / drop) and the last checkpoint surviving an error.

The hand rollout (policy tokenizer: the test byte-level BPE, where tokens and characters do not align 1:1):

    row 0  " was great!" + EOS   tokens [' was', ' great', '!', EOS]    chars (0,4) (4,10) (10,11) (11,11)  terminated
    row 1  "Bad movie!"          tokens ['B', 'ad', ' movie', '!']      chars (0,1) (1,3) (3,9) (9,10)      truncated
    (T = 4)
    row 2  " sad" + EOS          tokens [' s', 'ad', EOS, <pad>]        chars (0,2) (2,4) (4,4)             terminated

    per-token KL (k1 = logprob - ref_logprob)   row 0 [.1 .2 .3 .4]   row 1 [.5 .1 .2 .3]   row 2 [.2 .2 .1 | 9 on the
    pad]
    with kl.coef = 0.1 the KL part of the rewards is
                                                row 0 [-.01 -.02 -.03 -.04]  row 1 [-.05 -.01 -.02 -.03]  row 2 [-.02
                                                -.02 -.01 0]
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import PROMPTS, set_fields, tiny_llama
from conftest import hand_rollout as made_by_hand
from lmppo.config import Config, RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.rewards import FunctionSource, token_char_offsets
from lmppo.training.batch import Rollout
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.trainer import PPOTrainer
from lmppo.training.update import UpdateBatch

KL_COEF = 0.1
HAND = [(" was great!", True), ("Bad movie!", False), (" sad", True)]  # (completion text, ends with EOS)
HAND_IDS = [
    [334, 383, 5, 2],
    [38, 336, 382, 5],
    [262, 336, 2],
]  # checked in test_hand_rollout_is_what_the_values_assume
HAND_KL = [[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.2, 0.3], [0.2, 0.2, 0.1, 9.0]]  # 9.0 sits on row 2's padding
KL_PART = [[-0.01, -0.02, -0.03, -0.04], [-0.05, -0.01, -0.02, -0.03], [-0.02, -0.02, -0.01, 0.0]]


def t(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def base_config(tmp_path, iterations: int = 1, batch: int = 4, **kw) -> Config:
    """A small config with a fixed KL coefficient; `a__b=v` keyword arguments set `cfg.a.b = v`. Unless given,
    total_episodes is `iterations` batches and a micro-batch is the whole minibatch."""
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = str(tmp_path / "run")
    cfg.rollout.batch_size = batch
    cfg.rollout.max_new_tokens = 4
    cfg.rollout.temperature = 1.0
    cfg.kl.controller = "fixed"
    cfg.kl.coef = KL_COEF
    cfg.kl.estimator = "k1"
    cfg.ppo.num_epochs = 1
    cfg.ppo.learning_rate = 1e-3
    cfg.log.trackers = []
    cfg.log.sample_every = 0
    set_fields(cfg, **kw)
    if "total_episodes" not in kw:
        cfg.total_episodes = iterations * cfg.rollout.batch_size
    if "ppo__micro_batch_size" not in kw:
        cfg.ppo.micro_batch_size = cfg.minibatch_size
    return cfg


def make_trainer(tmp_path, tokenizer, sources, policy=None, **kw) -> PPOTrainer:
    """A trainer whose reward sources are `sources` (callables or RewardSource objects)."""
    return PPOTrainer(
        base_config(tmp_path, **kw),
        policy=policy if policy is not None else tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=list(sources),
    )


def source(fn, name: str = "f", weight: float = 1.0, span_placement: str = "last") -> FunctionSource:
    return FunctionSource.from_callable(fn, name=name, weight=weight, span_placement=span_placement)


def constant(outputs, name: str = "f", **kw) -> FunctionSource:
    """A source that returns `outputs` (one per response of the hand rollout) whatever the texts."""
    return source(lambda prompts, completions: list(outputs), name=name, **kw)


def hand_rollout(tokenizer, values=None, final_values=(7.0, 2.0, 7.0)) -> Rollout:
    """The rollout of the module docstring. Values default to 1 on real tokens and 5 on padding."""
    B, T = 3, 4
    ids = torch.full((B, T), tokenizer.pad_token_id)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for i, row in enumerate(HAND_IDS):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = True
    prompts = ["The movie", "A critic said", "The movie"]
    prompt_rows = [tokenizer(p)["input_ids"] for p in prompts]
    P = max(len(r) for r in prompt_rows)
    prompt_ids = torch.tensor([[tokenizer.pad_token_id] * (P - len(r)) + r for r in prompt_rows])
    prompt_mask = torch.tensor([[False] * (P - len(r)) + [True] * len(r) for r in prompt_rows])
    ref = torch.full((B, T), -2.0)
    if values is None:
        values = [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 5.0]]
    return made_by_hand(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=ids,
        response_mask=mask,
        logprobs=ref + t(HAND_KL),
        ref_logprobs=ref,
        values=t(values),
        final_values=t(list(final_values)),
        terminated=torch.tensor([s for _, s in HAND]),
        truncated=torch.tensor([not s for _, s in HAND]),
        group_ids=torch.arange(B),
        prompts_text=prompts,
        responses_text=[text for text, _ in HAND],
    )


def phases_2_3(trainer, rollout):
    scored = trainer.score(rollout)
    return scored, trainer.token_rewards(rollout, scored)


# ----------------------------------------------------------------------------- the hand rollout itself


def test_hand_rollout_is_what_the_values_assume(tokenizer):
    for (text, stop), ids in zip(HAND, HAND_IDS):
        assert tokenizer(text)["input_ids"] + ([tokenizer.eos_token_id] if stop else []) == ids
    offsets = [
        token_char_offsets(tokenizer, ids, text=text, has_stop=stop) for (text, stop), ids in zip(HAND, HAND_IDS)
    ]
    assert offsets == [
        [(0, 4), (4, 10), (10, 11), (11, 11)],
        [(0, 1), (1, 3), (3, 9), (9, 10)],
        [(0, 2), (2, 4), (4, 4)],
    ]


# ----------------------------------------------------------------------------- each output form


def test_scalar_scores(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, [constant([1.0, 2.0, -1.0])])
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    # each score on the last real token: the EOS for rows 0 and 2, the last generated token of the cut row 1
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, 1.0], [0, 0, 0, 2.0], [0, 0, -1.0, 0]]))
    assert torch.allclose(
        rewards.rewards, t([[-0.01, -0.02, -0.03, 0.96], [-0.05, -0.01, -0.02, 1.97], [-0.02, -0.02, -1.01, 0.0]])
    )
    assert torch.allclose(rewards.kl, t([[0.1, 0.2, 0.3, 0.4], [0.5, 0.1, 0.2, 0.3], [0.2, 0.2, 0.1, 0.0]]))
    assert torch.equal(rewards.train_mask, hand_rollout(tokenizer).response_mask)
    assert torch.allclose(scored.raw_scores, t([1.0, 2.0, -1.0]))


def test_per_token_scores(tmp_path, tokenizer):
    outputs = [[1.0, -1.0, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25], [2.0, -2.0, 0.0]]  # stop token included
    trainer = make_trainer(tmp_path, tokenizer, [constant(outputs)])
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    assert torch.allclose(scored.token_scores, t([[1.0, -1.0, 0.5, 0], [0.25, 0.25, 0.25, 0.25], [2.0, -2.0, 0, 0]]))
    assert torch.allclose(
        rewards.rewards, t([[0.99, -1.02, 0.47, -0.04], [0.20, 0.24, 0.23, 0.22], [1.98, -2.02, -0.01, 0.0]])
    )
    assert torch.allclose(scored.per_source["f"], t([0.5, 1.0, 0.0]))


def test_functions_that_ask_get_the_token_ids(tmp_path, tokenizer):
    """A per-token list must match the sampled tokens one for one (stop token included); text alone cannot give
    them, so a function with a `completion_ids` parameter (or **kwargs, as in TRL) is given them."""
    seen = {}

    def by_name(prompts, completions, completion_ids):
        seen["by_name"] = completion_ids
        return [[float(t) for t in ids] for ids in completion_ids]

    def by_kwargs(prompts, completions, **kwargs):
        seen["by_kwargs"] = kwargs["completion_ids"]
        return [0.0] * len(completions)

    def text_only(prompts, completions):
        return [0.0] * len(completions)

    sources = [source(by_name, "a"), source(by_kwargs, "b"), source(text_only, "c")]
    assert [s.wants_completion_ids for s in sources] == [True, True, False]
    trainer = make_trainer(tmp_path, tokenizer, sources)
    scored = trainer.score(hand_rollout(tokenizer))
    assert seen["by_name"] == seen["by_kwargs"] == HAND_IDS
    assert torch.allclose(scored.token_scores, t([[334, 383, 5, 2], [38, 336, 382, 5], [262, 336, 2, 0]]))


def test_per_token_lengths_match_sampled_rollouts(tmp_path, tokenizer):
    """On real samples (some cut, some stopped, some holding special tokens the text skips) the ids handed to the
    function are exactly the response tokens, so a per-token list built from them always fits."""

    def one_per_token(prompts, completions, completion_ids):
        return [[1.0] * len(ids) for ids in completion_ids]

    trainer = make_trainer(
        tmp_path, tokenizer, [source(one_per_token)], rollout__batch_size=8, rollout__max_new_tokens=12
    )
    for _ in range(3):
        rollout = trainer.collect_rollout()
        scored = trainer.score(rollout)
        assert torch.equal(scored.token_scores, rollout.response_mask.float())


SPANS = [
    [(1, 10, 2.0)],  # "was great" -> tokens ' was', ' great'
    [(0, 3, -1.0), (4, 9, 3.0)],  # "Bad" -> 'B', 'ad' (one word, two tokens); "movie" -> ' movie'
    [(1, 4, 0.6), (4, 4, 1.0)],
]  # "sad" -> ' s', 'ad'; an empty span at the end -> the stop token


@pytest.mark.parametrize(
    "placement, scores, rewards",
    [
        (
            "last",
            [[0, 2.0, 0, 0], [0, -1.0, 3.0, 0], [0, 0.6, 1.0, 0]],
            [[-0.01, 1.98, -0.03, -0.04], [-0.05, -1.01, 2.98, -0.03], [-0.02, 0.58, 0.99, 0.0]],
        ),
        (
            "spread",
            [[1.0, 1.0, 0, 0], [-0.5, -0.5, 3.0, 0], [0.3, 0.3, 1.0, 0]],
            [[0.99, 0.98, -0.03, -0.04], [-0.55, -0.51, 2.98, -0.03], [0.28, 0.28, 0.99, 0.0]],
        ),
    ],
)
def test_span_scores(tmp_path, tokenizer, placement, scores, rewards):
    trainer = make_trainer(tmp_path, tokenizer, [constant(SPANS, span_placement=placement)])
    scored, out = phases_2_3(trainer, hand_rollout(tokenizer))
    assert torch.allclose(scored.token_scores, t(scores))
    assert torch.allclose(out.rewards, t(rewards))


def test_span_placement_from_the_config(tmp_path, tokenizer):
    """A config source bound to an API callable takes weight and span placement from the config."""
    cfg = base_config(tmp_path)
    cfg.reward.sources = [
        RewardSourceConfig(kind="function", path="api:spans", name="judge", weight=2.0, span_placement="spread")
    ]
    trainer = PPOTrainer(
        cfg,
        policy=tiny_llama(tokenizer),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions={"api:spans": lambda p, c: SPANS},
    )
    scored, _ = phases_2_3(trainer, hand_rollout(tokenizer))
    assert torch.allclose(scored.token_scores, 2 * t([[1.0, 1.0, 0, 0], [-0.5, -0.5, 3.0, 0], [0.3, 0.3, 1.0, 0]]))
    assert torch.allclose(scored.per_source["judge"], t([2.0, 2.0, 1.6]))  # unweighted


def test_spans_are_computed_from_the_whole_completion(tmp_path, tokenizer):
    """The trlx #79 situation: the reward of the first part depends on what comes later; the source sees the
    whole completion text and scores parts of it."""

    def larger_word_wins(prompts, completions):
        out = []
        for c in completions:
            words = [(c.index(w), c.index(w) + len(w)) for w in c.split()]
            first, last = words[0], words[-1]
            sign = 1.0 if (last[1] - last[0]) > (first[1] - first[0]) else -1.0
            out.append([(first[0], first[1], -sign), (last[0], last[1], sign)])
        return out

    trainer = make_trainer(tmp_path, tokenizer, [source(larger_word_wins, span_placement="spread")])
    scored, _ = phases_2_3(trainer, hand_rollout(tokenizer))
    # row 0: "was" (1, 4) vs "great!" (5, 11), the later word is longer: -1 on ' was'; +1 spread over
    #        ' great' (4, 10) and '!' (10, 11)
    # row 1: "Bad" (0, 3) vs "movie!" (4, 10): -1 spread over 'B', 'ad'; +1 spread over ' movie', '!'
    # row 2: one word "sad": first == last is not longer, -1 and +1 on the same tokens: 0
    assert torch.allclose(scored.token_scores, t([[-1.0, 0.5, 0.5, 0], [-0.5, -0.5, 0.5, 0.5], [0, 0, 0, 0]]))


# ----------------------------------------------------------------------------- normalisation and clipping


def test_running_normalisation_by_hand(tmp_path, tokenizer):
    """Totals of batch 1 are [1, 1, 4]: mean 2, std sqrt(2). Batch 2 [2, 2, 5] joins them: over all six
    scores mean 2.5, variance 2.25 (std 1.5). A response's total becomes (total - mean) / std; per-token scores
    are divided by std and -mean/std lands on the last real token."""
    batches = iter([[[0.5, 0.5, 0.0, 0.0], 1.0, 4.0], [2.0, 2.0, 5.0]])
    trainer = make_trainer(tmp_path, tokenizer, [source(lambda p, c: next(batches))], reward__normalize=True)
    rollout = hand_rollout(tokenizer)
    scored = trainer.score(rollout)
    s = math.sqrt(2)
    assert torch.allclose(
        scored.token_scores,
        t(
            [
                [0.5 / s, 0.5 / s, 0, -2 / s],  # total (1 - 2) / s
                [0, 0, 0, -1 / s],
                [0, 0, 2 / s, 0],
            ]
        ),
        atol=1e-6,
    )
    assert trainer.score_moments.mean == pytest.approx(2.0) and trainer.score_moments.std == pytest.approx(s)
    scored = trainer.score(rollout)
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, -1 / 3], [0, 0, 0, -1 / 3], [0, 0, 5 / 3, 0]]), atol=1e-6)
    assert trainer.score_moments.mean == pytest.approx(2.5) and trainer.score_moments.std == pytest.approx(1.5)
    assert torch.allclose(scored.raw_scores, t([2.0, 2.0, 5.0]))  # the raw totals are kept for the metrics


def test_clipping_by_hand(tmp_path, tokenizer):
    outputs = [[0.5, 0.5, 0.0, 0.0], 1.0, 4.0]
    trainer = make_trainer(tmp_path, tokenizer, [constant(outputs)], reward__clip=2.0)
    scored = trainer.score(hand_rollout(tokenizer))  # no normalisation: totals [1, 1, 4] -> [1, 1, 2]
    assert torch.allclose(scored.token_scores, t([[0.5, 0.5, 0, 0], [0, 0, 0, 1.0], [0, 0, 2.0, 0]]))

    trainer = make_trainer(tmp_path / "b", tokenizer, [constant(outputs)], reward__normalize=True, reward__clip=0.5)
    scored = trainer.score(hand_rollout(tokenizer))  # normalised [-1/s, -1/s, 2/s] -> clipped [-.5, -.5, .5]
    s = math.sqrt(2)
    assert torch.allclose(
        scored.token_scores, t([[0.5 / s, 0.5 / s, 0, -0.5 - 1 / s], [0, 0, 0, -0.5], [0, 0, 0.5, 0]]), atol=1e-6
    )
    assert torch.allclose(scored.token_scores.sum(1), t([-0.5, -0.5, 0.5]))


def test_normalisation_statistics_skip_invalid_samples(tmp_path, tokenizer):
    """With on_bad_output=drop, a dropped sample is not in the running statistics and scores 0."""
    trainer = make_trainer(
        tmp_path, tokenizer, [constant([1.0, float("nan"), 5.0])], reward__normalize=True, reward__on_bad_output="drop"
    )
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    assert trainer.score_moments.mean == pytest.approx(3.0) and trainer.score_moments.std == pytest.approx(2.0)
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, -1.0], [0, 0, 0, 0], [0, 0, 1.0, 0]]))
    assert scored.valid.tolist() == [True, False, True]
    assert not rewards.train_mask[1].any() and rewards.train_mask[[0, 2]].equal(
        hand_rollout(tokenizer).response_mask[[0, 2]]
    )


# ----------------------------------------------------------------------------- several sources


def test_two_weighted_sources_are_summed_and_logged_unweighted(tmp_path, tokenizer):
    scalar = constant([1.0, 2.0, -1.0], name="scalar", weight=2.0)
    spans = constant(SPANS, name="spans", weight=0.5, span_placement="spread")
    trainer = make_trainer(tmp_path, tokenizer, [scalar, spans])
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    expected = 2 * t([[0, 0, 0, 1.0], [0, 0, 0, 2.0], [0, 0, -1.0, 0]]) + 0.5 * t(
        [[1.0, 1.0, 0, 0], [-0.5, -0.5, 3.0, 0], [0.3, 0.3, 1.0, 0]]
    )
    assert torch.allclose(scored.token_scores, expected)
    assert torch.allclose(rewards.rewards, expected + t(KL_PART))
    assert torch.allclose(scored.per_source["scalar"], t([1.0, 2.0, -1.0]))
    assert torch.allclose(scored.per_source["spans"], t([2.0, 2.0, 1.6]))


def test_per_source_metrics_of_a_training_iteration(tmp_path, tokenizer):
    seen: dict[str, list[float]] = {"length": [], "first_char": []}

    def length(prompts, completions):
        out = [len(c) / 10 for c in completions]
        seen["length"] += out
        return out

    def first_char(prompts, completions):  # a span over the first character (or the stop token if empty)
        seen["first_char"] += [1.0] * len(completions)
        return [[(0, min(1, len(c)), 1.0)] for c in completions]

    trainer = make_trainer(
        tmp_path,
        tokenizer,
        [source(length, "length", weight=3.0), source(first_char, "first_char", weight=-0.5)],
        rollout__max_new_tokens=6,
        rollout__batch_size=8,
    )
    m = trainer.train()[-1]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert m["reward/length"] == pytest.approx(mean(seen["length"]), abs=1e-6)
    assert m["reward/first_char"] == pytest.approx(1.0)
    assert m["objective/scores"] == pytest.approx(3 * mean(seen["length"]) - 0.5, abs=1e-5)


def test_weight_zero_source_is_logged_but_not_trained_on(tmp_path, tokenizer):
    def length(prompts, completions):
        return [len(c) / 10 for c in completions]

    judged: list[float] = []

    def judge(prompts, completions):  # would pull towards short answers if it were trained on
        out = [-float(len(c)) for c in completions]
        judged.extend(out)
        return out

    runs = {}
    for name, sources in {
        "alone": [source(length, "length")],
        "with_judge": [source(length, "length"), source(judge, "judge", weight=0.0)],
    }.items():
        trainer = make_trainer(
            tmp_path / name,
            tokenizer,
            sources,
            policy=tiny_llama(tokenizer, seed=4),
            rollout__max_new_tokens=6,
            rollout__batch_size=8,
            iterations=2,
            ppo__num_epochs=2,
        )
        history = trainer.train()
        runs[name] = (history, [p.detach().clone() for p in trainer.policy.parameters()])
    (h_alone, p_alone), (h_judge, p_judge) = runs["alone"], runs["with_judge"]
    assert all(torch.equal(a, b) for a, b in zip(p_alone, p_judge))  # the same training, bit for bit
    for a, b in zip(h_alone, h_judge):
        assert a["objective/scores"] == b["objective/scores"]
        assert "reward/judge" not in a
    assert [m["reward/judge"] for m in h_judge] == pytest.approx([sum(judged[:8]) / 8, sum(judged[8:]) / 8])
    assert min(judged) < 0  # the judge did have something to say


# ----------------------------------------------------------------------------- a reward model, its own tokenizer


@pytest.fixture(scope="module")
def wordpiece_rm_dir(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification

    from helpers_tokenizers import make_wordpiece_tokenizer

    torch.manual_seed(0)
    rm_tok = make_wordpiece_tokenizer()
    model = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(rm_tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=128,
            num_labels=1,
        )
    )
    path = tmp_path_factory.mktemp("wordpiece_rm")
    model.save_pretrained(path)
    rm_tok.save_pretrained(path)
    return str(path), model.eval(), rm_tok


def test_reward_model_with_a_different_tokenizer_trains(tmp_path, tokenizer, wordpiece_rm_dir):
    path, rm, rm_tok = wordpiece_rm_dir
    cfg = base_config(tmp_path, batch=8, rollout__max_new_tokens=6)
    cfg.reward.sources = [RewardSourceConfig(kind="model", path=path, name="rm")]
    trainer = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS)
    assert rm_tok.get_vocab() != tokenizer.get_vocab()
    rollout = trainer.collect_rollout()
    scored = trainer.score(rollout)
    expected = []
    with torch.no_grad():  # the reward model reads prompt + completion as text, through its own tokenizer
        for p, c in zip(rollout.episodes.prompts.texts, rollout.episodes.side.texts):
            expected.append(rm(**rm_tok(p + c, return_tensors="pt")).logits[0, 0].item())
    assert scored.per_source["rm"].tolist() == pytest.approx(expected, abs=1e-5)
    last = rollout.response_mask.sum(1) - 1
    assert torch.allclose(scored.token_scores[torch.arange(8), last], t(expected), atol=1e-5)
    assert scored.token_scores.abs().sum() == pytest.approx(sum(abs(x) for x in expected), abs=1e-4)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    m = trainer.train()[-1]  # one iteration
    assert math.isfinite(m["reward/rm"]) and m["iteration"] == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))


# ----------------------------------------------------------------------------- bad reward outputs


def nan_for_sample(index: int):
    def fn(prompts, completions):
        # the valid scores differ (a signal, `ppo.signal_tolerance`): the run takes policy steps around the dropped one
        return [float("nan") if i == index else 1.0 + 0.1 * i for i in range(len(completions))]

    return fn


def test_bad_output_error_names_source_sample_and_value(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, [source(nan_for_sample(2), "judge")], total_episodes=4)
    with pytest.raises(RewardError, match=r"reward source `judge`, sample 2: .*nan"):
        trainer.train()
    trainer = make_trainer(tmp_path / "b", tokenizer, [constant([1.0, [0.5, 0.5], 0.0], name="judge")])
    with pytest.raises(RewardError, match=r"`judge`, sample 1: per-token scores have length 2, the response has 4"):
        trainer.score(hand_rollout(tokenizer))
    trainer = make_trainer(tmp_path / "c", tokenizer, [constant([[(0, 50, 1.0)], 0.0, 0.0], name="judge")])
    with pytest.raises(RewardError, match=r"`judge`, sample 0: span \[0\] \(0, 50, 1.0\) is outside the text"):
        trainer.score(hand_rollout(tokenizer))


def test_bad_output_drop_masks_the_sample_and_counts_it(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, [constant([1.0, [0.5, 0.5], 2.0])], reward__on_bad_output="drop")
    scored, rewards = phases_2_3(trainer, hand_rollout(tokenizer))
    assert scored.valid.tolist() == [True, False, True]
    assert torch.allclose(scored.token_scores, t([[0, 0, 0, 1.0], [0, 0, 0, 0], [0, 0, 2.0, 0]]))
    assert rewards.train_mask.tolist() == [[True] * 4, [False] * 4, [True, True, True, False]]
    assert dropped_rows_get_no_gradient(trainer, hand_rollout(tokenizer), rewards, dropped=[1])

    trainer = make_trainer(
        tmp_path / "run2",
        tokenizer,
        [source(nan_for_sample(1)), source(nan_for_sample(3), "g")],
        reward__on_bad_output="drop",
        rollout__batch_size=8,
        ppo__micro_batch_size=4,
        total_episodes=16,
    )
    history = trainer.train()
    assert [m["reward/num_invalid"] for m in history] == [2, 2]
    assert all(math.isfinite(m["loss/policy_avg"]) for m in history)


def test_source_that_raises_with_drop_skips_the_batch_and_the_run_goes_on(tmp_path, tokenizer):
    calls = []

    def flaky(prompts, completions):
        calls.append(1)
        if len(calls) == 2:
            raise ConnectionError("judge unreachable")
        return [1.0] * len(completions)

    trainer = make_trainer(
        tmp_path, tokenizer, [source(flaky, "flaky")], reward__on_bad_output="drop", total_episodes=12
    )
    history = trainer.train()
    assert [m["reward/num_invalid"] for m in history] == [0, 4, 0]
    assert history[1]["objective/scores"] == 0.0


def dropped_rows_get_no_gradient(trainer, rollout, rewards, dropped) -> bool:
    """The gradient of the loss w.r.t. the input embeddings of the dropped rows is exactly zero (and not of the
    others), and the parameter gradient equals that of the kept rows alone. The rollout's old logprobs and
    values are replaced by the current policy's, so that no PPO clip hides a gradient (ratio 1)."""
    from dataclasses import replace

    from lmppo.core.logprobs import selective_log_softmax

    with torch.no_grad():
        out = trainer.actor(rollout.input_ids, rollout.attention_mask, rollout.prompt_ids.shape[1], 1.0)
    mask = rollout.response_mask
    rollout = replace(
        rollout,
        logprobs=torch.where(mask, selective_log_softmax(out.logits, rollout.response_ids), 0.0),
        values=torch.where(mask, out.values[:, :-1], 0.0),
    )
    advantages, returns = trainer.advantages(rollout, rewards)
    n_tokens = rewards.train_mask.sum()
    captured = []
    embed = trainer.policy.get_input_embeddings()
    handle = embed.register_forward_hook(lambda mod, inp, out: (out.retain_grad(), captured.append(out))[1])
    try:
        trainer.updater.optimizer.zero_grad(set_to_none=True)
        whole = UpdateBatch(rollout, advantages, returns, rewards.train_mask)
        loss = trainer.updater.micro_batch_loss(whole, n_tokens, MetricsAccumulator())
        loss.backward()
    finally:
        handle.remove()
    grad_embeds = captured[0].grad  # (B, P + T, H)
    kept = [i for i in range(rollout.batch_size) if i not in dropped]
    ok = all(grad_embeds[i].abs().max().item() == 0.0 for i in dropped)
    ok &= all(grad_embeds[i].abs().max().item() > 0.0 for i in kept)
    full = [p.grad.clone() for p in trainer.updater.trainable_params]
    trainer.updater.optimizer.zero_grad(set_to_none=True)
    idx = torch.tensor(kept)
    kept_rows = UpdateBatch(rollout.select(idx), advantages[idx], returns[idx], rewards.train_mask[idx])
    loss = trainer.updater.micro_batch_loss(kept_rows, n_tokens, MetricsAccumulator())
    loss.backward()
    only_kept = [p.grad.clone() for p in trainer.updater.trainable_params]
    trainer.updater.optimizer.zero_grad(set_to_none=True)
    return ok and all(torch.allclose(a, b, atol=1e-7) for a, b in zip(full, only_kept))


# ----------------------------------------------------------------------------- the last checkpoint survives


def test_reward_error_never_loses_the_last_checkpoint(tmp_path, tokenizer):
    from lmppo.run.folder import list_checkpoints
    from lmppo.run.manifest import latest_checkpoint, verify_checkpoint

    calls = []

    def dies_on_third_batch(prompts, completions):
        calls.append(1)
        return [float("inf") if len(calls) == 3 else len(c) / 10 for c in completions]

    def length(prompts, completions):
        return [len(c) / 10 for c in completions]

    kw = dict(total_episodes=16, checkpoint__every=1, checkpoint__keep_last=2)
    trainer = make_trainer(
        tmp_path, tokenizer, [source(dies_on_third_batch, "length")], policy=tiny_llama(tokenizer, seed=5), **kw
    )
    with pytest.raises(RewardError, match=r"`length`, sample 0: the score is inf"):
        trainer.train()
    out = trainer.config.output_dir
    assert trainer.iteration == 2
    assert [i for i, _ in list_checkpoints(out)] == [2, 1]
    latest = latest_checkpoint(out)
    assert os.path.basename(latest) == "iter-00000002"
    assert verify_checkpoint(latest)["iteration"] == 2
    lines = open(os.path.join(out, "metrics.jsonl")).read().splitlines()
    assert len(lines) == 2  # the failed iteration logged nothing
    # the run goes on from there once the reward is fixed
    resumed = PPOTrainer.resume(
        out,
        config=base_config(tmp_path, **kw),
        policy=tiny_llama(tokenizer, seed=5),
        tokenizer=tokenizer,
        prompts=PROMPTS,
        reward_functions=[source(length, "length")],
    )
    assert resumed.iteration == 2
    history = resumed.train()
    assert resumed.iteration == 4 and [m["iteration"] for m in history] == [3, 4]
