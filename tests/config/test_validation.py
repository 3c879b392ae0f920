"""Config.validate as named checks, bounds in the field types, derived sizes as properties, and allowed names read
from the registries (a name registered by code is accepted, with no list in the config to update)."""

from __future__ import annotations

import re

import pytest

from lmppo.config import Config, KLConfig
from lmppo.config.validation import check_kl, validate_config
from lmppo.errors import ConfigError
from lmppo.registry import ADVANTAGE_ESTIMATORS, KL_CONTROLLERS, SAMPLING_ENGINES, TRACKERS


def test_kl_target_bounds_live_in_its_type():
    for bad, allowed in ((0, "must be > 0"), (-1.0, "must be > 0"), (2e6, "must be <= 1e+06")):
        with pytest.raises(ConfigError, match=re.escape(f"`kl.target` = {bad!r}: {allowed}")):
            KLConfig(target=bad)
    assert KLConfig(target="0.5").target == 0.5


def test_no_grad_batch_size_is_forward_batch_size_or_the_batch():
    cfg = Config()
    cfg.rollout.batch_size, cfg.rollout.forward_batch_size = 16, 0
    assert cfg.no_grad_batch_size == 16
    cfg.rollout.forward_batch_size = 4
    assert cfg.no_grad_batch_size == 4


def test_validate_runs_the_named_checks():
    cfg = Config()
    cfg.kl.controller, cfg.kl.coef_min, cfg.kl.coef_max = "pi", 1.0, 0.5
    with pytest.raises(ConfigError, match=r"`kl.coef_max` = 0.5: must be >= kl.coef_min \(1.0\)"):
        check_kl(cfg)
    with pytest.raises(ConfigError, match="kl.coef_max"):
        validate_config(cfg)


def test_a_name_registered_by_code_is_allowed_and_listed():
    with pytest.raises(ConfigError, match=r"`rollout.backend` = 'mine': must be one of `native`, `hf`, `vllm`"):
        Config().rollout.backend = "mine"
    SAMPLING_ENGINES.register("mine")(object)
    try:
        cfg = Config()
        cfg.rollout.backend = "mine"
        assert cfg.rollout.backend == "mine" and "mine" in SAMPLING_ENGINES.names()
    finally:
        del SAMPLING_ENGINES["mine"]
    assert "mine" not in SAMPLING_ENGINES


def test_registries_list_their_names_without_importing_the_implementations():
    assert KL_CONTROLLERS.names()[:3] == ("pi", "adaptive", "fixed")
    assert TRACKERS.builtins()[:3] == ("tensorboard", "wandb", "trackio")
    assert KL_CONTROLLERS.get("fixed").__name__ == "FixedKLController"  # imported on first use


def _outcome_advantage(rewards, values, mask, *, gamma, lam, group_ids=None):
    return rewards, rewards


class _GroupedAdvantage:
    """An entry-point plug-in's way: the trait as an attribute of the implementation."""

    needs_groups = True

    def __call__(self, rewards, values, mask, *, gamma, lam, group_ids=None):
        return rewards, rewards


@pytest.mark.parametrize("how", ["declared", "attribute", "none"])
def test_a_plugin_advantage_estimator_that_needs_groups_is_refused_without_them(how):
    register = {
        "declared": lambda: ADVANTAGE_ESTIMATORS.register("mine", needs_groups=True)(_outcome_advantage),
        "attribute": lambda: ADVANTAGE_ESTIMATORS.register("mine")(_GroupedAdvantage()),
        "none": lambda: ADVANTAGE_ESTIMATORS.register("mine")(_outcome_advantage),
    }[how]
    register()
    try:
        cfg = Config()
        cfg.ppo.advantage_estimator = "mine"
        cfg.rollout.num_samples_per_prompt = 1
        if how == "none":
            cfg.validate()  # no groups needed: one response per prompt is fine
        else:
            with pytest.raises(ConfigError, match=r"`ppo.advantage_estimator` = 'mine'.*num_samples_per_prompt >= 2"):
                cfg.validate()
        cfg.rollout.num_samples_per_prompt = 2
        cfg.validate()
    finally:
        del ADVANTAGE_ESTIMATORS["mine"]
