"""KL control: the PI controller against hand-worked values, and `kl.target` / `ppo.target_kl` reaching the run."""

from __future__ import annotations

import math
import types

import pytest
import torch

from conftest import PROMPTS, small_config, tiny_llama
from lmppo.config import Config
from lmppo.core.kl_control import AdaptiveKLController, FixedKLController, PIKLController, make_kl_controller
from lmppo.errors import ConfigError
from lmppo.registry import KL_CONTROLLERS
from lmppo.training.metrics import MetricsAccumulator
from lmppo.training.trainer import PPOTrainer


def test_pi_controller_hand_worked_sequence():
    # beta_0 0.05, target 4, kp 1, ki 0.5, kd 1.  ahead = kl + max(kl - kl_prev, 0);  e = clip(ln(ahead/4), -1, 1)
    # ln beta = ln 0.05 + e + 0.5 * I;  I integrates e above the target, and below it only when the KL is not rising
    c = PIKLController(0.05, 4.0, kp=1.0, ki=0.5, kd=1.0)
    steps = [
        # kl 8, first reading: e = ln 2, above target: I = ln 2; beta = 0.05 * 2 * 2^0.5
        (8.0, 0.05 * 2**1.5, math.log(2)),
        # kl 9 after 8: rose by 1, read as 10: e = ln 2.5; I = ln 2 + ln 2.5 = ln 5; beta = 0.05 * 2.5 * 5^0.5
        (9.0, 0.05 * 2.5 * 5**0.5, math.log(5)),
        # kl 6 after 9: falling, still above target: integrates e = ln 1.5; I = ln 7.5
        (6.0, 0.05 * 1.5 * 7.5**0.5, math.log(7.5)),
        # kl 40 after 6: read as 74, e clipped to 1; I = ln 7.5 + 1
        (40.0, 0.05 * math.e * math.exp(0.5) * 7.5**0.5, math.log(7.5) + 1),
        # kl 0 after 40: e = -1 (no information at or below 0), not rising: I = ln 7.5
        (0.0, 0.05 * math.exp(-1) * 7.5**0.5, math.log(7.5)),
        # kl -3 (a negative estimate): e = -1, not rising: I = ln 7.5 - 1
        (-3.0, 0.05 * math.exp(-1) * 7.5**0.5 * math.exp(-0.5), math.log(7.5) - 1),
        # kl 2 after -3: rose by 5, read as 7: e = ln 1.75 > 0 (the look-ahead brakes early): I = ln 7.5 - 1 + ln 1.75
        (2.0, 0.05 * 1.75 * (7.5 * 1.75) ** 0.5 * math.exp(-0.5), math.log(7.5 * 1.75) - 1),
        # kl 2.5 after 2: read as 3: e = ln 0.75 < 0 while rising: no integration
        (2.5, 0.05 * 0.75 * (7.5 * 1.75) ** 0.5 * math.exp(-0.5), math.log(7.5 * 1.75) - 1),
    ]
    for kl, beta, integral in steps:
        c.update(kl)
        assert c.coef == pytest.approx(beta, rel=1e-12)
        assert c.integral == pytest.approx(integral, rel=1e-12)
    assert [round(b, 6) for _, b, _ in steps] == [
        0.141421,
        0.279508,
        0.205396,
        0.613681,
        0.050374,
        0.030553,
        0.19227,
        0.082401,
    ]


