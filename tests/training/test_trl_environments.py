"""PPO through `PPOTrainer(..., environment_factory=Class, tools=[fn])` on a tiny in-process model: a class in TRL
1.16's environment_factory shape trains, its `get_reward()` is the episode's reward on its last policy token, it
plays exactly the episodes of the same environment written in lmppo's contract (the same tokens, rewards and
advantages), and the config names the objects so that a resume without them stops with one line."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import small_config, tiny_llama
from lmppo.errors import ConfigError
from lmppo.training.trainer import PPOTrainer

ROWS = [{"prompt": f"score {v}", "target": v} for v in (0.0, 0.5, 1.0, 0.25)]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


class Scored:
    """TRL-style: reset adds to the prompt, one tool method, get_reward the row's target."""

    def reset(self, **row) -> str:
        self.target = float(row["target"])
        return " Answer."

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return key.upper()

    def get_reward(self) -> float:
        return self.target


class NativeScored:
    """The same environment in lmppo's contract: built with the row, the same tools, the reward from step."""

    def __init__(self, target, prompt="", tools=()):
        self.target, self.prompt = float(target), prompt
        self.tools = [self.lookup, *tools]

    def lookup(self, key: str) -> str:
        """Look a key up.

        Args:
            key: the key
        """
        return key.upper()

    def reset(self) -> str:
        return self.prompt + " Answer."

    def step(self, action):
        return None, self.target, True  # a random tiny model makes no tool call: its first turn is the answer


def make_trainer(tmp_path, tokenizer, name="run", **objects):
    cfg = small_config(
        tmp_path / name,
        iterations=2,
        batch=4,
        environment__max_turns=2,
        environment__max_episode_tokens=80,
        rollout__stop_token="<|im_end|>",
        ppo__micro_batch_size=2,
        checkpoint__every=1,
    )
    cfg.reward.sources = []
    cfg.data.shuffle = False
    return PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS, **objects)


def test_a_trl_style_class_trains_with_get_reward_on_the_last_policy_token(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, environment_factory=Scored, tools=[multiply])
    assert trainer.config.environment.path == "python:Scored"
    assert trainer.config.environment.tools == ["python:multiply"]
    batch = trainer.collect_rollout()
    assert batch.stop_reasons == ["environment"] * 4  # no tool call: the first turn is the answer
    assert '"name": "lookup"' in batch.prompts_text[0] and '"name": "multiply"' in batch.prompts_text[0]
    assert batch.prompts_text[1].endswith("<|im_start|>user\nscore 0.5 Answer.<|im_end|>\n<|im_start|>assistant\n")
    scored = trainer.score(batch)
    assert scored.raw_scores.tolist() == [0.0, 0.5, 1.0, 0.25]
    for b in range(4):
        last = int(batch.turn_ends[b].max())
        assert scored.token_scores[b, last] == ROWS[b]["target"] and scored.token_scores[b].sum() == ROWS[b]["target"]
    history = trainer.train()
    assert len(history) == 2 and all(math.isfinite(v) for v in history[-1].values())
    assert history[-1]["objective/scores"] == pytest.approx(0.4375)  # the mean target: every episode scored
    assert "python:Scored" in (tmp_path / "run" / "config.yaml").read_text()


def test_it_plays_exactly_the_episodes_of_the_same_environment_in_lmppos_contract(tmp_path, tokenizer):
    trl = make_trainer(tmp_path, tokenizer, "trl", environment_factory=Scored, tools=[multiply])
    native = make_trainer(tmp_path, tokenizer, "native", environment_factory=NativeScored, tools=[multiply])
    a, b = trl.collect_rollout(), native.collect_rollout()
    assert a.prompts_text == b.prompts_text
    assert torch.equal(a.response_ids, b.response_ids) and torch.equal(a.action_mask, b.action_mask)
    sa, sb = trl.score(a), native.score(b)
    assert torch.equal(sa.token_scores, sb.token_scores)
    ra, rb = trl.token_rewards(a, sa), native.token_rewards(b, sb)
    adv_a, ret_a = trl.advantages(a, ra)
    adv_b, ret_b = native.advantages(b, rb)
    assert torch.equal(adv_a, adv_b) and torch.equal(ret_a, ret_b)


def test_a_resume_without_the_objects_is_one_line_and_with_them_continues(tmp_path, tokenizer):
    trainer = make_trainer(tmp_path, tokenizer, environment_factory=Scored, tools=[multiply])
    trainer.train()
    run = str(tmp_path / "run")
    objects = dict(policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=ROWS)
    with pytest.raises(ConfigError, match=r"environment.path.*python:Scored.*environment_factory="):
        PPOTrainer.resume(run, **objects)
    with pytest.raises(ConfigError, match=r"environment.tools.*python:multiply.*tools="):
        PPOTrainer.resume(run, environment_factory=Scored, **objects)
    resumed = PPOTrainer.resume(
        run, overrides={"total_episodes": 12}, environment_factory=Scored, tools=[multiply], **objects
    )
    assert resumed.iteration == 2 and len(resumed.train()) == 1


def test_the_migration_guides_environment_yaml_is_a_valid_config(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    import yaml

    from lmppo.config import Config, from_dict

    guide = (Path(__file__).parents[2] / "docs" / "migrating_from_trl.md").read_text(encoding="utf-8")
    section = guide[guide.index("## GRPO with an environment (TRL 1.16 `environment_factory`)") :]
    block = re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "counter.jsonl").write_text(
        '{"prompt": [{"role": "user", "content": "to 5"}], "start": 1, "target": 5}\n'
    )
    cfg = from_dict(Config, yaml.safe_load(block)).validate()
    assert (cfg.environment.path, cfg.environment.max_turns) == ("trl_counter.py:Counter", 4)
    assert cfg.rollout.num_samples_per_prompt == 4 and cfg.reward.sources == []


def test_a_row_naming_no_factory_of_the_dict_stops_before_any_model_loads(tmp_path, tokenizer):
    from lmppo.environments.api import EnvironmentError

    rows = [{**r, "environment": "scored"} for r in ROWS]
    rows[2]["environment"] = "wordle"
    cfg = small_config(tmp_path / "run", iterations=1, batch=4, ppo__micro_batch_size=2)
    cfg.reward.sources = []
    with pytest.raises(
        EnvironmentError, match=r"^prompts passed to the API, item 2: its `environment` column is 'wordle'"
    ):
        PPOTrainer(
            cfg, tokenizer=tokenizer, prompts=rows, environment_factory={"scored": Scored, "native": NativeScored}
        )
    assert not (tmp_path / "run").exists()
