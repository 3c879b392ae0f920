"""lmppo.evaluation.evaluate (`lmppo eval`) and lmppo.evaluation.summary (the end-of-run summary) on tiny in-process
models."""

from __future__ import annotations

import io
import json
import os
from contextlib import nullcontext

import pytest
import torch
from rich.console import Console

from conftest import (
    PROMPTS,
    tiny_llama,
)
from lmppo.apps.cli import main as cli_main
from lmppo.config import Config, RewardSourceConfig
from lmppo.episodes.road import Road, single_turn_road
from lmppo.errors import LmppoError
from lmppo.evaluation.evaluate import eval_device
from lmppo.evaluation.evaluate import main as eval_main
from lmppo.evaluation.heldout import EvalChoices, EvalPrompts, repeat_prompts, sample_and_score, win_rate
from lmppo.evaluation.summary import SAMPLES_PER_PROMPT, print_summary, summarize
from lmppo.evaluation.tables import default_judge
from lmppo.models.loading import policy_forward
from lmppo.rewards import FunctionSource
from lmppo.sampling.engines import NativeEngine, OneProcess
from lmppo.sampling.settings import Sampling
from lmppo.training.report import run_record
from lmppo.training.trainer import PPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def vowel_judge(prompts, completions):
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]


def _console():
    return Console(file=io.StringIO(), width=140, force_terminal=False)


def test_win_rate_counts_ties_half():
    a = torch.tensor([1.0, 2.0, 3.0, 0.0])
    b = torch.tensor([0.0, 2.0, 4.0, 0.0])
    assert win_rate(a, b) == pytest.approx((1 + 0.5 + 0 + 0.5) / 4)
    assert win_rate(b, a) == pytest.approx(1 - 0.5)
    with pytest.raises(ValueError):
        win_rate(a, b[:2])


def test_default_judge_is_the_first_weight_zero_source():
    assert default_judge({"vader": 1.0, "judge": 0.0, "other": 0.0}) == "judge"
    assert default_judge({"vader": 1.0, "len": 0.5}) == "vader"


def _ids(tokenizer, texts):
    return [tokenizer.encode(t) for t in texts]


def native_road(tokenizer, sources, max_new_tokens: int) -> Road:
    """The road of an fp32 run on the native engine at temperature 1."""
    cfg = Config()
    cfg.rollout.temperature, cfg.rollout.max_new_tokens = 1.0, max_new_tokens
    stop_ids = torch.tensor([tokenizer.eos_token_id])
    engine = NativeEngine(cfg, stop_ids, tokenizer.pad_token_id, OneProcess(torch.device("cpu")))
    return single_turn_road(engine, tokenizer, sources, nullcontext, Sampling.of(cfg.rollout))


def test_sample_and_score_is_seeded_scores_every_source_and_kl_to_itself_is_zero(tokenizer):
    policy, other = tiny_llama(tokenizer, seed=0), tiny_llama(tokenizer, seed=3)
    sources = [FunctionSource.from_callable(length_reward), FunctionSource.from_callable(vowel_judge, weight=0.0)]
    road = native_road(tokenizer, sources, max_new_tokens=6)
    prompts = EvalPrompts(_ids(tokenizer, PROMPTS), PROMPTS)
    choices = EvalChoices(seed=5, batch_size=3)

    def logits_of(model):
        return lambda ids_, att, P: policy_forward(model, ids_, att, P, 1.0).logits

    a = sample_and_score(road, policy, prompts, choices, logits_of(policy))
    b = sample_and_score(road, policy, prompts, choices)
    assert a.responses == b.responses  # fixed seed: the same responses, whatever else was computed
    assert len(a.responses) == len(PROMPTS) and a.lengths.shape == (len(PROMPTS),)
    assert torch.allclose(a.scores["length_reward"], torch.tensor(length_reward(PROMPTS, a.responses)))
    assert torch.allclose(a.scores["vowel_judge"], torch.tensor(vowel_judge(PROMPTS, a.responses)))
    assert torch.allclose(a.total, a.scores["length_reward"])  # the judge has weight 0
    for kl in (a.kl_k1, a.kl_k3, a.kl_exact):
        assert torch.allclose(kl, torch.zeros(len(PROMPTS)), atol=1e-6)
    assert b.kl_k1 is None and b.means()["kl"] is None
    c = sample_and_score(road, policy, prompts, choices, logits_of(other))
    assert c.responses == a.responses
    assert (c.kl_k3 >= 0).all() and c.kl_k3.sum() > 0 and c.kl_k1.abs().sum() > 0 and (c.kl_exact > 0).all()
    # the batch split does not change the samples (each response has its own random stream)
    d = sample_and_score(road, policy, prompts, EvalChoices(seed=5, batch_size=8))
    assert d.responses == a.responses
    e = sample_and_score(road, policy, prompts, EvalChoices(seed=6, batch_size=3))
    assert e.responses != a.responses  # the seed is used


