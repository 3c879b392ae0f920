"""KL coefficient controllers: how beta moves so the KL per response holds the target (docs/reference_and_kl.md)."""

from __future__ import annotations

import math
from typing import Protocol

from lmppo.registry import KL_CONTROLLERS


class KLSettings(Protocol):
    """The KL settings a controller is built from: KLConfig's fields, duck-typed (core imports no config)."""

    @property
    def controller(self) -> str: ...
    @property
    def coef(self) -> float: ...
    @property
    def target(self) -> float: ...
    @property
    def horizon(self) -> int: ...
    @property
    def kp(self) -> float: ...
    @property
    def ki(self) -> float: ...
    @property
    def kd(self) -> float: ...
    @property
    def coef_min(self) -> float: ...
    @property
    def coef_max(self) -> float: ...


class KLController(Protocol):
    """How beta moves: `update` reads the mean KL per response of a batch (nats, summed over its tokens, over all
    processes), `coef` is the beta the trainer applies. state_dict / load_state_dict: JSON-able, for checkpoints
    (the coefficient under the key `value`)."""

    coef: float
    target: float | None  # the KL per response beta is moved to hold (`objective/kl_target`); None: no target

    def update(self, kl: float) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class FixedKLController:
    """A constant KL coefficient."""

    target = None  # no KL to hold

    def __init__(self, coef: float):
        self.coef = coef

    @classmethod
    def from_settings(cls, k: KLSettings, batch_size: int) -> "FixedKLController":
        return cls(k.coef)

    def update(self, kl: float) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["value"]


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (lm-human-preferences, `AdaptiveKLController`).

    After each batch of `batch_size` episodes with mean per-response KL `kl`:
      error = clip(kl / target - 1, -0.2, 0.2);  beta <- beta * (1 + error * batch_size / horizon)
    """

    def __init__(self, init_coef: float, target: float, horizon: int, batch_size: int):
        self.coef, self.target, self.horizon, self.batch_size = init_coef, target, horizon, batch_size

    @classmethod
    def from_settings(cls, k: KLSettings, batch_size: int) -> "AdaptiveKLController":
        return cls(k.coef, k.target, k.horizon, batch_size)

    def update(self, kl: float) -> None:
        proportional_error = min(max(kl / self.target - 1.0, -0.2), 0.2)
        self.coef *= 1.0 + proportional_error * self.batch_size / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.coef}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["value"]


class PIKLController:
    """Proportional-integral control of log beta toward a target KL per response (lmppo's default), with a
    look-ahead on the KL's rise.

    After each iteration with mean per-response KL `kl_t` (nats, summed over the response's tokens):
      ahead_t = kl_t + kd * max(kl_t - kl_{t-1}, 0)    where the KL will be next iteration if it keeps rising as it
                                                     just did (the derivative term: it brakes before the target)
      e_t = clip(log(ahead_t / target), -1, 1)         the error in log units: 2x and 0.5x the target weigh alike
      I_t = I_{t-1} + e_t                            always above the target; below it only while the KL is not
                                                     rising by itself (kl_t <= kl_{t-1}), and never while beta sits
                                                     at a bound that e_t pushes it past; I is set to 0 (before
                                                     adding e_t) the first time ahead_t reaches the target
      log beta_t = log beta_0 + kp * e_t + ki * I_t,  beta_t clamped to [coef_min, coef_max]

    Which batch the new beta penalises is the trainer's choice (`kl.react`): the batch just read (`now`, one
    iteration less delay around the loop) or the next one (`next`, Ziegler's and TRL's timing).

    Response time and the reasons for each term: docs/design.md, `lmppo.core.kl_control.PIKLController`.
    """

    def __init__(
        self,
        init_coef: float,
        target: float,
        kp: float = 1.0,
        ki: float = 0.5,
        coef_min: float = 1e-4,
        coef_max: float = 10.0,
        kd: float = 1.0,
    ):
        if not (init_coef > 0 and target > 0 and 0 < coef_min <= coef_max and kp >= 0 and ki >= 0 and kd >= 0):
            raise ValueError(
                "PIKLController needs init_coef > 0, target > 0, kp >= 0, ki >= 0, kd >= 0 and "
                f"0 < coef_min <= coef_max; got {init_coef}, {target}, {kp}, {ki}, {kd}, {coef_min}, "
                f"{coef_max}"
            )
        self.init_coef, self.target, self.kp, self.ki, self.kd = init_coef, target, kp, ki, kd
        self.coef_min, self.coef_max = coef_min, coef_max
        self.integral = 0.0
        self.arrived = False  # has the KL (read ahead) reached the target yet
        self.last_kl: float | None = None
        self.coef = min(max(init_coef, coef_min), coef_max)

    @classmethod
    def from_settings(cls, k: KLSettings, batch_size: int) -> "PIKLController":
        return cls(k.coef, k.target, k.kp, k.ki, k.coef_min, k.coef_max, k.kd)

    def error(self, current_kl: float) -> float:
        """clip(log(kl / target), -1, 1); a KL at or below 0 (or NaN) counts as far below target: -1."""
        if not current_kl > 0:
            return -1.0
        return min(max(math.log(current_kl / self.target), -1.0), 1.0)

    def update(self, kl: float) -> None:
        last, self.last_kl = self.last_kl, kl
        rising = last is not None and kl > last  # False for NaN readings
        ahead = kl + self.kd * (kl - last) if last is not None and rising else kl
        e = self.error(ahead)
        if not self.arrived and ahead >= self.target:  # first arrival: drop the windup of the climb
            self.arrived, self.integral = True, 0.0
        integrates = e > 0 or (last is not None and not rising)
        lo, hi = math.log(self.coef_min), math.log(self.coef_max)
        integral = self.integral + e if integrates else self.integral
        log_beta = math.log(self.init_coef) + self.kp * e + self.ki * integral
        if (log_beta > hi and e > 0) or (log_beta < lo and e < 0):  # anti-windup at the bounds
            integral = self.integral
            log_beta = math.log(self.init_coef) + self.kp * e + self.ki * integral
        self.integral = integral
        self.coef = math.exp(min(max(log_beta, lo), hi))

    def state_dict(self) -> dict:
        return {"value": self.coef, "integral": self.integral, "last_kl": self.last_kl, "arrived": self.arrived}

    def load_state_dict(self, state: dict) -> None:
        self.coef = state["value"]
        self.integral = state.get("integral", 0.0)
        self.last_kl = state.get("last_kl")
        self.arrived = state.get("arrived", True)  # saved before the arrival reset existed: never reset


def make_kl_controller(settings: KLSettings, batch_size: int) -> KLController:
    """The controller named by `settings.controller` (`lmppo.registry.KL_CONTROLLERS`), built by its `from_settings`;
    `settings` has KLConfig's fields (duck-typed, so the math layer needs no config import), `batch_size`: episodes
    per update (`rollout.batch_size`)."""
    return KL_CONTROLLERS.get(settings.controller).from_settings(settings, batch_size)