def test_pi_controller_drops_the_windup_of_the_climb_on_arrival():
    # beta_0 0.05, target 4, kp 1, ki 0.5, kd 1: a climb that stalls twice winds the integral down
    c = PIKLController(0.05, 4.0, kp=1.0, ki=0.5, kd=1.0)
    c.update(1.0)  # first reading, e = ln 0.25 (-1.386) clipped to -1, not yet a rise or a stall: I = 0
    assert c.coef == pytest.approx(0.05 * math.exp(-1)) and c.integral == 0.0
    c.update(0.8)  # stalled: e = ln 0.2 -> -1, integrates: I = -1; beta = 0.05 e^-1 e^-0.5
    assert c.coef == pytest.approx(0.05 * math.exp(-1.5)) and c.integral == pytest.approx(-1.0)
    c.update(1.6)  # rising, read as 2.4: e = ln 0.6, no integration; beta = 0.05 * 0.6 * e^-0.5
    assert c.coef == pytest.approx(0.05 * 0.6 * math.exp(-0.5)) and c.integral == pytest.approx(-1.0)
    c.update(1.2)  # stalled: e = ln 0.3 (-1.204) -> -1: I = -2
    assert c.coef == pytest.approx(0.05 * math.exp(-2)) and c.integral == pytest.approx(-2.0)
    c.update(2.2)  # rising by 1, read as 3.2: e = ln 0.8, below target: I stays -2
    assert c.coef == pytest.approx(0.05 * 0.8 * math.exp(-1)) and c.integral == pytest.approx(-2.0)
    c.update(3.0)  # rising by 0.8, read as 3.8: still short of the target
    assert c.coef == pytest.approx(0.05 * 0.95 * math.exp(-1)) and c.integral == pytest.approx(-2.0)
    # rising by 0.6, read as 4.2: arrives. I = 0 + ln 1.05; beta = 0.05 * 1.05 ** 1.5 (not 1.05 ** 1.5 / e)
    c.update(3.6)
    assert c.arrived and c.integral == pytest.approx(math.log(1.05))
    assert c.coef == pytest.approx(0.05 * 1.05**1.5)
    # after the arrival the integral runs as before: a stall below the target winds it down again, and a second
    # arrival does not reset it
    c.update(2.0)  # stalled: e = ln 0.5, I = ln 1.05 + ln 0.5 = ln 0.525
    c.update(2.0)  # stalled again: I = ln(0.525 * 0.5)
    assert c.integral == pytest.approx(math.log(0.2625))
    c.update(4.4)  # rising by 2.4, read as 6.8: e = ln 1.7, integrates: I = ln(0.2625 * 1.7)
    assert c.integral == pytest.approx(math.log(0.2625 * 1.7))
    assert c.coef == pytest.approx(0.05 * 1.7 * (0.2625 * 1.7) ** 0.5)
    # the arrival survives a checkpoint, and a checkpoint from before the reset existed never resets
    restored = PIKLController(0.05, 4.0)
    restored.load_state_dict(c.state_dict())
    assert restored.arrived
    legacy = PIKLController(0.05, 4.0)
    legacy.load_state_dict({"value": 0.02, "integral": -2.0, "last_kl": 1.0})
    legacy.update(8.0)
    assert legacy.integral == pytest.approx(-2.0 + 1.0)  # read as 15: e clipped to 1, I not reset


def test_pi_controller_look_ahead_gain():
    # the same readings with kd 0: the KL is read as it is
    c = PIKLController(0.05, 4.0, kp=1.0, ki=0.5, kd=0.0)
    c.update(2.0)  # e = ln 0.5, first reading, below target: no integration
    assert c.coef == pytest.approx(0.05 * 0.5) and c.integral == 0.0
    c.update(3.0)  # rising, below target, e = ln 0.75: no integration
    assert c.coef == pytest.approx(0.05 * 0.75) and c.integral == 0.0
    fast = PIKLController(0.05, 4.0, kp=1.0, ki=0.5, kd=2.0)
    fast.update(2.0)
    fast.update(3.0)  # rose by 1, read as 3 + 2 * 1 = 5: e = ln 1.25, integrates
    assert fast.coef == pytest.approx(0.05 * 1.25**1.5) and fast.integral == pytest.approx(math.log(1.25))


def test_pi_controller_holds_its_bounds_without_winding_up():
    c = PIKLController(0.05, 4.0, coef_max=0.1)
    c.update(40.0)  # e = 1: ln beta = ln 0.05 + 1 -> above the bound: beta clamped
    assert c.coef == pytest.approx(0.1) and c.integral == 0.0
    c.update(40.0)  # integrating would push further past the bound: no windup
    assert c.coef == pytest.approx(0.1) and c.integral == 0.0
    c.update(4.0)  # on target: e = 0 -> beta back to beta_0 at once (no stored windup to unwind)
    assert c.coef == pytest.approx(0.05)
    low = PIKLController(0.05, 4.0, coef_min=0.04)
    low.update(0.0)
    low.update(0.0)
    assert low.coef == pytest.approx(0.04) and low.integral == 0.0