def test_exact_kl_of_held_out_responses_is_the_vocabulary_sum_and_what_k1_estimates(tokenizer):
    """`kl_exact` of a response is the sum, over the states its tokens are chosen in, of KL(pi || pi_ref) of the
    next-token distribution (checked against torch.distributions' Categorical KL on the same sequences); over many
    samples, the per-response k1 sums average to it (within 4 standard errors)."""
    policy, other = tiny_llama(tokenizer, seed=0), tiny_llama(tokenizer, seed=3)
    prompts = PROMPTS * 40
    road = native_road(tokenizer, [FunctionSource.from_callable(length_reward)], max_new_tokens=5)
    seen = []  # the sequences the reference was asked about, to recompute their KL independently

    def other_logits(input_ids, attention, P):
        seen.append((input_ids.clone(), attention.clone(), P))
        return policy_forward(other, input_ids, attention, P, 1.0).logits

    res = sample_and_score(
        road, policy, EvalPrompts(_ids(tokenizer, prompts), prompts), EvalChoices(seed=7, batch_size=64), other_logits
    )
    input_ids, attention, P = seen[0]
    with torch.no_grad():
        p = policy_forward(policy, input_ids, attention, P, 1.0).logits
        q = policy_forward(other, input_ids, attention, P, 1.0).logits
    per_state = torch.distributions.kl_divergence(
        torch.distributions.Categorical(logits=p), torch.distributions.Categorical(logits=q)
    )
    expected = (per_state * attention[:, P:]).sum(1)
    assert torch.allclose(res.kl_exact[: len(expected)], expected, rtol=1e-4, atol=1e-6)
    assert torch.equal(attention[:, P:].sum(1), res.lengths[: len(expected)])
    k1, exact = res.kl_k1, res.kl_exact
    se = float((k1 - exact).std()) / len(prompts) ** 0.5
    assert abs(float(k1.mean() - exact.mean())) < 4 * se
    assert float(exact.std()) < float(k1.std())  # the vocabulary sum has no sampling noise of its own per token
    assert res.means()["kl_exact"] == pytest.approx(float(exact.mean()))


def _write_prompts(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("\n".join(PROMPTS * 2) + "\n")
    return str(path)


def _config(tmp_path, policy_dir, lora=False, holdout=4) -> Config:
    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = str(tmp_path / ("run_lora" if lora else "run"))
    cfg.model.policy = policy_dir
    cfg.model.lora.enabled, cfg.model.lora.r = lora, 4
    cfg.data.prompts, cfg.data.holdout = _write_prompts(tmp_path), holdout
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 8, 8, 6
    cfg.rollout.temperature = 1.0
    cfg.ppo.micro_batch_size, cfg.ppo.num_epochs, cfg.ppo.learning_rate = 4, 2, 1e-2 if lora else 3e-3
    cfg.reward.sources = [
        RewardSourceConfig(kind="function", path=f"{HERE}/test_evaluate.py:length_reward", name="length"),
        RewardSourceConfig(kind="function", path=f"{HERE}/test_evaluate.py:vowel_judge", name="judge", weight=0.0),
    ]
    cfg.log.trackers, cfg.log.sample_every = [], 0
    return cfg


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, tiny_model_dir):
    tmp = tmp_path_factory.mktemp("eval_full")
    trainer = PPOTrainer(_config(tmp, tiny_model_dir))
    trainer.train()
    return trainer


