"""Reward functions called by keyword (TRL's convention) and the prompt data's columns travelling with each prompt.

Checked by hand: which argument a function receives under each signature; that a record's `solution` reaches the
reward call of the response to that very record (through the shuffled stream, the held-out split and the end-of-run
summary); the built-in `exact_match` and `builtin:arithmetic`.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import tiny_llama
from lmppo.config import Config, DataConfig, RewardSourceConfig
from lmppo.data.prompts import load_prompt_records, split_holdout, tokenize_prompts
from lmppo.errors import DataError, RewardError
from lmppo.evaluation.evaluate import eval_prompt_set
from lmppo.evaluation.summary import heldout_summary
from lmppo.models.assets import arithmetic_problems, builtin_records
from lmppo.rewards import FunctionSource, SourceContext, build_reward_sources, score_rollout
from lmppo.rewards.builtin import exact_match, final_answer, number_only
from lmppo.training.report import run_record
from lmppo.training.trainer import PPOTrainer

PROMPTS = ["p0", "p1"]
COMPLETIONS = ["c0", "c1"]
COLUMNS = [{"solution": "s0", "level": 1}, {"solution": "s1", "level": 2}]


def call(fn, columns=COLUMNS, ids=None):
    return FunctionSource.from_callable(fn)(PROMPTS, COMPLETIONS, completion_ids=ids, columns=columns)


def test_a_trl_style_function_gets_completions_and_columns_by_name():
    seen = {}

    def accuracy(completions, solution, **kwargs):
        seen.update(completions=completions, solution=solution, **kwargs)
        return [1.0, 0.0]

    assert call(accuracy, ids=[[5], [6, 7]]) == [1.0, 0.0]
    assert seen == {
        "completions": COMPLETIONS,
        "solution": ["s0", "s1"],
        "prompts": PROMPTS,
        "completion_ids": [[5], [6, 7]],
        "level": [1, 2],
    }


def test_a_keyword_function_gets_only_what_it_names():
    seen = {}

    def f(completions, prompts, level):  # order does not matter: by name
        seen.update(completions=completions, prompts=prompts, level=level)
        return [0.0, 0.0]

    call(f)
    assert seen == {"completions": COMPLETIONS, "prompts": PROMPTS, "level": [1, 2]}


def test_kwargs_only_gets_everything():
    seen = {}

    def f(**kwargs):
        seen.update(kwargs)
        return [0.0, 0.0]

    call(f, ids=[[1], [2]])
    assert set(seen) == {"prompts", "completions", "completion_ids", "solution", "level"}
    assert seen["completions"] == COMPLETIONS


def test_positional_functions_keep_working():
    got = []
    call(lambda p, c: got.append((p, c)) or [0.0, 0.0])
    assert got == [(PROMPTS, COMPLETIONS)]

    def old(prompts, responses):  # another name for the second parameter: still by position
        got.append((prompts, responses))
        return [0.0, 0.0]

    call(old)
    assert got[-1] == (PROMPTS, COMPLETIONS)

    def with_column(p, c, solution):  # by position, and a column by name
        got.append((p, c, solution))
        return [0.0, 0.0]

    call(with_column)
    assert got[-1] == (PROMPTS, COMPLETIONS, ["s0", "s1"])

    def with_ids(p, c, **kw):  # the documented way to get completion_ids before: still by position
        got.append((p, c, sorted(kw)))
        return [0.0, 0.0]

    call(with_ids, ids=[[1], [2]])
    assert got[-1] == (PROMPTS, COMPLETIONS, ["completion_ids", "level", "solution"])


def test_a_missing_column_is_refused_before_training_with_one_line():
    def accuracy(completions, answer, **kwargs):
        return [0.0] * len(completions)

    source = FunctionSource.from_callable(accuracy)
    with pytest.raises(RewardError) as err:
        source.check_arguments(["solution", "level"])
    msg = str(err.value)
    assert "\n" not in msg and "`accuracy`" in msg and "`answer`" in msg and "`solution`" in msg
    FunctionSource.from_callable(lambda completions, answer=None: [0.0]).check_arguments([])  # a default: fine


def test_score_rollout_hands_columns_to_sources_that_take_them():
    def accuracy(completions, solution, **kwargs):
        return [1.0 if c == s else 0.0 for c, s in zip(completions, solution)]

    ids, mask = torch.tensor([[5, 6], [7, 8]]), torch.ones(2, 2, dtype=torch.bool)
    sources = [FunctionSource.from_callable(accuracy)]
    result = score_rollout(
        sources,
        PROMPTS,
        ["s0", "wrong"],
        ids,
        mask,
        tokenizer=None,
        terminated=torch.tensor([False, False]),
        columns=COLUMNS,
    )
    assert result.per_source["accuracy"].tolist() == [1.0, 0.0]


# ----------------------------------------------------------------------------- data: columns kept


def test_jsonl_and_csv_columns_are_kept(tmp_path):
    (tmp_path / "p.jsonl").write_text(
        '{"prompt": "2+2=", "solution": "4", "id": 7}\n{"prompt": "1+1=", "solution": "2"}\n'
    )
    recs = load_prompt_records(DataConfig(prompts=str(tmp_path / "p.jsonl")))
    assert list(recs) == ["2+2=", "1+1="] and recs.columns == [{"solution": "4", "id": 7}, {"solution": "2"}]
    (tmp_path / "p.csv").write_text("question,solution\nwhat?,42\nwho?,me\n")
    recs = load_prompt_records(DataConfig(prompts=str(tmp_path / "p.csv"), field="question"))
    assert list(recs) == ["what?", "who?"] and recs.columns == [{"solution": "42"}, {"solution": "me"}]


def test_api_dict_records_and_their_errors():
    recs = load_prompt_records(DataConfig(), [{"prompt": "a", "solution": "1"}, "b"])
    assert list(recs) == ["a", "b"] and recs.columns == [{"solution": "1"}, {}]
    with pytest.raises(DataError, match="no field `prompt`.*`question`"):
        load_prompt_records(DataConfig(), [{"question": "a", "solution": "1"}])


def test_the_holdout_split_keeps_each_prompt_with_its_columns(tokenizer):
    records = [{"prompt": f"question {i}", "solution": str(i)} for i in range(10)]
    prompts = tokenize_prompts(load_prompt_records(DataConfig(), records), tokenizer, DataConfig())
    train, held = split_holdout(prompts, 3, seed=0)
    for part in (train, held):
        for text, col in zip(part.texts, part.columns):
            assert text.endswith(f"question {col['solution']}")
    assert len(train.columns) == 7 and len(held.columns) == 3


# ----------------------------------------------------------------------------- through the trainer


def test_each_response_is_scored_with_its_own_prompts_solution(tokenizer, tmp_path):
    """Shuffled stream, 2 samples per prompt, held-out summary: the solution seen with a prompt is always its own."""
    records = [{"prompt": f"question {i}", "solution": str(i)} for i in range(12)]
    pairs, calls = [], {"n": 0}

    def accuracy(completions, solution, prompts, **kwargs):
        calls["n"] += 1
        pairs.extend(zip(prompts, solution))
        return [float(len(c) % 2) for c in completions]

    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "run"), []
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens, cfg.rollout.num_samples_per_prompt = 4, 3, 2
    cfg.ppo.num_epochs, cfg.ppo.micro_batch_size, cfg.total_episodes = 1, 4, 8
    cfg.data.holdout = 4
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=records, reward_functions=[accuracy]
    )
    trainer.train()
    heldout_summary(run_record(trainer), num_samples=1, samples_per_prompt=1)
    assert calls["n"] >= 3 and len(pairs) == 8 + 4 + 4  # 2 iterations of 4, held-out before and after
    for prompt, sol in pairs:
        assert prompt.endswith(f"question {sol}"), (prompt, sol)


def test_a_reward_function_naming_a_missing_column_stops_before_any_training(tokenizer, tmp_path):
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "run"), []
    cfg.rollout.batch_size, cfg.ppo.micro_batch_size = 4, 4
    with pytest.raises(RewardError, match="takes `solution`, which is not a column"):
        PPOTrainer(
            cfg,
            policy=tiny_llama(tokenizer),
            tokenizer=tokenizer,
            prompts=["a b", "c d", "e f", "g h"],
            reward_functions=[lambda completions, solution: [0.0] * len(completions)],
        )


def test_a_config_function_source_reads_a_jsonl_column(tokenizer, tmp_path):
    """The YAML route: `kind: function, path: lmppo.rewards.builtin:exact_match` on a JSONL with `solution`."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "solution": str(i)}) + "\n" for i in range(8)))
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "run"), []
    cfg.data.prompts = str(path)
    cfg.reward.sources = [RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:exact_match")]
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens, cfg.ppo.micro_batch_size, cfg.total_episodes = 4, 3, 4, 4
    history = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer).train()
    assert "reward/exact_match" in history[0]