def test_pi_controller_state_round_trip_and_gains():
    a = PIKLController(0.05, 4.0)
    for kl in (1.0, 3.0, 9.0):
        a.update(kl)
    b = PIKLController(0.05, 4.0)
    b.load_state_dict(a.state_dict())
    a.update(5.0)
    b.update(5.0)
    assert a.coef == b.coef and a.integral == b.integral
    # kp 0 and ki 0: beta never moves
    still = PIKLController(0.05, 4.0, kp=0.0, ki=0.0)
    for kl in (0.0, 100.0, 3.0):
        still.update(kl)
    assert still.coef == pytest.approx(0.05)
    # a KL stuck at twice the target: x**(kp+ki) at once, then x**ki per iteration
    twice = PIKLController(0.05, 4.0, kp=1.0, ki=0.5)
    twice.update(8.0)
    assert twice.coef == pytest.approx(0.05 * 2**1.5)
    twice.update(8.0)
    assert twice.coef == pytest.approx(0.05 * 2**2)
    twice.update(8.0)
    assert twice.coef == pytest.approx(0.05 * 2**2.5)
    with pytest.raises(ValueError):
        PIKLController(0.0, 4.0)


def test_make_kl_controller_reads_every_setting():
    k = types.SimpleNamespace(
        controller="pi", coef=0.2, target=3.0, kp=2.0, ki=0.25, kd=0.7, coef_min=0.01, coef_max=5.0, horizon=77
    )
    c = make_kl_controller(k, 8)
    assert isinstance(c, PIKLController)
    assert (c.coef, c.target, c.kp, c.ki, c.kd, c.coef_min, c.coef_max) == (0.2, 3.0, 2.0, 0.25, 0.7, 0.01, 5.0)
    k.controller = "adaptive"
    z = make_kl_controller(k, 8)
    assert isinstance(z, AdaptiveKLController) and (z.coef, z.target, z.horizon, z.batch_size) == (0.2, 3.0, 77, 8)
    k.controller = "fixed"
    assert isinstance(make_kl_controller(k, 8), FixedKLController)


@pytest.mark.parametrize(
    "field,value,allowed",
    [
        ("kl.controller", "pid", "fixed"),
        ("kl.kp", -1.0, ">= 0"),
        ("kl.ki", -0.1, ">= 0"),
        ("kl.kd", -0.5, ">= 0"),
        ("kl.coef_min", 0.0, "> 0"),
        ("kl.coef_max", 1e-5, ">= kl.coef_min"),
        ("ppo.target_kl", -0.01, ">= 0"),
        ("kl.coef", 0.0, "> 0"),
        ("kl.react", "later", "now"),
    ],
)
def test_bad_kl_settings_name_the_field(field, value, allowed):
    cfg = Config()
    section, name = field.split(".")
    with pytest.raises(ConfigError) as err:  # on assignment (a choice, a sign) or in validate (a relation)
        setattr(getattr(cfg, section), name, value)
        cfg.validate()
    assert field in str(err.value) and allowed in str(err.value)


def _tiny_run(tmp_path, tokenizer, name, iterations=3, **fields):
    """Iterations of 8 episodes, 4 epochs x 2 minibatches, on the tiny Llama with a length reward. The k3 estimator
    reads a KL >= 0 from any sample, so "the policy moved, the reading is above a small target" does not depend on
    which tokens the sampler's stream happens to draw (k1's batch mean can be negative)."""
    fields = {"kl__estimator": "k3", **fields}
    cfg = small_config(
        tmp_path / name, iterations=iterations, batch=8, ppo__num_epochs=4, ppo__learning_rate=3e-3, **fields
    )
    trainer = PPOTrainer(
        cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS, reward_functions=[_length_reward]
    )
    return trainer.train()


def _length_reward(prompts, completions):
    return [len(c) / 20.0 for c in completions]


