"""lmppo.trl.fields: every PPOConfig field in exactly one table, TRL's logged metric names."""

from __future__ import annotations

import dataclasses

from lmppo.trl import TRL_LOG_KEYS, PPOConfig
from lmppo.trl.fields import MAPPED, NO_EFFECT_IN_TRL, REFUSED_UNLESS_DEFAULT
from trl_support import TRL_LOG_HISTORY_KEYS


def test_the_logged_names_are_trls():
    assert set(TRL_LOG_KEYS) | {"epoch", "step"} == TRL_LOG_HISTORY_KEYS


def test_every_field_is_translated_inert_or_refused():
    names = {f.name for f in dataclasses.fields(PPOConfig)}
    assert set(MAPPED) | set(NO_EFFECT_IN_TRL) == names
    assert not set(MAPPED) & set(NO_EFFECT_IN_TRL)
    assert set(REFUSED_UNLESS_DEFAULT) <= set(MAPPED)
