"""Reward sources (a registry with one constructor signature) and scoring a rollout with them.

Design notes: docs/design.md, `lmppo.rewards.sources`."""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import inspect
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from lmppo.config import RewardConfig, RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.registry import REWARD_SOURCES
from lmppo.rewards.placement import BadOutput, parse_output, place_one, token_char_offsets

logger = logging.getLogger(__name__)

ON_BAD_OUTPUT = ("error", "drop")


@dataclass
class SourceContext:
    """What a source constructor may need besides its own config section."""

    device: str = "cpu"
    """Device for reward models."""
    allow_pickle: bool = False
    """Allow reward-model weights in pickle files (`.bin`, `.pt`)."""
    trust_remote_code: bool = False
    """Allow reward-model folders to run their own code."""
    strict: bool = True
    """Refuse a reward model whose weights do not match its config.json whole (`model.strict`)."""
    batch_size: int = 0
    """Sequences per reward-model forward pass; 0 means the whole batch."""
    dtype: Any = None
    """torch dtype for reward models; None keeps the checkpoint's (float32 for most small models)."""
    autocast_dtype: Any = None
    """Run reward-model forward passes under autocast to this dtype (`torch.bfloat16` with `precision: bf16`,
    like the policy's passes); None: no autocast. Scores are returned in float32 either way."""
    resolve_path: Callable[[str], str] | None = None
    """Turns a model name that is not a folder (`hub:ORG/NAME`, a built-in name) into a local folder."""


class RewardSource:
    """One reward signal: ``source(prompts, completions) -> list`` of one output per response.

    With ``wants_completion_ids`` True it is called as ``source(prompts, completions, completion_ids=ids)``; with
    ``wants_token_ids`` True as ``source(prompts, completions, token_ids=ids)``, each entry the whole sequence of
    policy token ids: the prompt without padding, then the response including its stop token."""

    kind: str = ""
    wants_completion_ids: bool = False
    wants_token_ids: bool = False
    wants_columns: bool = False
    """Called with ``columns=``: per response, its prompt's other columns (a dict)."""
    watch: str = ""
    """Non-empty for a warning-sign metric (higher is worse, e.g. completions collapsing): why to watch it. Tables
    label it so and never call its rise a win; read from a function's ``watch`` attribute."""

    def __init__(self, cfg: RewardSourceConfig, ctx: SourceContext):
        self.cfg = cfg
        self.name = cfg.name or default_name(cfg)
        self.weight = float(cfg.weight)
        self.span_placement = cfg.span_placement

    def __call__(self, prompts: list[str], completions: list[str]) -> list:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, weight={self.weight})"


def register_reward_source(kind: str) -> Callable[[type[RewardSource]], type[RewardSource]]:
    """Class decorator adding a source kind to ``lmppo.registry.REWARD_SOURCES``; a name registered twice is
    refused."""

    def deco(cls: type[RewardSource]) -> type[RewardSource]:
        REWARD_SOURCES.register(kind)(cls)
        cls.kind = kind
        return cls

    return deco


def _raised(err: BaseException) -> str:
    """`Type: message` of an exception from user code, bounded; SystemExit says it was an exit."""
    if isinstance(err, SystemExit):
        return (
            f"SystemExit (it called sys.exit({err.code!r:.60}) or exit(); user code must return or raise, "
            "not end the process)"
        )
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text if len(text) <= 300 else text[:300] + ' ...'}"


def mask_url(url: str) -> str:
    """The URL with any `user:password@` replaced by `***@` (safe to print)."""
    return re.sub(r"^([a-zA-Z][a-zA-Z0-9+.-]*://)[^/@]*@", r"\1***@", url)


def default_name(cfg: RewardSourceConfig) -> str:
    """A metric-friendly name derived from the source's path."""
    path = cfg.path
    if cfg.kind == "function":
        base = path.rsplit(":", 1)[-1]
    elif cfg.kind == "http":
        host = re.sub(r"^[a-z]+://", "", mask_url(path)).split("/")[0].split("@")[-1]
        base = "http_" + host.split(":")[0]
    else:
        base = os.path.basename(os.path.normpath(path.rsplit(":", 1)[-1])) or cfg.kind
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", base).strip("_") or cfg.kind


# ----------------------------------------------------------------------------- function sources

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
        cls, fn: Callable, name: str = "", weight: float = 1.0, span_placement: str = "last"
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
        given: dict[str, Any] = {"prompts": prompts, "completions": completions}
        if completion_ids is not None:
            given["completion_ids"] = completion_ids
        names = {k for row in columns or () for k in row}
        for name in sorted(names):
            if name not in KEYWORDS:
                given[name] = [row.get(name) for row in columns]
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
            raise RewardError(f"{what} `{spec}`: loading `{target}` failed with {_raised(err)}") from err
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
            raise RewardError(f"{what} `{spec}`: importing `{target}` failed with {_raised(err)}") from err
    if not hasattr(module, attr):
        names = [n for n in dir(module) if not n.startswith("_") and callable(getattr(module, n, None))]
        hint = difflib.get_close_matches(attr, names, n=1)
        extra = f" (did you mean `{hint[0]}`?)" if hint else ""
        raise RewardError(f"{what} `{spec}`: `{target}` has no attribute `{attr}`{extra}")
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"{what} `{spec}`: `{attr}` is a {type(fn).__name__}, not callable")
    return fn