def test_kl_target_changes_the_run(tmp_path, tokenizer):
    # kl.react next: iteration t runs on the beta of the readings before it, so the indices below are those readings
    low = _tiny_run(tmp_path, tokenizer, "low", iterations=4, kl__react="next", kl__target=1e-4)
    high = _tiny_run(tmp_path, tokenizer, "high", iterations=4, kl__react="next", kl__target=100.0)
    assert low[0]["objective/kl_coef"] == high[0]["objective/kl_coef"] == 0.05  # the first rollout: beta_0
    assert all(m["objective/kl_target"] == 1e-4 for m in low) and high[-1]["objective/kl_target"] == 100.0
    assert low[0]["objective/kl"] == 0.0  # policy == reference: the first reading is below any target
    # once the policy has moved, beta follows each run's own target: up for a KL above it, not for one below
    assert low[1]["objective/kl"] == high[1]["objective/kl"] > 1e-4
    assert low[2]["objective/kl_coef"] > 4 * high[2]["objective/kl_coef"]
    # and the training that follows differs
    assert low[3]["objective/kl"] != high[3]["objective/kl"]


def test_kl_gains_change_the_run(tmp_path, tokenizer):
    a = _tiny_run(tmp_path, tokenizer, "a", kl__react="next", kl__target=1e-4)
    b = _tiny_run(tmp_path, tokenizer, "b", kl__react="next", kl__target=1e-4, kl__kp=3.0)
    assert b[1]["objective/kl_coef"] == pytest.approx(0.05 * math.exp(-3))
    assert a[1]["objective/kl_coef"] == pytest.approx(0.05 * math.exp(-1))
    c = _tiny_run(tmp_path, tokenizer, "c", kl__react="next", kl__target=1e-4, kl__ki=2.0)  # integrates from reading 2
    assert (
        a[1]["objective/kl_coef"] == c[1]["objective/kl_coef"] and a[2]["objective/kl_coef"] < c[2]["objective/kl_coef"]
    )
    d = _tiny_run(tmp_path, tokenizer, "d", kl__react="next", kl__target=1e-4, kl__coef_max=0.06)
    assert d[2]["objective/kl_coef"] == pytest.approx(0.06) and a[2]["objective/kl_coef"] > 0.06
    e = _tiny_run(tmp_path, tokenizer, "e", kl__react="next", kl__target=1e-4, kl__coef_min=0.04)
    assert e[1]["objective/kl_coef"] == pytest.approx(0.04) and a[1]["objective/kl_coef"] < 0.04
    # the look-ahead: a KL rising from 0 toward a far target reads as past it with a huge kd, as itself with kd 0
    f = _tiny_run(tmp_path, tokenizer, "f", kl__react="next", kl__target=10.0, kl__kd=1e9)
    g = _tiny_run(tmp_path, tokenizer, "g", kl__react="next", kl__target=10.0, kl__kd=0.0)
    assert f[1]["objective/kl"] > f[0]["objective/kl"] and g[1]["objective/kl"] > g[0]["objective/kl"]
    assert f[2]["objective/kl_coef"] > 0.05 > g[2]["objective/kl_coef"]


@pytest.mark.parametrize("react", ["now", "next"])
def test_kl_react_sets_when_beta_answers_a_batch(tmp_path, tokenizer, react):
    """`now`: a batch's own rewards carry the beta its KL asks for; `next`: that beta waits for the next batch."""
    run = _tiny_run(tmp_path, tokenizer, react, iterations=4, kl__target=0.5, kl__react=react)
    shadow = PIKLController(0.05, 0.5)  # the defaults' gains, fed the run's own readings
    for m in run:
        if react == "now":
            shadow.update(m["objective/kl"])
        assert m["objective/kl_coef"] == pytest.approx(shadow.coef, rel=1e-12)
        # the batch's penalty used that beta: non-score reward = -beta * KL per response
        assert m["objective/non_score_reward"] == pytest.approx(-shadow.coef * m["objective/kl"], rel=1e-5, abs=1e-12)
        if react == "next":
            shadow.update(m["objective/kl"])
    assert run[0]["objective/kl"] == 0.0 and run[1]["objective/kl"] > 0.0  # readings that move beta


