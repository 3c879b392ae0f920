"""The training state's RNG part: capture and restore give back the same draws."""

from __future__ import annotations

import random

import numpy as np
import torch

from lmppo.run.state import RngState


def draws() -> tuple:
    return (random.random(), float(np.random.rand()), float(torch.rand(())))


def test_rng_state_round_trip():
    state = RngState.capture()
    first = draws()
    draws()  # move every generator on
    state.restore()
    assert draws() == first
