"""Python functions as reward sources (`kind: function`): how a function is called, read from its signature, and
importing user code (`module:function` or `path/to/file.py:function`) with one error line when it cannot be."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from typing import Callable, Sequence

from lmppo.config import RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.rewards.sources import RewardSource, SourceContext, SpanPlacement, raised_text, register_reward_source

KEYWORDS = ("prompts", "completions", "completion_ids")
"""The arguments lmppo itself provides to a reward function; every other name is a column of the prompt data."""


@register_reward_source("function")
class FunctionSource(RewardSource):
    """A Python callable returning one output per response. How it is called is read from its signature:

    * **by keyword** (TRL's convention) when it has a parameter named ``completions``, or cannot take two
      positional arguments (``def f(**kwargs)``): ``fn(prompts=..., completions=..., completion_ids=..., <column>=...)``
      with each of these it names, and all of them when it has ``**kwargs``. E.g.
      ``def accuracy(completions, solution, **kwargs)`` gets the ``solution`` column of the prompt data.
    * **by position** otherwise: ``fn(prompts, completions)`` (``lambda p, c: ...``), plus by keyword
      ``completion_ids`` and the columns it names (all of them with ``**kwargs``).

    Every value is a list with one entry per response: ``prompts`` and ``completions`` are strings,
    ``completion_ids`` each response's token ids (stop token included, one per entry of a per-token list), a
    column the value of that field of the response's prompt record (None where a record lacks it). A required
    parameter that is none of these is refused before training (``check_arguments``).

    ``cfg.path`` is ``module.sub:function`` (imported) or ``path/to/file.py:function`` (loaded from the file).
    """

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext, fn: Callable | None = None):
        super().__init__(cfg, ctx)
        self.fn = fn if fn is not None else import_callable(cfg.path)
        if not callable(self.fn):
            raise RewardError(f"reward function `{cfg.path or self.name}` is a {type(self.fn).__name__}, not callable")
        self.watch = str(getattr(self.fn, "watch", "") or "")
        params, self.takes_kwargs, positional = _signature(self.fn)
        self.by_keyword = "completions" in params or len(positional) < 2
        if not self.by_keyword:  # its first two positional parameters take prompts and completions
            params = {p: required for p, required in params.items() if p not in positional[:2]}
        self.params = params
        """Parameters given by keyword (name -> whether required)."""
        self.wants_completion_ids = "completion_ids" in params or self.takes_kwargs
        self.wants_columns = self.takes_kwargs or any(p not in KEYWORDS for p in params)
        self.required = [p for p, required in params.items() if required and p not in KEYWORDS]

    @classmethod
    def from_callable(
        cls, fn: Callable, name: str = "", weight: float = 1.0, span_placement: SpanPlacement = "last"
    ) -> "FunctionSource":
        """A source from a callable handed over through the Python API."""
        if not callable(fn):
            raise RewardError(f"reward function {name or fn!r} is a {type(fn).__name__}, not callable")
        name = name or getattr(fn, "__name__", "") or type(fn).__name__
        if name == "<lambda>":
            name = "lambda"
        cfg = RewardSourceConfig(kind="function", path="", name=name, weight=weight, span_placement=span_placement)
        return cls(cfg, SourceContext(), fn=fn)

    def check_arguments(self, column_names: Sequence[str]) -> None:
        """RewardError when a required parameter is neither lmppo's own argument nor a column of the prompt data."""
        missing = [p for p in self.required if p not in column_names]
        if missing:
            have = ", ".join(f"`{c}`" for c in column_names) or "none besides the prompt"
            hint = difflib.get_close_matches(missing[0], list(column_names), n=1)
            raise RewardError(
                f"reward function `{self.name}` takes `{missing[0]}`, which is not a column of the "
                f"prompt data (columns: {have})"
                + (f"; did you mean `{hint[0]}`?" if hint else "")
                + "; arguments are prompts, completions, completion_ids and the prompt data's columns "
                "by name (give the parameter a default, or add the field to the prompt records)"
            )

    def __call__(
        self,
        prompts: list[str],
        completions: list[str],
        completion_ids: list[list[int]] | None = None,
        columns: Sequence[dict] | None = None,
    ) -> list:
        given: dict[str, object] = {"prompts": prompts, "completions": completions}
        if completion_ids is not None:
            given["completion_ids"] = completion_ids
        rows = columns or ()
        names = {k for row in rows for k in row}
        for name in sorted(names):
            if name not in KEYWORDS:
                given[name] = [row.get(name) for row in rows]
        kwargs = {k: v for k, v in given.items() if self.takes_kwargs or k in self.params}
        if self.by_keyword:
            return self.fn(**kwargs)
        kwargs.pop("prompts", None), kwargs.pop("completions", None)
        return self.fn(prompts, completions, **kwargs)


def _signature(fn: Callable) -> tuple[dict[str, bool], bool, list[str]]:
    """(parameters that can be given by keyword -> whether required, takes **kwargs, the names of the parameters
    that take positional arguments, `*` standing for *args). A callable without a signature counts as
    ``fn(*args)``: called by position."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return {}, False, ["*", "*"]
    named = {p.name: p.default is p.empty for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    kwargs = any(p.kind is p.VAR_KEYWORD for p in params)
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        positional += ["*", "*"]
    return named, kwargs, positional


def check_source_arguments(sources: Sequence[RewardSource], column_names: Sequence[str]) -> None:
    """Before training: every function source can be called with lmppo's arguments and these columns."""
    for s in sources:
        if isinstance(s, FunctionSource):
            s.check_arguments(column_names)


def import_callable(spec: str, what: str = "reward function") -> Callable:
    """Resolve `module:function` or `path/to/file.py:function` (RewardError when it cannot; `what` names the object
    in the message: an environment class and tools are imported the same way)."""
    if ":" not in spec:
        raise RewardError(f"{what} `{spec}`: must look like `module:function` or `file.py:function`")
    target, attr = spec.rsplit(":", 1)  # rsplit: a Windows path keeps its drive letter
    if not target or not attr:
        raise RewardError(f"{what} `{spec}`: must look like `module:function` or `file.py:function`")
    if target.endswith(".py") or os.sep in target or "/" in target:
        if not os.path.isfile(target):
            raise RewardError(f"{what} `{spec}`: no such file `{target}`")
        mod_name = "lmppo_reward_" + re.sub(r"\W", "_", os.path.abspath(target))
        try:
            loader_spec = importlib.util.spec_from_file_location(mod_name, target)
            module = importlib.util.module_from_spec(loader_spec)  # type: ignore[arg-type]
            sys.modules[mod_name] = module
            loader_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except (Exception, SystemExit) as err:  # SystemExit: a module that exits when imported
            sys.modules.pop(mod_name, None)
            raise RewardError(f"{what} `{spec}`: loading `{target}` failed with {raised_text(err)}") from err
    else:
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as err:
            if err.name and target != err.name and not target.startswith(err.name + "."):
                raise RewardError(
                    f"{what} `{spec}`: importing `{target}` failed: it needs module "
                    f"`{err.name}`, which is not installed"
                ) from err
            raise RewardError(
                f"{what} `{spec}`: no module named `{target}` (is it installed, or on "
                "PYTHONPATH? a file can be given as `path/to/file.py:function`)"
            ) from err
        except (Exception, SystemExit) as err:
            raise RewardError(f"{what} `{spec}`: importing `{target}` failed with {raised_text(err)}") from err
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        hint = difflib.get_close_matches(attr, names, n=1)
        extra = f" (did you mean `{hint[0]}`?)" if hint else ""
        raise RewardError(f"{what} `{spec}`: `{target}` has no attribute `{attr}`{extra}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{what} `{spec}`: `{attr}` is a {type(fn).__name__}, not callable")
    return fn
