"""Callbacks: user code the trainer calls at fixed points of a run, through the Python API.

    class StopAtScore(Callback):
        def on_iteration_end(self, trainer, metrics):
            if metrics["objective/scores"] > 0.9:
                trainer.stop()              # finishes this iteration, writes a checkpoint, then the final model

    PPOTrainer(cfg, ..., callbacks=[StopAtScore()]).train()

Every hook gets the trainer first (its `config`, `iteration`, `episode`, `policy`, `tokenizer`, `history`) and
returns nothing; the base class's hooks do nothing, so a callback overrides only what it needs. The hooks, in the
order they are called:

- ``on_train_begin(trainer)``: `train()` starts (also when a resumed run continues);
- ``on_evaluate(trainer, metrics)``: the held-out evaluation of `log.eval_every` finished; `metrics` holds its
  `eval/*` values (they are also in that iteration's record);
- ``on_log(trainer, metrics)``: the iteration's metrics were written to `metrics.jsonl` and the trackers (main
  process only; a callback may read them, changes to the dict are not written);
- ``on_iteration_end(trainer, metrics)``: the iteration is complete (every process), before its checkpoint;
- ``on_save(trainer, path)``: a checkpoint folder or the final model folder was written (main process);
- ``on_train_end(trainer, history)``: after the final model was saved; `history` is every iteration's metrics.

Departure from transformers' `TrainerCallback`: no `args, state, control` triple; the trainer itself is passed,
and `trainer.stop()` is the one control (`control.should_training_stop`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from lmppo.errors import LmppoError

if TYPE_CHECKING:
    from lmppo.training.trainer import PPOTrainer

HOOKS = ("on_train_begin", "on_evaluate", "on_log", "on_iteration_end", "on_save", "on_train_end")


class Callback:
    """Base class: every hook does nothing. Override the ones you need (see the module docstring)."""

    def on_train_begin(self, trainer: PPOTrainer) -> None: ...

    def on_evaluate(self, trainer: PPOTrainer, metrics: dict[str, float]) -> None: ...

    def on_log(self, trainer: PPOTrainer, metrics: dict[str, float]) -> None: ...

    def on_iteration_end(self, trainer: PPOTrainer, metrics: dict[str, float]) -> None: ...

    def on_save(self, trainer: PPOTrainer, path: str) -> None: ...

    def on_train_end(self, trainer: PPOTrainer, history: list[dict[str, float]]) -> None: ...


class CallbackList:
    """Calls a hook on every callback, in the order given. A callback need not subclass `Callback`: any object
    with some of the hook methods works (the others are skipped)."""

    def __init__(self, callbacks: object = None):
        items: Iterable[object]
        if callbacks is None:
            items = []
        elif isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable):
            items = [callbacks]
        else:
            items = callbacks
        self.callbacks: list[object] = list(items)
        for i, cb in enumerate(self.callbacks):
            if isinstance(cb, type):
                raise LmppoError(f"callbacks[{i}] is the class {cb.__name__}, not an instance: pass {cb.__name__}()")
            if not any(callable(getattr(cb, h, None)) for h in HOOKS):
                raise LmppoError(f"callbacks[{i}] ({type(cb).__name__}) has none of the hooks " + ", ".join(HOOKS))

    def __len__(self) -> int:
        return len(self.callbacks)

    def add(self, callback: object) -> None:
        self.callbacks.append(callback)

    def call(self, hook: str, *args: object) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, hook, None)
            if callable(fn):
                fn(*args)


def callback_list(callbacks: object) -> CallbackList:
    """`callbacks` as a CallbackList (one callback, a list of them, or None)."""
    return callbacks if isinstance(callbacks, CallbackList) else CallbackList(callbacks)
