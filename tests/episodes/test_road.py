"""The one rollout road (lmppo.episodes.road): training, the held-out evaluation during training (`log.eval_every`),
the end-of-run summary and `lmppo eval` all sample with the run's engine, a plug-in one included, in the run's
precision, and score with the run's sources."""

from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import PROMPTS, small_config
from lmppo.apps.cli import main as cli_main
from lmppo.config import RewardSourceConfig
from lmppo.episodes.road import (
    EpisodePrompts,
    ResponseNumbers,
    SingleTurn,
    autocast_for,
    single_turn_road,
)
from lmppo.evaluation.evaluate import main as eval_main
from lmppo.evaluation.heldout import EVAL_STREAM
from lmppo.registry import SAMPLING_ENGINES
from lmppo.rewards import FunctionSource, decode_completion
from lmppo.sampling.engines import NativeEngine, OneProcess, PromptBatch, register_sampling_engine
from lmppo.sampling.native import response_seed
from lmppo.sampling.settings import Sampling
from lmppo.training.report import summarize_run
from lmppo.training.trainer import PPOTrainer

HERE = os.path.dirname(os.path.abspath(__file__))


def length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


class CountingEngine(NativeEngine):
    """A plug-in engine: the native sampler, with a log of every call (which instance, which seeds, the texts)."""

    calls: list[dict] = []  # shared by every instance: one log for the whole test
    instances: list[object] = []  # accelerator of each instance built

    def __init__(self, config, stop_ids, pad_id, accelerator):
        super().__init__(config, stop_ids, pad_id, accelerator)
        CountingEngine.instances.append(accelerator)

    def sample(self, policy, prompts, sampling):
        out = super().sample(policy, prompts, sampling)
        CountingEngine.calls.append(
            {
                "engine": id(self),
                "seeds": list(prompts.seeds),
                "autocast": torch.is_autocast_enabled("cpu"),
                "responses": [r[m].tolist() for r, m in zip(out[0], out[1])],
                "terminated": out[2].tolist(),
            }
        )
        return out


class OneModelEngine(NativeEngine):
    """A plug-in engine that, like vLLM, holds one model's weights."""

    samples_any_model = False


for name, cls in (("counting_test", CountingEngine), ("one_model_test", OneModelEngine)):
    if name not in SAMPLING_ENGINES:
        register_sampling_engine(name)(cls)


def _config(tmp_path, tiny_model_dir, backend: str, name: str = "run"):
    cfg = small_config(tmp_path / name, iterations=2)
    cfg.model.policy = tiny_model_dir
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS * 2) + "\n")
    cfg.data.prompts, cfg.data.holdout = str(prompts), 4
    cfg.rollout.backend = backend
    cfg.log.eval_every = 1
    cfg.reward.sources = [
        RewardSourceConfig(kind="function", path=f"{HERE}/test_road.py:length_reward", name="length"),
    ]
    return cfg


def _texts(tokenizer, call: dict) -> list[str]:
    """The completions of one logged engine call, decoded as lmppo decodes them (stop token dropped)."""
    return [decode_completion(tokenizer, r[:-1] if t else r) for r, t in zip(call["responses"], call["terminated"])]


def _eval_seeds(seed: int, n: int) -> list[int]:
    return [response_seed(seed, EVAL_STREAM, i) for i in range(n)]