@pytest.mark.parametrize("lora", [False, True])
def test_summary_before_and_after_on_held_out_prompts(tmp_path, tiny_model_dir, full_run, lora):
    trainer = full_run if not lora else PPOTrainer(_config(tmp_path, tiny_model_dir, lora=True))
    if lora:
        trainer.train()
    console = _console()
    summary = summarize(run_record(trainer), console)
    saved = json.load(open(os.path.join(trainer.config.output_dir, "summary.json")))
    assert saved["heldout_prompts"] == 4 == summary["heldout_prompts"]
    assert set(trainer.holdout_set.texts).isdisjoint(trainer.prompt_set.texts)
    for side in ("before", "after"):
        for key in ("score", "reward/length", "reward/judge", "kl", "kl_k3", "kl_exact", "length"):
            assert saved[side][key] is not None, (side, key)
    assert saved["before"]["kl"] == 0.0 and saved["after"]["kl_k3"] >= 0
    assert saved["judge"] == "judge" and 0 <= saved["win_rate"]["judge"] <= 1
    assert len(saved["samples"]) == 3 and all(s["prompt"] in trainer.holdout_set.texts for s in saved["samples"])
    assert saved["training"]["iterations"] == 1 and "objective/kl" in saved["training"]["last"]
    # the initial policy's responses are those of the untrained model at the same seed
    k = saved["samples_per_prompt"]
    assert k == SAMPLES_PER_PROMPT > 1
    if not lora:
        ids, texts = repeat_prompts(trainer.holdout_set.ids, trainer.holdout_set.texts, k)
        road = native_road(trainer.tokenizer, trainer.reward_sources, max_new_tokens=6)
        fresh = sample_and_score(
            road, trainer.reference.model, EvalPrompts(ids, texts), EvalChoices(seed=trainer.config.seed)
        )
        assert [s["before"] for s in saved["samples"]] == fresh.responses[::k][:3]
        assert saved["before"]["reward/length"] == pytest.approx(float(fresh.scores["length"].mean()))
    out = console.file.getvalue()
    assert "held-out prompts (4), 4 samples each" in out and "reward/judge (weight 0)" in out and "summary.json" in out
    assert "win rate" in out and "before" in out and "after" in out


def test_summary_without_held_out_prompts_says_so(tmp_path, tokenizer):
    cfg = _config(tmp_path, "smollm2", holdout=0)  # the policy object below replaces it
    cfg.reward.sources = []
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[length_reward]
    )
    trainer.train()
    console = _console()
    summary = summarize(run_record(trainer), console)
    assert "after" not in summary and "data.holdout" in summary["note"]
    assert "data.holdout" in console.file.getvalue()
    print_summary(json.load(open(os.path.join(cfg.output_dir, "summary.json"))), _console())


def test_the_summarys_training_line_shows_the_controllers_beta_where_the_kl_acts():
    # a run with the KL in the loss (kl.placement: loss): objective/kl_coef is the rewards' 0 throughout
    first = {"iteration": 1, "objective/scores": 0.125, "objective/kl": 0.0, "objective/kl_coef": 0.0,
             "loss/kl_coef": 0.0184}  # fmt: skip
    last = {"iteration": 12, "objective/scores": 0.0, "objective/kl": 7.2, "objective/kl_coef": 0.0,
            "loss/kl_coef": 0.0304}  # fmt: skip
    summary = {"training": {"iterations": 12, "episodes": 384, "train_seconds": 10.0, "first": first, "last": last}}
    console = _console()
    print_summary(summary, console)  # type: ignore[arg-type]
    assert "KL 0.00 -> 7.20 nats, beta 0.0184 -> 0.0304 (384 episodes" in console.file.getvalue()


