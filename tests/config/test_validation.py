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


class _GainedController:
    """A plug-in controller that reads `kl.kp` and `kl.horizon` as its gains (an attribute: an entry point's way)."""

    gains = ("kp", "horizon")


@pytest.mark.parametrize("how", ["declared", "attribute"])
def test_a_plugin_controllers_gains_are_checked_as_the_builtins_are(how):
    """check_kl holds the gains a controller declares (trait `gains`) to their bounds, whatever its name; the gains
    it does not declare are free."""
    if how == "declared":
        KL_CONTROLLERS.register("gained", gains=("kp", "horizon"))(object)
    else:
        KL_CONTROLLERS.register("gained")(_GainedController)
    try:
        cfg = Config()
        cfg.kl.controller, cfg.kl.kp = "gained", -1.0
        with pytest.raises(ConfigError, match=r"`kl.kp` = -1.0: must be >= 0"):
            check_kl(cfg)
        cfg.kl.kp, cfg.kl.horizon = 0.0, 0
        with pytest.raises(ConfigError, match=r"`kl.horizon` = 0: must be > 0"):
            check_kl(cfg)
        cfg.kl.horizon, cfg.kl.ki, cfg.kl.coef_min, cfg.kl.coef_max = 1, -1.0, 1.0, 0.5  # not its gains
        check_kl(cfg)
    finally:
        del KL_CONTROLLERS["gained"]


def test_the_builtin_controllers_gains_and_a_controller_without_any():
    assert KL_CONTROLLERS.trait("pi", "gains") == ("coef", "kp", "ki", "kd", "coef_min", "coef_max")
    assert KL_CONTROLLERS.trait("adaptive", "gains") == ("horizon",)
    cfg = Config()
    cfg.kl.controller, cfg.kl.coef, cfg.kl.kp, cfg.kl.horizon = "fixed", 0.0, -1.0, 0
    check_kl(cfg)  # fixed reads only coef, as its value: 0 is no KL term
    cfg.kl.controller = "adaptive"
    with pytest.raises(ConfigError, match=r"`kl.horizon` = 0: must be > 0"):
        check_kl(cfg)
    cfg.kl.controller = "pi"
    with pytest.raises(ConfigError, match=r"`kl.coef` = 0.0: must be > 0"):
        check_kl(cfg)


def test_a_controller_declaring_a_gain_that_is_no_kl_field_is_refused():
    KL_CONTROLLERS.register("typo", gains=("kpp",))(object)
    try:
        cfg = Config()
        cfg.kl.controller = "typo"
        with pytest.raises(ConfigError, match=r"`kl.controller` = 'typo': declares the gains \['kpp'\]"):
            check_kl(cfg)
    finally:
        del KL_CONTROLLERS["typo"]


def test_difficulty_filter_needs_groups():
    cfg = Config()
    cfg.data.retire_settled_after = 2
    cfg.rollout.num_samples_per_prompt = 1
    with pytest.raises(ConfigError, match=r"`data.retire_settled_after` = 2: .*num_samples_per_prompt >= 2"):
        cfg.validate()
    cfg.rollout.num_samples_per_prompt = 2
    cfg.validate()
    with pytest.raises(ConfigError, match=r"`data.retire_settled_after` = -1"):
        cfg.data.retire_settled_after = -1


def test_grpo_scale_needs_grpo_and_no_whitening():
    cfg = Config()
    cfg.ppo.grpo_scale = "none"
    with pytest.raises(ConfigError, match=r"`ppo.grpo_scale` = 'none': .*advantage_estimator `gae` has no group"):
        cfg.validate()
    cfg.ppo.advantage_estimator, cfg.rollout.num_samples_per_prompt = "grpo", 4
    with pytest.raises(ConfigError, match=r"`ppo.grpo_scale` = 'none': needs ppo.whiten_advantages false"):
        cfg.validate()
    cfg.ppo.whiten_advantages = False
    cfg.validate()
    cfg.ppo.grpo_scale = "batch"
    cfg.validate()
    with pytest.raises(ConfigError, match=r"`ppo.grpo_scale` = 'std'"):
        cfg.ppo.grpo_scale = "std"


def test_fixed_length_aggregation_is_for_single_responses():
    cfg = Config()
    cfg.ppo.loss_aggregation = "fixed_length"
    cfg.validate()
    cfg.environment.path, cfg.data.prompts = "guess_number", "builtin:guess_number"
    with pytest.raises(ConfigError, match=r"`ppo.loss_aggregation` = 'fixed_length': .*environment.path is set"):
        cfg.validate()
    cfg.ppo.loss_aggregation = "sequence_mean"
    cfg.validate()
    with pytest.raises(ConfigError, match=r"`ppo.loss_aggregation` = 'sum'"):
        cfg.ppo.loss_aggregation = "sum"


def test_overlong_buffer_fits_in_max_new_tokens():
    cfg = Config()
    cfg.rollout.max_new_tokens, cfg.reward.overlong_buffer = 24, 25
    with pytest.raises(
        ConfigError, match=r"`reward.overlong_buffer` = 25: must be at most rollout.max_new_tokens \(24\)"
    ):
        cfg.validate()
    cfg.reward.overlong_buffer = 24
    cfg.validate()
    with pytest.raises(ConfigError, match=r"`reward.overlong_penalty` = -1"):
        cfg.reward.overlong_penalty = -1
    cfg.environment.path, cfg.data.prompts = "guess_number", "builtin:guess_number"
    with pytest.raises(ConfigError, match=r"`reward.overlong_buffer` = 24: .*environment.path is set"):
        cfg.validate()