def test_a_plugin_engine_is_the_engine_of_training_of_every_evaluation_and_of_lmppo_eval(tmp_path, tiny_model_dir):
    CountingEngine.calls.clear()
    CountingEngine.instances.clear()
    cfg = _config(tmp_path, tiny_model_dir, "counting_test")
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    held = len(trainer.holdout_set.ids)
    assert held == 4
    # training: one call per iteration on the training seeds; evaluation during training: one per iteration on
    # evaluation's own streams; all on the trainer's one engine instance
    assert len(CountingEngine.instances) == 1
    train_calls = [c for c in CountingEngine.calls if c["seeds"] != _eval_seeds(cfg.seed, held)]
    eval_calls = [c for c in CountingEngine.calls if c["seeds"] == _eval_seeds(cfg.seed, held)]
    assert len(train_calls) == 2 and len(eval_calls) == 2 and len(CountingEngine.calls) == 4
    assert train_calls[0]["seeds"] == [response_seed(cfg.seed, 0, p) for p in range(cfg.rollout.batch_size)]
    assert all("eval/score" in row for row in history)
    # what the evaluation reports is what the engine returned: eval/length is the mean over its responses
    last_eval = eval_calls[-1]["responses"]
    texts = _texts(trainer.tokenizer, eval_calls[-1])
    assert history[-1]["eval/length"] == pytest.approx(sum(map(len, last_eval)) / held)
    assert history[-1]["eval/reward/length"] == pytest.approx(sum(length_reward(None, texts)) / held, abs=1e-6)

    # the end-of-run summary: the trained and the initial policy, 4 samples per prompt, on the same engine
    CountingEngine.calls.clear()
    summary = summarize_run(trainer)
    assert summary is not None and summary["before"] is not None
    assert len(CountingEngine.instances) == 1
    seeds = [s for c in CountingEngine.calls for s in c["seeds"]]  # in chunks of no_grad_batch_size
    assert seeds == 2 * _eval_seeds(cfg.seed, 4 * held)  # after, then before: common random numbers

    # lmppo eval: the run's engine, built for the command (one process), samples both models
    CountingEngine.calls.clear()
    out = tmp_path / "eval.json"
    assert eval_main([cfg.output_dir, "-o", str(out)]) == 0
    assert len(CountingEngine.instances) == 2 and isinstance(CountingEngine.instances[-1], OneProcess)
    seeds = [s for c in CountingEngine.calls for s in c["seeds"]]
    assert seeds == 2 * _eval_seeds(cfg.seed, 4 * held)  # the trained policy, then its start
    res = json.loads(out.read_text())
    assert res["backend"] == "counting_test"
    trained = [s["trained"] for s in res["samples"]]
    half = len(CountingEngine.calls) // 2
    assert trained == [t for c in CountingEngine.calls[:half] for t in _texts(trainer.tokenizer, c)]


def test_an_engine_that_holds_one_models_weights_is_refused_by_lmppo_eval_in_one_line(tmp_path, tiny_model_dir, capsys):
    cfg = _config(tmp_path, tiny_model_dir, "one_model_test")
    cfg.total_episodes = cfg.rollout.batch_size  # one iteration
    trainer = PPOTrainer(cfg)
    history = trainer.train()
    assert "eval/score" in history[-1]  # the trained policy is what the engine holds: evaluated on it
    summary = summarize_run(trainer)
    assert summary["before"] is None and summary["after"] is not None and "one_model_test" in summary["note"]
    capsys.readouterr()  # the training's progress bar
    assert cli_main(["eval", cfg.output_dir]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and "rollout.backend" in err[0]
    assert "one_model_test" in err[0] and "--rollout.backend native" in err[0]


def test_single_turn_samples_in_the_runs_precision_and_reduces_per_response(tokenizer):
    from conftest import tiny_llama

    cfg = small_config("unused")
    policy = tiny_llama(tokenizer)
    engine = CountingEngine(
        cfg, torch.tensor([tokenizer.eos_token_id]), tokenizer.pad_token_id, OneProcess(torch.device("cpu"))
    )
    CountingEngine.calls.clear()
    token_lists = [tokenizer.encode(p) for p in PROMPTS[:3]]
    from lmppo.sampling.hf import left_pad

    ids, mask = left_pad(token_lists, tokenizer.pad_token_id)
    prompts = EpisodePrompts(PromptBatch(ids, mask, token_lists, seeds=[1, 2, 3]), PROMPTS[:3])
    bf16 = autocast_for("bf16", torch.device("cpu"))
    sampling = Sampling.of(cfg.rollout)
    episodes = SingleTurn(engine, tokenizer, bf16).produce(policy, prompts, sampling)
    assert episodes.side.texts == _texts(tokenizer, CountingEngine.calls[-1]) and episodes.prompts is prompts
    assert CountingEngine.calls[-1]["autocast"] is True  # sampled under the run's bf16 autocast
    SingleTurn(engine, tokenizer, autocast_for("fp32", torch.device("cpu"))).produce(policy, prompts, sampling)
    assert CountingEngine.calls[-1]["autocast"] is False

    # reduction, by hand: total = weighted sum of the sources' placed scores; per_source unweighted
    twice = FunctionSource.from_callable(lambda p, c: [2.0] * len(c), name="two", weight=0.5)
    road = single_turn_road(engine, tokenizer, [FunctionSource.from_callable(length_reward), twice], bf16, sampling)
    scored = road.run(policy, prompts)
    lengths = torch.tensor([len(t) / 20.0 for t in scored.episodes.side.texts])
    assert torch.allclose(scored.numbers.per_source["length_reward"], lengths)
    assert torch.allclose(scored.numbers.per_source["two"], torch.full((3,), 2.0))
    assert torch.allclose(scored.numbers.total, lengths + 0.5 * 2.0)
    assert torch.equal(scored.numbers.lengths, scored.episodes.response_mask.sum(1))
    both = ResponseNumbers.concat([scored.numbers, scored.numbers])
    assert both.total.shape == (6,) and torch.equal(both.total[3:], scored.numbers.total)
    assert ResponseNumbers.concat([]).total.shape == (0,)


def test_lmppo_eval_of_an_environment_run_plays_its_episodes(tmp_path, tiny_model_dir):
    """A run with an environment is evaluated on episodes, as training and its held-out evaluation play them:
    `reward/environment` is the sum of the turn rewards (Countdown: 0.25 a turn, ended after `turns` turns)."""
    from conftest import TESTS

    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"count down from {n}", "turns": n}) + "\n" for n in (1, 2) * 4))
    cfg = small_config(tmp_path / "run", iterations=1, batch=4)
    cfg.model.policy = tiny_model_dir
    cfg.data.prompts, cfg.data.holdout = str(rows), 2
    cfg.environment.path = os.path.join(TESTS, "countdown_env.py") + ":Countdown"
    cfg.environment.max_turns, cfg.environment.max_episode_tokens = 3, 80
    cfg.rollout.stop_token, cfg.ppo.micro_batch_size = "<|im_end|>", 2
    cfg.reward.sources = []
    PPOTrainer(cfg).train()
    out = tmp_path / "eval.json"
    assert eval_main([cfg.output_dir, "-o", str(out), "--samples-per-prompt", "1"]) == 0
    res = json.loads(out.read_text())
    assert res["judge"] == "environment" and res["weights"] == {"environment": 1.0}
    turns = [1 if "from 1" in s["prompt"] else 2 for s in res["samples"]]
    rewards = [s["trained_scores"]["environment"] for s in res["samples"]]
    # an episode ends when the environment says so (its reward: 0.25 per turn) or at max_episode_tokens (fewer)
    assert all(r <= 0.25 * t + 1e-6 for r, t in zip(rewards, turns)) and max(rewards) >= 0.25
    assert res["trained"]["reward/environment"] == pytest.approx(sum(rewards) / len(rewards))


