"""Generation settings that keep sampling honest (lmppo.config.sampling_settings)."""

import pytest

from lmppo.config.sampling_settings import check_generation_kwargs
from lmppo.errors import ConfigError


def test_neutral_and_harmless_settings_pass():
    assert check_generation_kwargs({"top_k": 0, "top_p": 1.0, "use_cache": True}, allow_distorting=False) == []


def test_a_distorting_setting_is_refused_unless_allowed():
    with pytest.raises(ConfigError, match="rollout.generation_kwargs.*is refused: it changes the distribution"):
        check_generation_kwargs({"top_p": 0.9}, allow_distorting=False)
    assert check_generation_kwargs({"top_p": 0.9, "min_new_tokens": 4}, allow_distorting=True) == [
        "top_p",
        "min_new_tokens",
    ]


def test_settings_lmppo_owns_point_at_the_rollout_fields():
    with pytest.raises(ConfigError, match="generation_kwargs.temperature.*use the rollout fields"):
        check_generation_kwargs({"temperature": 0.7}, allow_distorting=True)


def test_an_unknown_setting_lists_what_is_known():
    with pytest.raises(ConfigError, match="generation_kwargs.top_q.*not a generation setting lmppo knows; allowed: "):
        check_generation_kwargs({"top_q": 3}, allow_distorting=True)