# ----------------------------------------------------------------------------- building


def build_reward_sources(
    reward_cfg: RewardConfig,
    functions: dict[str, Callable] | Sequence[Callable] | None = None,
    device: str = "cpu",
    ctx: SourceContext | None = None,
) -> list[RewardSource]:
    """The sources of ``reward_cfg.sources`` plus the callables given through the API.

    ``functions``: a list of callables, or a name -> callable dict. A dict key equal to the ``path`` of a
    ``function`` source in the config binds that callable to that source (so its weight, name and span placement
    come from the config); every other callable becomes an extra source with weight 1 and ``last`` placement,
    named by its key (dict) or its ``__name__`` (list). A RewardSource instance is used as it is.
    Names must be unique (they become the `reward/<name>` metrics): repeated ones get `_2`, `_3`, ...
    """
    ctx = ctx or SourceContext(device=device)
    given: dict[str, Any] = dict(functions) if isinstance(functions, dict) else {}
    extra: list[tuple[str, Any]] = []
    if isinstance(functions, dict):
        bound = {s.path for s in reward_cfg.sources if s.kind == "function"}
        extra = [(k, f) for k, f in given.items() if k not in bound]
    elif functions is not None:
        if callable(functions):
            functions = [functions]
        extra = [("", f) for f in functions]
    sources: list[RewardSource] = []
    for i, scfg in enumerate(reward_cfg.sources):
        if scfg.kind not in REWARD_SOURCES:
            hint = difflib.get_close_matches(scfg.kind, list(REWARD_SOURCES), n=1)
            raise RewardError(
                f"reward.sources[{i}].kind = {scfg.kind!r}: must be one of "
                + ", ".join(f"`{k}`" for k in REWARD_SOURCES)
                + (f" (did you mean `{hint[0]}`?)" if hint else "")
            )
        if scfg.kind == "function" and scfg.path in given:
            sources.append(FunctionSource(scfg, ctx, fn=given[scfg.path]))
        else:
            sources.append(REWARD_SOURCES[scfg.kind](scfg, ctx))
    for name, fn in extra:
        sources.append(fn if isinstance(fn, RewardSource) else FunctionSource.from_callable(fn, name=name))
    seen: dict[str, int] = {}
    for s in sources:
        base = s.name
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > 1:
            s.name = f"{base}_{seen[base]}"
    return sources


# ----------------------------------------------------------------------------- scoring


@dataclass
class RewardResult:
    token_scores: torch.Tensor  # (B, T) float, weighted sum over sources of placed scores; 0 where masked/invalid
    valid: torch.Tensor  # (B,) bool, False for samples some source gave a bad output (on_bad_output=drop)
    per_source: dict[str, torch.Tensor]  # name -> (B,) float, the source's unweighted total per response (0 if invalid)
    final_scores: torch.Tensor  # (B,) float, the weighted sum of the scalar outputs alone: the part of token_scores
    #                             that judges a response as a whole (on its last token); 0 where invalid
    num_invalid: int  # samples marked invalid
    problems: list[str] = field(default_factory=list)  # one line per bad output that was dropped


