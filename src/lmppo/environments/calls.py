"""Calls into an environment's code: in daemon threads, at most `concurrency` at once, each within a time limit
(`environment.step_timeout`, `environment.concurrency`).

A Python thread cannot be killed, so a call past its limit is abandoned, not stopped: its thread keeps running (and
keeps its environment alive) until the call returns or the process ends. The threads are daemons, so an abandoned
call never holds up the process's exit. concurrent.futures' pool is not used for this reason: the interpreter joins
its workers at exit, and one hung call would keep the process alive after the run ended.

A call that returns an awaitable (an `async def` method) is then awaited on an event loop of its own, in a daemon
thread, within the limit (`asyncio.wait_for`'s way), at most `concurrency` at once: an `async def` that blocks its
loop (a `time.sleep` in it) cannot stall the run or the other episodes' steps either.
"""

from __future__ import annotations

import asyncio
import inspect
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Awaitable, Callable, Optional, Sequence


@dataclass
class Outcome:
    """What one call gave: its value, the exception it raised (`SystemExit` included), or that it timed out."""

    value: object = None
    error: Optional[BaseException] = None
    timed_out: bool = False


class CallTimeout(Exception):
    """A call made inside an environment (a tool call) did not return within the limit; its text says which."""


def run_calls(
    calls: Sequence[Callable[[], object]], concurrency: int, timeout: float, untimed: Sequence[bool] = ()
) -> list[Outcome]:
    """Each call's outcome, in order: the calls run in daemon threads, at most `concurrency` at once, each given
    `timeout` seconds from its start (0: no limit; none for a call whose `untimed` is True: it times its own
    calls); awaitables they return are then awaited (`await_all`)."""
    limits = [0.0 if k < len(untimed) and untimed[k] else timeout for k in range(len(calls))]
    outcomes = _in_threads(calls, concurrency, limits)
    pending = [k for k, o in enumerate(outcomes) if o.error is None and inspect.isawaitable(o.value)]
    if pending:
        awaited = await_all([outcomes[k].value for k in pending], concurrency, timeout)  # type: ignore[misc]
        for k, outcome in zip(pending, awaited):
            outcomes[k] = outcome
    return outcomes


def call_within(call: Callable[[], object], timeout: float, what: str) -> object:
    """`call()`'s value, raising what it raised, or CallTimeout naming `what` when it runs past `timeout` seconds
    (0: no limit, called here)."""
    if timeout <= 0:
        return call()
    (outcome,) = run_calls([call], 1, timeout)
    if outcome.timed_out:
        raise CallTimeout(f"{what} did not return within environment.step_timeout ({timeout:g} s)")
    if outcome.error is not None:
        raise outcome.error
    return outcome.value


def _in_threads(calls: Sequence[Callable[[], object]], concurrency: int, limits: Sequence[float]) -> list[Outcome]:
    n = len(calls)
    outcomes: list[Optional[Outcome]] = [None] * n
    started: dict[int, float] = {}  # running calls: their start on the monotonic clock
    changed = threading.Condition()

    def work(k: int) -> None:
        try:
            outcome = Outcome(value=calls[k]())
        except BaseException as err:  # noqa: BLE001 - handed to the caller, SystemExit included
            outcome = Outcome(error=err)
        with changed:
            if outcomes[k] is None:  # not already given up on
                outcomes[k] = outcome
            changed.notify()

    following = 0
    with changed:
        while True:
            now = time.monotonic()
            for k in list(started):
                if outcomes[k] is None and limits[k] > 0 and now - started[k] >= limits[k]:
                    outcomes[k] = Outcome(timed_out=True)  # abandoned: its daemon thread runs on
                if outcomes[k] is not None:
                    del started[k]
            while following < n and len(started) < concurrency:
                started[following] = time.monotonic()
                threading.Thread(target=work, args=(following,), daemon=True, name="lmppo-environment").start()
                following += 1
            if not started:
                break
            deadlines = [started[k] + limits[k] for k in started if limits[k] > 0]
            changed.wait(max(0.0, min(deadlines) - time.monotonic()) if deadlines else None)
    return [o if o is not None else Outcome(timed_out=True) for o in outcomes]


def await_all(awaitables: Sequence[Awaitable[object]], concurrency: int, timeout: float) -> list[Outcome]:
    """Each awaitable's outcome, each awaited on an event loop of its own in a daemon thread, at most `concurrency`
    at once, within `timeout` seconds (0: no limit): `asyncio.wait` with the limit, then `cancel`, as
    `asyncio.wait_for` does (a TimeoutError the environment raises itself stays its own). The thread is given a
    second more, for an `async def` that blocks its loop and so cannot be cancelled."""
    calls = [partial(_await_within, aw, timeout) for aw in awaitables]
    outcomes = _in_threads(calls, concurrency, [timeout + 1.0 if timeout > 0 else 0.0] * len(calls))
    return [Outcome(timed_out=True) if isinstance(o.error, _TimedOut) else o for o in outcomes]


class _TimedOut(Exception):
    pass


def _await_within(awaitable: Awaitable[object], timeout: float) -> object:
    async def within() -> object:
        task = asyncio.ensure_future(awaitable)
        done, _ = await asyncio.wait({task}, timeout=timeout if timeout > 0 else None)
        if not done:
            task.cancel()
            raise _TimedOut
        return task.result()

    return asyncio.run(within())