def test_the_environment_reward_is_a_source_weighted_on_each_turns_last_token(tokenizer):
    """`environment.reward_weight` 0.5: each turn's reward (0.25 and 1.0 in row 0, 0.5 in row 1) is placed on the
    turn's last policy token times 0.5, beside a source scoring the last turn (1.0 on its last token);
    `per_source["environment"]` is the unweighted total, as for any source. Weight 0 leaves only the sources."""
    from conftest import hand_episodes
    from lmppo.config import Config, EnvironmentConfig
    from lmppo.episodes.road import EnvironmentReward, Turns, environment_sources, score_episodes
    from lmppo.evaluation.evaluate import scored_weights

    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool)
    ids = torch.where(real, torch.tensor(tokenizer.encode("a b c d e")[:5]), tokenizer.pad_token_id)
    prompt_ids, prompt_mask = torch.tensor([[7], [8]]), torch.ones(2, 1, dtype=torch.bool)
    done = torch.tensor([True, True])
    episodes = hand_episodes(prompt_ids, prompt_mask, ids, real, done, ~done, ["p", "q"], ["d e", "a b c"])
    episodes.turns = Turns(
        action_mask=torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool),  # row 0: turn, obs, turn
        turn_ends=torch.tensor([[1, 4], [2, -1]]),
        turn_rewards=torch.tensor([[0.25, 1.0], [0.5, 0.0]]),
        last_stopped=~done,
    )
    one = FunctionSource.from_callable(lambda p, c: [1.0] * len(c), name="one")
    (environment,) = environment_sources(EnvironmentConfig(path="guess_number", reward_weight=0.5))
    assert isinstance(environment, EnvironmentReward) and environment.name == "environment"
    assert environment_sources(EnvironmentConfig()) == []  # no environment, no source
    result = score_episodes(episodes, [one, environment], tokenizer, "error", stop_known=True)
    assert result.token_scores.tolist() == [[0.0, 0.125, 0.0, 0.0, 1.5], [0.0, 0.0, 1.25, 0.0, 0.0]]
    assert result.per_source["environment"].tolist() == [1.25, 0.5] and result.per_source["one"].tolist() == [1, 1]
    muted = score_episodes(episodes, [one, EnvironmentReward(0.0)], tokenizer, "error", stop_known=True)
    assert muted.token_scores.tolist() == [[0.0, 0.0, 0.0, 0.0, 1.0], [0.0, 0.0, 1.0, 0.0, 0.0]]
    cfg = Config()
    cfg.environment.path, cfg.environment.reward_weight = "guess_number", 0.5
    assert scored_weights([one], cfg) == {"one": 1.0, "environment": 0.5}  # what evaluation weighs and judges