def score_rollout(
    sources: Sequence[RewardSource],
    prompts_text: Sequence[str],
    completions_text: Sequence[str],
    response_ids: torch.Tensor,
    response_mask: torch.Tensor,
    tokenizer: Any,
    on_bad_output: str = "error",
    terminated: torch.Tensor | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    columns: Sequence[dict] | None = None,
) -> RewardResult:
    """Call every source on the batch, check and place its outputs, and sum them with the sources' weights.

    ``response_ids``: (B, T) long, right-padded; ``response_mask``: (B, T) bool, True on real response tokens
    (stop token included). ``terminated``: (B,) bool, the response ends with its stop token (that token is not in
    the completion text); None infers it per response by decoding. ``tokenizer``: the policy's (spans are mapped
    through it). With ``on_bad_output="error"`` a bad output raises RewardError naming the source, the sample
    and the value; with ``"drop"`` the sample is marked invalid (all its scores 0) and counted.
    ``prompt_ids``: each prompt's token ids without padding; needed by sources that read token ids
    (``wants_token_ids``, a reward model with ``input: tokens``). ``columns``: per response, its prompt's other
    columns (dicts; see ``lmppo.data.prompts.PromptSet.columns``), for sources that take them (``wants_columns``).
    """
    if on_bad_output not in ON_BAD_OUTPUT:
        raise ValueError(f"on_bad_output {on_bad_output!r}: must be one of {ON_BAD_OUTPUT}")
    mask = response_mask.bool()
    B, T = mask.shape
    if len(prompts_text) != B or len(completions_text) != B:
        raise ValueError(f"{len(prompts_text)} prompts and {len(completions_text)} completions for {B} responses")
    if columns is not None and len(columns) != B:
        raise ValueError(f"{len(columns)} column rows for {B} responses")
    readers = [s.name for s in sources if s.wants_token_ids]
    if readers and (prompt_ids is None or len(prompt_ids) != B):
        raise ValueError(
            f"reward source `{readers[0]}` reads token ids: score_rollout needs the {B} prompts' ids (prompt_ids)"
        )
    lengths = mask.sum(dim=1).tolist()
    ids_cpu = response_ids.detach().cpu()
    offsets_cache: dict[int, list[tuple[int, int]]] = {}

    def offsets(i: int) -> list[tuple[int, int]]:
        if i not in offsets_cache:
            has_stop = bool(terminated[i]) if terminated is not None else None
            try:
                offsets_cache[i] = token_char_offsets(
                    tokenizer, ids_cpu[i, : lengths[i]].tolist(), text=completions_text[i], has_stop=has_stop
                )
            except ValueError as err:  # the rollout decoded differently: not the source's fault
                raise RewardError(f"sample {i}: cannot map spans to tokens: {err}") from None
        return offsets_cache[i]

    valid = [True] * B
    problems: list[str] = []

    def bad(source: RewardSource, i: int | None, msg: str, cause: BaseException | None = None) -> None:
        where = f"sample {i}" if i is not None else f"the whole batch of {B}"
        line = f"reward source `{source.name}`, {where}: {msg}"
        if on_bad_output == "error":
            raise RewardError(line) from cause
        problems.append(line)
        for j in [i] if i is not None else range(B):
            valid[j] = False

    placed: list[torch.Tensor] = []
    scalars: list[torch.Tensor] = []  # per source, (B,) its scalar outputs (0 where it gave another form)
    for source in sources:
        rows = torch.zeros(B, T, dtype=torch.float32)
        scalar = torch.zeros(B, dtype=torch.float32)
        placed.append(rows)
        scalars.append(scalar)
        extra: dict[str, Any] = {}
        if source.wants_token_ids:
            extra["token_ids"] = [list(prompt_ids[i]) + ids_cpu[i, : lengths[i]].tolist() for i in range(B)]
        elif source.wants_completion_ids:
            extra["completion_ids"] = [ids_cpu[i, : lengths[i]].tolist() for i in range(B)]
        if source.wants_columns and columns is not None:
            extra["columns"] = [dict(row) for row in columns]  # a copy: user code cannot change the data
        try:
            outputs = source(list(prompts_text), list(completions_text), **extra)
        except (Exception, SystemExit) as err:  # noqa: BLE001 - any failure of user code is reported, not re-thrown raw
            bad(source, None, f"raised {_raised(err)}", err)
            continue
        if isinstance(outputs, torch.Tensor) or type(outputs).__module__ == "numpy":
            outputs = outputs.tolist()
        if not isinstance(outputs, (list, tuple)) or len(outputs) != B:
            got = (
                f"{len(outputs)} outputs"
                if isinstance(outputs, (list, tuple))
                else f"a {type(outputs).__name__} ({_short(outputs)})"
            )
            bad(source, None, f"returned {got}; expected a list of {B} (one per response)")
            continue
        for i, out in enumerate(outputs):
            try:
                kind, payload = parse_output(out, lengths[i], len(completions_text[i]))
            except BadOutput as err:
                bad(source, i, f"{err} (value {_short(out)})")
                continue
            off = offsets(i) if kind == "spans" and payload else None
            rows[i] = place_one(kind, payload, lengths[i], T, off, source.span_placement)
            if kind == "scalar":
                scalar[i] = payload

    keep = torch.tensor(valid, dtype=torch.bool)
    token_scores = torch.zeros(B, T, dtype=torch.float32)
    final_scores = torch.zeros(B, dtype=torch.float32)
    per_source = {}
    for source, rows, scalar in zip(sources, placed, scalars):
        rows = rows * mask * keep[:, None]
        token_scores += source.weight * rows
        final_scores += source.weight * scalar * keep
        per_source[source.name] = rows.sum(dim=1)
    if problems:
        logger.warning(
            "dropped %d of %d samples with bad reward outputs; first: %s", B - int(keep.sum()), B, problems[0]
        )
    device = response_mask.device
    return RewardResult(
        token_scores=token_scores.to(device),
        valid=keep.to(device),
        per_source={k: v.to(device) for k, v in per_source.items()},
        final_scores=final_scores.to(device),
        num_invalid=B - int(keep.sum()),
        problems=problems,
    )


def _short(x: Any, n: int = 80) -> str:
    r = repr(x)
    return r if len(r) <= n else r[: n - 3] + "..."
