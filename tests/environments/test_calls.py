"""`lmppo.environments.calls`: calls in daemon threads, each within its limit, their outcomes in order."""

from __future__ import annotations

import asyncio
import sys
import threading

import pytest

from lmppo.environments.calls import CallTimeout, call_within, run_calls

FOREVER = threading.Event()  # never set


async def raises_its_own_timeout() -> None:
    raise TimeoutError("the environment's own")


async def twice(x: int) -> int:
    await asyncio.sleep(0)
    return 2 * x


def test_outcomes_in_order_values_errors_exits_and_timeouts():
    outcomes = run_calls([lambda: 1, lambda: sys.exit(4), FOREVER.wait, lambda: twice(3)], 4, 0.2)
    assert outcomes[0].value == 1 and outcomes[0].error is None and not outcomes[0].timed_out
    assert isinstance(outcomes[1].error, SystemExit) and outcomes[1].error.code == 4
    assert outcomes[2].timed_out and outcomes[2].error is None
    assert outcomes[3].value == 6  # an awaitable a call returns is awaited


def test_a_timeout_error_the_environment_raises_is_its_own_not_the_limit():
    (outcome,) = run_calls([raises_its_own_timeout], 1, 5.0)
    assert isinstance(outcome.error, TimeoutError) and not outcome.timed_out


def test_an_untimed_call_is_waited_for_and_call_within_names_what_timed_out():
    def slow() -> str:
        threading.Event().wait(0.3)
        return "done"

    assert [o.value for o in run_calls([slow, slow], 2, 0.1, untimed=[True, True])] == ["done", "done"]
    with pytest.raises(CallTimeout) as info:
        call_within(FOREVER.wait, 0.1, "tool `wait`")
    assert str(info.value) == "tool `wait` did not return within environment.step_timeout (0.1 s)"