def test_kl_react_auto_is_now_for_pi_and_next_for_adaptive(tmp_path, tokenizer):
    pi = _tiny_run(tmp_path, tokenizer, "pi", iterations=1, kl__target=0.5)
    assert pi[0]["objective/kl_coef"] == pytest.approx(0.05 * math.exp(-1))  # read KL 0 at once: error -1
    ziegler = _tiny_run(
        tmp_path, tokenizer, "ziegler", iterations=2, kl__controller="adaptive", kl__target=0.5, kl__horizon=8
    )
    assert ziegler[0]["objective/kl_coef"] == 0.05  # Ziegler's timing: beta_0 on the first batch
    assert ziegler[1]["objective/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 8))
    now = _tiny_run(
        tmp_path,
        tokenizer,
        "ziegler-now",
        iterations=1,
        kl__controller="adaptive",
        kl__target=0.5,
        kl__horizon=8,
        kl__react="now",
    )
    assert now[0]["objective/kl_coef"] == pytest.approx(0.05 * (1 - 0.2 * 8 / 8))


def test_ppo_target_kl_stops_the_epochs(tmp_path, tokenizer):
    free = _tiny_run(tmp_path, tokenizer, "free")
    braked = _tiny_run(tmp_path, tokenizer, "braked", ppo__target_kl=1e-6)
    assert "ppo/updates" not in free[0]  # the brake's metrics appear only when it is on
    planned = 4 * 2  # epochs x minibatches
    for m in braked:
        # the first step sees the rollout policy itself (approx KL 0), the second sees a moved one and stops
        assert m["ppo/early_stop"] == 1.0 and 2 <= m["ppo/updates"] < planned
    assert braked[1]["objective/kl"] != free[1]["objective/kl"]
    loose = _tiny_run(tmp_path, tokenizer, "loose", ppo__target_kl=1e6)
    assert all(m["ppo/updates"] == planned and m["ppo/early_stop"] == 0.0 for m in loose)
    assert loose[-1]["objective/kl"] == free[-1]["objective/kl"]  # a brake never reached changes nothing


def test_recent_mean_reads_only_the_last_values():
    acc = MetricsAccumulator()
    for v in (10.0, 1.0, 2.0, 3.0):
        acc.add("x", torch.tensor(v))
    assert acc.recent_mean("x", 3) == pytest.approx(2.0)
    assert acc.mean("x") == pytest.approx(4.0)


class _HalvingController:
    """A plug-in controller: beta halves at every reading, whatever the KL."""

    def __init__(self, coef: float) -> None:
        self.coef = coef

    @classmethod
    def from_settings(cls, k, batch_size):
        return cls(k.coef)

    def update(self, kl: float) -> None:
        self.coef /= 2

    def state_dict(self) -> dict:
        return {"value": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["value"]


class _HalvingNow(_HalvingController):
    react = "now"  # an entry-point plug-in's way to declare it: an attribute


@pytest.mark.parametrize("how", ["declared now", "declared next", "attribute now", "undeclared"])
def test_a_plugin_controller_declares_when_it_reacts(tmp_path, tokenizer, how):
    """`kl.react: auto` follows the controller's trait `react` (the registry's default: `next`)."""
    register = {
        "declared now": lambda: KL_CONTROLLERS.register("halving", react="now")(_HalvingController),
        "declared next": lambda: KL_CONTROLLERS.register("halving", react="next")(_HalvingController),
        "attribute now": lambda: KL_CONTROLLERS.register("halving")(_HalvingNow),
        "undeclared": lambda: KL_CONTROLLERS.register("halving")(_HalvingController),
    }[how]
    register()
    try:
        run = _tiny_run(tmp_path, tokenizer, "halving", iterations=2, kl__controller="halving", kl__coef=0.08)
    finally:
        del KL_CONTROLLERS["halving"]
    first = 0.04 if how.endswith(" now") else 0.08  # now: the first batch already carries the halved beta
    assert all("objective/kl_target" not in m for m in run)  # a controller without a target: none reported
    assert [m["objective/kl_coef"] for m in run] == [first, first / 2]
