"""KL estimators (a registry) and KL coefficient controllers.

Per-token estimators of KL(pi || pi_ref) from the log-probabilities of the *sampled* token
(Schulman, "Approximating KL divergence", 2020). With log r = log pi_ref - log pi:
  k1 = -log r              unbiased, can be negative per token
  k2 = (log r)^2 / 2       biased, low variance, never negative
  k3 = (r - 1) - log r     unbiased, never negative
"""

from __future__ import annotations

from typing import Callable

import torch

KLEstimator = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
KL_ESTIMATORS: dict[str, KLEstimator] = {}


def register_kl_estimator(name: str) -> Callable[[KLEstimator], KLEstimator]:
    def wrap(fn: KLEstimator) -> KLEstimator:
        if name in KL_ESTIMATORS:
            raise ValueError(f"KL estimator {name!r} is already registered")
        KL_ESTIMATORS[name] = fn
        return fn
    return wrap


@register_kl_estimator("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) log pi - log pi_ref."""
    return logprobs - ref_logprobs


@register_kl_estimator("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) 0.5 * (log pi - log pi_ref)^2."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


@register_kl_estimator("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """(B, T) (r - 1) - log r with r = pi_ref / pi."""
    log_r = ref_logprobs - logprobs
    return torch.expm1(log_r) - log_r


class FixedKLController:
    """A constant KL coefficient."""

    def __init__(self, coef: float):
        self.value = coef

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (lm-human-preferences, `AdaptiveKLController`).

    After each batch of `n_steps` episodes with mean per-response KL `current_kl`:
      error = clip(current_kl / target - 1, -0.2, 0.2);  beta <- beta * (1 + error * n_steps / horizon)
    """

    def __init__(self, init_coef: float, target: float, horizon: int):
        self.value, self.target, self.horizon = init_coef, target, horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


KL_CONTROLLERS = {
    "fixed": lambda coef, target, horizon: FixedKLController(coef),
    "adaptive": lambda coef, target, horizon: AdaptiveKLController(coef, target, horizon),
}
