"""Registry traits: what a variant needs, declared where it is registered (built-in declaration, `register`, or an
attribute of a plug-in's implementation), read by `trait` without a list of names anywhere else."""

from __future__ import annotations

import pytest

from lmppo.errors import ConfigError
from lmppo.registry import ADVANTAGE_ESTIMATORS, KL_CONTROLLERS, KL_ESTIMATORS, Registry, builtin


def _registry() -> Registry[object]:
    # targets in a module that does not exist: reading a built-in's trait must not import it
    return Registry(
        "widget",
        "widget.kind",
        {"plain": "no_such_module:Plain", "grouped": builtin("no_such_module:Grouped", needs_groups=True)},
        traits={"needs_groups": False},
    )


def test_builtin_traits_are_read_from_the_declaration_without_importing():
    r = _registry()
    assert r.trait("grouped", "needs_groups") is True
    assert r.trait("plain", "needs_groups") is False  # the registry's default
    assert r.with_trait("needs_groups") == ("grouped",)
    with pytest.raises(ModuleNotFoundError):
        r.get("plain")  # the targets really are not importable: the reads above never imported them


def test_code_registration_declares_traits_and_unknown_traits_are_refused():
    r = _registry()
    r.register("mine", needs_groups=True)(object())
    assert r.trait("mine", "needs_groups") is True
    with pytest.raises(TypeError, match=r"unknown trait\(s\) \['needs_group'\]"):
        r.register("typo", needs_group=True)
    with pytest.raises(KeyError, match="no trait `colour`"):
        r.trait("mine", "colour")
    with pytest.raises(ConfigError, match=r"`widget.kind` = 'absent'"):
        r.trait("absent", "needs_groups")
    del r["mine"]
    r.register("mine")(object())  # the name again, without the trait: the old declaration went with it
    assert r.trait("mine", "needs_groups") is False


def test_a_plugin_declares_a_trait_as_an_attribute():
    """An entry-point plug-in has no declaration line: its implementation's attribute of the trait's name counts."""

    class Grouped:
        needs_groups = True

    r = _registry()
    r.register("attr")(Grouped)
    assert r.trait("attr", "needs_groups") is True
    r.register("declared_wins", needs_groups=False)(Grouped)
    assert r.trait("declared_wins", "needs_groups") is False


def test_the_builtins_declare_their_needs():
    assert ADVANTAGE_ESTIMATORS.with_trait("needs_groups") == ("rloo", "grpo")
    assert KL_ESTIMATORS.with_trait("full_logits") == ("exact",)
    assert [KL_CONTROLLERS.trait(name, "react") for name in ("pi", "adaptive", "fixed")] == ["now", "next", "next"]