# ----------------------------------------------------------------------------- built-in verifiable reward


def test_final_answer_and_exact_match():
    assert final_answer("so 3 + 4 = 7.") == "7"
    assert final_answer("reasoning 12 ... #### 1,200") == "1,200"
    assert final_answer(r"hence \boxed{42} and 7") == "42"
    assert final_answer("no digits") == "no digits"
    assert exact_match(
        ["The answer is 12.", "#### 1,200", r"\boxed{7}", "12.0", "13", "", "Paris."],
        ["12", "1200", "7", "12", "12", "0", "paris"],
    ) == [1, 1, 1, 1, 0, 0, 1]


def test_number_only_pays_for_a_bare_number():
    assert number_only(
        ["42", " -7\n", "3.5", "1,200", ".5", "The answer is 42", "42.", "#### 42", r"\boxed{4}", "", "four", "4 2"]
    ) == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]


def test_a_format_reward_beside_exact_match_with_weights(tokenizer, tmp_path):
    """`number_only` (weight 0.25) beside `exact_match` (weight 1), from the config: each logged on its own, the
    trained score their weighted sum."""
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"say {i}", "solution": str(i)}) + "\n" for i in range(8)))
    cfg = Config()
    cfg.precision, cfg.output_dir, cfg.log.trackers = "fp32", str(tmp_path / "run"), []
    cfg.data.prompts = str(path)
    cfg.reward.sources = [
        RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:exact_match"),
        RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:number_only", weight=0.25),
    ]
    cfg.rollout.batch_size, cfg.rollout.max_new_tokens, cfg.ppo.micro_batch_size, cfg.total_episodes = 4, 3, 4, 4
    trainer = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer)
    rollout = trainer.collect_rollout()
    solutions = [c["solution"] for c in rollout.episodes.prompts.columns]
    # the texts the sources read, set by hand: right and bare, a bare wrong number, neither, right in a sentence
    rollout.episodes.side.texts = [solutions[0], "1,000", "no", f"the answer is {solutions[3]}"]
    scored = trainer.score(rollout)
    assert scored.token_scores.sum(1).tolist() == pytest.approx([1.25, 0.25, 0.0, 1.0])
    assert scored.per_source["number_only"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert scored.per_source["exact_match"].tolist() == [1.0, 0.0, 0.0, 1.0]


def test_builtin_arithmetic_is_deterministic_and_right():
    a, b = arithmetic_problems(), arithmetic_problems()
    assert a == b and len(a) == 480 and builtin_records("arithmetic") == a
    assert len({r["prompt"] for r in a}) == 480
    for r in a:
        x, op, y = r["prompt"].split("?")[0].split()[2:5]
        assert str(eval(f"{int(x)} {op} {int(y)}")) == r["solution"]
    assert {r["operation"] for r in a} == {"addition", "subtraction", "multiplication"}


def test_build_reward_sources_binds_the_builtin_by_path():
    [source] = build_reward_sources(
        Config().reward.__class__(
            sources=[RewardSourceConfig(kind="function", path="lmppo.rewards.builtin:exact_match")]
        ),
        ctx=SourceContext(),
    )
    assert source.by_keyword and source.required == ["solution"]


def test_holdout_seed_keeps_the_same_prompts_out_whatever_the_run_seed(tokenizer, tmp_path):
    """Training and `lmppo eval` both split with `data.holdout_seed`; without it the run's seed decides."""
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(40)))
    held = {}
    for name, seed, holdout_seed in [("a", 0, None), ("b", 5, 0), ("c", 5, None)]:
        cfg = Config()
        cfg.seed, cfg.data.prompts, cfg.data.holdout, cfg.data.holdout_seed = seed, str(path), 8, holdout_seed
        prompts = tokenize_prompts(load_prompt_records(cfg.data), tokenizer, cfg.data)
        train, kept_out = split_holdout(prompts, cfg.data.holdout, cfg.data.holdout_seed_for(cfg.seed))
        evaluated, is_held_out = eval_prompt_set(cfg, tokenizer, 0)
        assert is_held_out and evaluated.texts == kept_out.texts and set(train.texts).isdisjoint(kept_out.texts)
        held[name] = kept_out.texts
    assert held["b"] == held["a"] and held["c"] != held["a"]
