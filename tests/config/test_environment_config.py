"""The `environment:` section (lmppo.config.environment) and its checks between fields."""

from __future__ import annotations

import pytest

from lmppo.config import Config, EnvironmentConfig
from lmppo.errors import ConfigError


def test_defaults_mean_no_environment():
    e = EnvironmentConfig()
    assert (e.path, e.max_turns, e.tools, e.render) == ("", 4, [], "auto")
    with pytest.raises(ConfigError, match="environment.max_turns"):
        Config().environment.max_turns = 0


def test_config_checks_the_environment_section():
    cfg = Config()
    cfg.environment.path = "not a path"
    with pytest.raises(ConfigError, match="environment.path"):
        cfg.validate()
    cfg.environment.path = "tools"
    with pytest.raises(ConfigError, match="environment.tools"):
        cfg.validate()
    cfg = Config()
    cfg.environment.path = "guess_number"
    cfg.reward.sources = []  # an environment's step rewards are a reward of their own
    cfg.validate()
    cfg.kl.estimator = "exact"
    with pytest.raises(ConfigError, match="kl.estimator"):
        cfg.validate()
    cfg = Config()
    cfg.reward.sources = []
    with pytest.raises(ConfigError, match="reward.sources"):
        cfg.validate()