def test_eval_a_run_folder_against_its_starting_point(tmp_path, full_run):
    run = full_run.config.output_dir
    out = tmp_path / "eval.json"
    console = _console()
    assert eval_main([run, "--output", str(out), "--show", "2"], console) == 0
    res = json.load(open(out))
    assert res["held_out"] and res["prompts"] == 4 and res["judge"] == "judge"
    assert res["start"] == full_run.config.model.policy
    assert res["trained"]["kl_k3"] >= 0 and res["start_point"]["kl"] == 0.0
    per_response = [s["trained_kl"] for s in res["samples"]]  # each response's KL; their mean is the reported KL
    assert sum(per_response) / len(per_response) == pytest.approx(res["trained"]["kl"], rel=1e-6, abs=1e-9)
    assert len(set(per_response)) > 1
    assert set(res["win_rate_by_source"]) == {"length", "judge"} and 0 <= res["win_rate"] <= 1
    # the held-out prompts are the run's own, and the trained responses are the summary's "after" ones
    k = res["samples_per_prompt"]
    assert [s["prompt"] for s in res["samples"][::k]] == full_run.holdout_set.texts and len(res["samples"]) == 4 * k
    summary = (
        json.load(open(os.path.join(run, "summary.json")))
        if os.path.exists(os.path.join(run, "summary.json"))
        else summarize(run_record(full_run))
    )
    assert [s["trained"] for s in res["samples"][::k][:3]] == [s["after"] for s in summary["samples"]]
    assert res["trained"]["reward/length"] == pytest.approx(summary["after"]["reward/length"], abs=1e-6)
    text = console.file.getvalue()
    assert "win rate by judge (judge)" in text and "KL to reference, k1" in text
    # the same model against itself: KL 0, every comparison a tie
    assert (
        eval_main(
            [
                os.path.join(run, "final", "policy"),
                "--reference",
                os.path.join(run, "final", "policy"),
                "--config",
                os.path.join(run, "config.yaml"),
                "-o",
                str(out),
            ],
            _console(),
        )
        == 0
    )
    res = json.load(open(out))
    assert res["trained"]["kl"] == pytest.approx(0.0, abs=1e-5) and res["win_rate"] == 0.5


def test_eval_a_lora_adapter_folder(tmp_path, tiny_model_dir):
    trainer = PPOTrainer(_config(tmp_path, tiny_model_dir, lora=True))
    trainer.train()
    policy_dir = os.path.join(trainer.config.output_dir, "final", "policy")
    assert os.path.isfile(os.path.join(policy_dir, "adapter_config.json"))
    out = tmp_path / "e.json"
    assert eval_main([policy_dir, "-o", str(out), "--judge", "length", "--num-prompts", "3"], _console()) == 0
    res = json.load(open(out))
    assert res["start"].endswith("(adapter off)") and res["prompts"] == 3 and res["judge"] == "length"
    assert res["trained"]["kl_k3"] >= 0


def test_eval_errors_are_one_line(tmp_path, full_run, tiny_model_dir, capsys):
    run = full_run.config.output_dir
    cases = [
        ([str(tmp_path / "nowhere")], "no such folder"),
        ([str(tmp_path)], "holds no model"),
        ([tiny_model_dir], "--reference"),
        ([run, "--judge", "vader"], "not a reward source"),
        ([run, "--rollout.temprature", "1"], "did you mean"),
        ([run, "--samples-per-prompt", "0"], "must be >= 1"),
    ]
    for argv, message in cases:
        assert cli_main(["eval", *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert err and err[-1].startswith("error:") and message in err[-1], (argv, err)
    with pytest.raises(LmppoError, match="no such folder"):
        eval_main([str(tmp_path / "nowhere")], _console())


def test_a_watch_metric_is_never_the_judge_nor_called_a_win():
    from lmppo.evaluation.tables import metric_rows, watched, win_rows
    from lmppo.rewards.builtin import minilm_self_similarity

    source = FunctionSource.from_callable(minilm_self_similarity, name="self_similarity", weight=0.0)
    plain = FunctionSource.from_callable(length_reward, name="length", weight=0.0)
    watch = watched([source, plain])
    assert watch == {"self_similarity": "rises as completions collapse onto one phrasing"}
    weights = {"vader": 1.0, "self_similarity": 0.0, "length": 0.0}
    assert default_judge(weights, watch) == "length"  # the first weight-0 source that is not a warning sign
    assert default_judge({"vader": 1.0, "self_similarity": 0.0}, watch) == "vader"
    rows = win_rows({"length": 0.6, "self_similarity": 0.828, "vader": 0.7}, "length", watch)
    labels = [r[0] for r in rows]
    assert labels == [
        "win rate by length (judge)",
        "self_similarity higher than at the start (watch: rises as completions collapse onto one phrasing)",
        "win rate by vader",
    ]
    assert [r[2] for r in rows] == ["0.600", "0.828", "0.700"]
    labelled = {r[0] for r in metric_rows({}, {}, weights, watch)}
    assert "reward/self_similarity (weight 0, watch: higher is worse)" in labelled
    assert "reward/length (weight 0)" in labelled


def test_a_run_without_a_final_model_gets_advice_that_works_in_its_state(tmp_path):
    """No checkpoint yet: nothing to resume, so the advice is `--overwrite true`, not `--resume`."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("")
    with pytest.raises(LmppoError, match="did not finish; start it again with the same `lmppo train` command and "):
        eval_main([str(run)])
    (run / "checkpoints" / "iter-2").mkdir(parents=True)
    (run / "checkpoints" / "iter-2" / "manifest.json").write_text("{}")
    with pytest.raises(LmppoError, match=f"did not finish; continue with `lmppo train --resume {run}`"):
        eval_main([str(run)])


def test_eval_refuses_cuda_on_a_machine_without_one():
    if torch.cuda.is_available():
        return  # the refusal is for machines without a GPU
    with pytest.raises(LmppoError, match="device.*no CUDA GPU"):
        eval_device(Config(device="cuda"))


def test_held_out_score_carries_the_runs_truncation_penalty(tokenizer):
    """A response cut at max_new_tokens scores what training gives it: `replace` -> the penalty, `add` -> its
    sources' total plus the penalty; without the `penalty` policy the total is the sources' alone."""
    policy = tiny_llama(tokenizer, seed=0)
    sources = [FunctionSource.from_callable(length_reward)]
    road = native_road(tokenizer, sources, max_new_tokens=2)
    prompts = EvalPrompts(_ids(tokenizer, PROMPTS), PROMPTS)
    plain = sample_and_score(road, policy, prompts, EvalChoices(seed=5, batch_size=3))
    cut = ~plain.terminated
    assert cut.any()  # 2 new tokens: the tiny model rarely stops in time
    cfg = Config()
    cfg.reward.truncation, cfg.reward.penalty = "penalty", -1.0
    replaced = sample_and_score(road, policy, prompts, EvalChoices.of_run(cfg, 5))
    assert replaced.responses == plain.responses
    assert torch.equal(replaced.total[cut], torch.full((int(cut.sum()),), -1.0))
    assert torch.equal(replaced.total[~cut], plain.total[~cut])
    cfg.reward.penalty_mode = "add"
    added = sample_and_score(road, policy, prompts, EvalChoices.of_run(cfg, 5))
    assert torch.allclose(added.total[cut], plain.total[cut] - 1.0)
    cfg.reward.truncation = "none"
    assert torch.equal(sample_and_score(road, policy, prompts, EvalChoices.of_run(cfg, 5)).total, plain.total)
