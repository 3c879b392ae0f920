"""Evaluation of a policy on held-out prompts: `lmppo eval`, and the building block of the end-of-run summary.

Design notes: docs/design.md, `lmppo.evaluation.evaluate`."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Optional, Sequence

import torch
from torch import nn

from lmppo.config import BUILTIN_MODELS, Config, ModelConfig, hub_repo_id, load_config, parse_overrides, recipe_path
from lmppo.data.prompts import PromptSet, run_prompt_records, split_holdout, tokenize_prompts
from lmppo.environments.road import run_road
from lmppo.episodes.road import Road, autocast_for, environment_sources
from lmppo.errors import ConfigError, LmppoError
from lmppo.evaluation.arguments import eval_parser
from lmppo.evaluation.heldout import (
    EvalChoices,
    EvalPrompts,
    PolicyEval,
    RefLogits,
    compare,
    repeat_columns,
    repeat_prompts,
    sample_and_score,
)
from lmppo.evaluation.tables import EvalResult, default_judge, make_console, print_eval, watched
from lmppo.models.files import is_adapter_folder, load_whole
from lmppo.models.loading import load_policy, load_tokenizer, policy_forward, resolve_model_path
from lmppo.models.precision import choose_precision
from lmppo.models.reference import adapters_disabled
from lmppo.rewards import RewardSource, build_reward_sources, run_source_context
from lmppo.run.layout import CONFIG, FINAL, METRICS, POLICY
from lmppo.run.outputs import result_output
from lmppo.run.signals import go_on
from lmppo.run.storage import write_json
from lmppo.sampling.engines import OneProcess, SamplingEngine, engine_class
from lmppo.sampling.stop import stop_token_ids

if TYPE_CHECKING:
    from rich.console import Console
    from transformers import PreTrainedTokenizerBase

# ----------------------------------------------------------------------------- loading


@dataclass
class LoadedModels:
    policy: nn.Module
    tokenizer: PreTrainedTokenizerBase
    start: Optional[nn.Module]  # the starting point as its own model, or None when it is `policy` with adapters off
    model_path: str
    start_name: str
    run_dir: Optional[str]


def find_run(model: str) -> tuple[str, Optional[str]]:
    """(policy folder, run folder or None) for a run folder, `RUN/final/policy`, or any other model folder."""
    if os.path.isdir(os.path.join(model, FINAL, POLICY)):
        return os.path.join(model, FINAL, POLICY), model
    parent = os.path.dirname(os.path.dirname(os.path.abspath(model)))
    if os.path.basename(os.path.dirname(os.path.abspath(model))) == FINAL and os.path.isfile(
        os.path.join(parent, CONFIG)
    ):
        return model, parent
    return model, None


def _check_model_folder(path: str, what: str) -> None:

    if path in BUILTIN_MODELS or hub_repo_id(path) is not None:
        return
    if not os.path.isdir(path):
        raise LmppoError(
            f"{what} {path!r}: no such folder; give a run's output_dir, OUTPUT_DIR/final/policy, a model "
            "folder or a LoRA adapter folder"
        )
    if not (os.path.isfile(os.path.join(path, "config.json")) or is_adapter_folder(path)):
        if os.path.isfile(os.path.join(path, METRICS)):
            raise LmppoError(
                f"{what} {path!r} is a run folder without a final model (final/policy): the run did not "
                f"finish; {go_on(path)}, or evaluate one of its checkpoints"
            )
        raise LmppoError(f"{what} {path!r} holds no model (neither config.json nor adapter_config.json)")


def load_models(
    model_path: str,
    reference: Optional[str],
    cfg: Config,
    run_dir: Optional[str],
    device: torch.device,
    config_given: bool = False,
) -> LoadedModels:
    """The policy to evaluate (a LoRA adapter is loaded onto its base), its tokenizer, and its starting point.

    The starting point: `reference` if given; for an adapter, its base model with the adapter switched off;
    otherwise `cfg.model.policy` when `cfg` is the run's (in a run folder, or `config_given`)."""

    _check_model_folder(model_path, "model")
    mc = cfg.model
    model_path = resolve_model_path(model_path, "model", mc.allow_pickle)  # a Hub id: its downloaded folder
    if is_adapter_folder(model_path):
        try:
            from peft import PeftModel
        except ImportError:
            raise LmppoError(f"{model_path} is a LoRA adapter; loading it needs `peft` (pip install peft)") from None
        with open(os.path.join(model_path, "adapter_config.json"), encoding="utf-8") as fh:
            base_name = json.load(fh).get("base_model_name_or_path") or ""
        base = reference or base_name
        if not base:
            raise LmppoError(f"the adapter {model_path} does not name its base model; give it with --reference")
        if reference is None and not os.path.isdir(base) and hub_repo_id(base) is None:
            base = mc.policy  # the base folder moved (another machine, a cleared cache): the run's model.policy
        _check_model_folder(base, "base model")
        base_path = resolve_model_path(base, "--reference" if reference else "base model", mc.allow_pickle)
        tokenizer = load_tokenizer(
            model_path if os.path.isfile(os.path.join(model_path, "tokenizer_config.json")) else base_path, mc
        )
        from transformers import AutoModelForCausalLM

        base_model = load_whole(
            AutoModelForCausalLM.from_pretrained,
            base_path,
            "adapter's base model",
            mc.strict,
            dtype=torch.float32,
            trust_remote_code=mc.trust_remote_code,
        )
        policy = PeftModel.from_pretrained(base_model, model_path).eval()
        policy.to(device)
        return LoadedModels(policy, tokenizer, None, model_path, f"{base} (adapter off)", run_dir)
    start_name = reference or (mc.policy if run_dir is not None or config_given else None)
    if start_name is None:
        raise LmppoError(
            f"cannot tell where {model_path} started from (it is not in a run folder with a config.yaml); "
            "give the starting model with --reference, or the run's config with --config"
        )
    _check_model_folder(start_name, "reference")
    full = _full_weights(mc)
    tokenizer = load_tokenizer(model_path, mc)
    policy = load_policy(full, model_path).to(device)
    start = load_policy(
        full, resolve_model_path(start_name, "--reference" if reference else "model.policy", mc.allow_pickle)
    ).to(device)
    return LoadedModels(policy, tokenizer, start, model_path, start_name, run_dir)


def _full_weights(mc: ModelConfig) -> ModelConfig:
    out = copy.deepcopy(mc)
    out.lora.enabled = False
    return out


@contextmanager
def adapters_off(policy: nn.Module) -> Iterator[nn.Module]:
    with adapters_disabled(policy):
        yield policy


def eval_prompts(
    cfg: Config, tokenizer: PreTrainedTokenizerBase, num_prompts: int
) -> tuple[list[list[int]], list[str], bool]:
    """(ids, texts, held_out): the run's held-out prompts (`data.holdout`, the same seeded split as in training),
    or, when the run kept none out, `num_prompts` training prompts picked by a seeded permutation."""
    prompts, held_out = eval_prompt_set(cfg, tokenizer, num_prompts)
    return prompts.ids, prompts.texts, held_out


def eval_prompt_set(cfg: Config, tokenizer: PreTrainedTokenizerBase, num_prompts: int) -> tuple[PromptSet, bool]:
    """(prompts with their columns, held_out): the prompts of `eval_prompts`."""

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # long prompts were reported at training time
        prompts = tokenize_prompts(run_prompt_records(cfg), tokenizer, cfg.data)
    if cfg.data.holdout > 0:
        _, held = split_holdout(prompts, cfg.data.holdout, cfg.data.holdout_seed_for(cfg.seed))
        n = min(num_prompts, len(held.ids)) if num_prompts > 0 else len(held.ids)
        return held.subset(range(n)), True
    order = torch.randperm(len(prompts.ids), generator=torch.Generator().manual_seed(cfg.seed + 11)).tolist()
    return prompts.subset(order[: num_prompts if num_prompts > 0 else 64]), False


# ----------------------------------------------------------------------------- the command


def main(argv: Sequence[str], console: Optional[Console] = None) -> int:
    """`lmppo eval`; returns the exit code. User mistakes raise LmppoError (one line from the CLI)."""

    args, rest = eval_parser().parse_known_args(list(argv))
    overrides = parse_overrides(rest)
    model_path, run_dir = find_run(args.model)
    if not os.path.exists(model_path) and model_path not in BUILTIN_MODELS and hub_repo_id(model_path) is None:
        raise LmppoError(
            f"model {args.model!r}: no such folder; give a run's output_dir, OUTPUT_DIR/final/policy, a "
            "model folder, a LoRA adapter folder or a Hub model id (ORG/NAME)"
        )
    config_path = args.config or (os.path.join(run_dir, CONFIG) if run_dir else None)
    config_given = config_path is not None
    cfg = load_config(config_path or recipe_path("sentiment"), overrides)
    cfg.validate()
    if args.num_prompts < 0:
        raise LmppoError(f"--num-prompts {args.num_prompts}: must be >= 0")
    if args.samples_per_prompt < 1:
        raise LmppoError(f"--samples-per-prompt {args.samples_per_prompt}: must be >= 1")
    seed = cfg.seed if args.seed is None else args.seed
    device = eval_device(cfg)
    check_eval_engine(cfg)  # before any model loads
    sources = build_sources(cfg, device)
    judge = choose_judge(sources, args.judge, cfg)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Loading weights" bars: noise in a report
    beside = os.path.dirname(os.path.abspath(model_path)) if hub_repo_id(model_path) is None else os.getcwd()
    out = args.output or os.path.join(run_dir or beside, "eval.json")
    into_run = run_dir if run_dir and _inside(out, run_dir) else None
    # writable checked and the run's lock taken before the work, not after it (`lmppo.run.outputs`)
    with result_output(out, f"the evaluation ({os.path.basename(out)})", "`lmppo eval`", run_dir=into_run):
        models = load_models(model_path, args.reference, cfg, run_dir, device, config_given)
        result = evaluate_models(
            models,
            cfg,
            sources,
            seed=seed,
            judge=judge,
            num_prompts=args.num_prompts,
            samples_per_prompt=args.samples_per_prompt,
        )
        _write_json(result, out)
    if console is None:
        console = make_console()
    print_eval(result, console, show=args.show)
    console.print(f"wrote {out}")
    return 0


def _inside(path: str, folder: str) -> bool:
    return os.path.dirname(os.path.realpath(path)) == os.path.realpath(folder)


def eval_device(cfg: Config) -> torch.device:
    """Where evaluation runs: CUDA when there is one and `device` does not say `cpu`; `device: cuda` on a machine
    without one is refused before a model loads (as `lmppo train` refuses it)."""
    if cfg.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "cuda", "this machine has no CUDA GPU that torch can use; use `cpu` or `auto`")
    return torch.device("cuda" if cfg.device != "cpu" and torch.cuda.is_available() else "cpu")


def eval_precision(cfg: Config, device: torch.device) -> str:
    """The precision of an evaluation here: the config's, `auto` decided as a new run on this machine would."""
    return choose_precision(cfg.precision, device.type).precision


def build_sources(cfg: Config, device: torch.device) -> list[RewardSource]:
    """The config's reward sources, built as the trainer builds them (`rewards.run_source_context`: reward models
    under the run's bf16 autocast when the evaluation's precision is bf16)."""
    return build_reward_sources(cfg.reward, ctx=run_source_context(cfg, device, eval_precision(cfg, device)))


def scored_weights(sources: Sequence[RewardSource], cfg: Config) -> dict[str, float]:
    """Name -> weight of what an evaluation scores: the reward sources, and the environment's reward source when the
    run plays one (`environment.path`, `lmppo.episodes.road.environment_sources`)."""
    return {s.name: float(s.weight) for s in [*sources, *environment_sources(cfg.environment)]}


def choose_judge(sources: Sequence[RewardSource], judge: Optional[str], cfg: Optional[Config] = None) -> str:
    """`judge` checked against the source names (and `environment` with an environment), or the default judge (see
    `default_judge`)."""
    weights = scored_weights(sources, cfg) if cfg is not None else {s.name: float(s.weight) for s in sources}
    judge = judge or default_judge(weights, watched(sources))
    if judge not in weights:
        raise LmppoError(
            f"--judge {judge!r} is not a reward source of this config; sources: " + ", ".join(f"`{n}`" for n in weights)
        )
    return judge


def check_eval_engine(cfg: Config) -> type[SamplingEngine]:
    """The run's sampling engine (`rollout.backend`), if this machine runs it and it samples any model handed to it
    (evaluation samples two: the trained policy and its start); one ConfigError line otherwise, before models load."""
    name = cfg.rollout.backend
    engine = engine_class(name)
    engine.check(cfg)
    if not engine.samples_any_model:
        raise ConfigError(
            "rollout.backend",
            name,
            "this engine holds one model's weights, and lmppo eval samples two (the trained policy and its start); "
            "evaluate with an engine that samples any model (--rollout.backend native)",
        )
    return engine


@dataclass
class EvalPlan:
    """What both sides of an evaluation share: the prompts (each repeated per sample), the run's road (its engine,
    precision and reward sources), evaluation's choices, and the starting point's logits for the KL."""

    prompts: EvalPrompts
    shown: list[str]  # each prompt as a table shows it, repeated like `prompts.texts`
    num_prompts: int
    held_out: bool
    precision: str
    road: Road
    choices: EvalChoices
    start_logits: RefLogits


def eval_plan(
    models: LoadedModels,
    cfg: Config,
    sources: Sequence[RewardSource],
    *,
    seed: int,
    num_prompts: int = 0,
    samples_per_prompt: int = 4,
) -> EvalPlan:
    """The held-out prompts (`eval_prompt_set`), the run's road (`rollout.backend`'s engine at the precision a new
    run here would choose, the config's reward sources), and the starting point's logits (`models.start`, or the
    policy with its adapters off)."""

    tokenizer = models.tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    device = next(models.policy.parameters()).device
    prompt_set, held_out = eval_prompt_set(cfg, tokenizer, num_prompts)
    ids, texts = repeat_prompts(prompt_set.ids, prompt_set.texts, samples_per_prompt)
    prompts = EvalPrompts(ids, texts, repeat_columns(prompt_set.columns, samples_per_prompt))
    if not held_out:
        warnings.warn(
            "the run kept no prompts out of training (data.holdout = 0): evaluating on training prompts", stacklevel=3
        )
    r = cfg.rollout
    precision = eval_precision(cfg, device)
    autocast = autocast_for(precision, device)
    stop_ids = stop_token_ids(r.stop_token, tokenizer)
    engine = check_eval_engine(cfg)(cfg, stop_ids, tokenizer.pad_token_id, OneProcess(device))
    road = run_road(cfg, engine, tokenizer, stop_ids.tolist(), sources, autocast)  # with an environment: episodes

    def start_logits(input_ids: torch.Tensor, attention: torch.Tensor, P: int) -> torch.Tensor:
        if models.start is not None:
            return policy_forward(models.start, input_ids, attention, P, r.temperature).logits
        with adapters_off(models.policy):
            return policy_forward(models.policy, input_ids, attention, P, r.temperature).logits

    shown = [prompt_set.shown_text(i) for i in range(len(prompt_set)) for _ in range(samples_per_prompt)]
    choices = EvalChoices.of_run(cfg, seed)
    return EvalPlan(prompts, shown, len(prompt_set.ids), held_out, precision, road, choices, start_logits)


def sample_trained(models: LoadedModels, plan: EvalPlan) -> PolicyEval:
    """The policy's responses to the plan's prompts, scored, with their KL to the starting point."""
    return sample_and_score(plan.road, models.policy, plan.prompts, plan.choices, plan.start_logits)


def sample_start(models: LoadedModels, plan: EvalPlan) -> PolicyEval:
    """The starting point's responses to the plan's prompts, scored (its KL to itself is 0)."""
    if models.start is not None:
        return sample_and_score(plan.road, models.start, plan.prompts, plan.choices)
    with adapters_off(models.policy) as base:
        return sample_and_score(plan.road, base, plan.prompts, plan.choices)


def evaluate_models(
    models: LoadedModels,
    cfg: Config,
    sources: Sequence[RewardSource],
    *,
    seed: int,
    judge: Optional[str] = None,
    num_prompts: int = 0,
    samples_per_prompt: int = 4,
) -> EvalResult:
    """Sample, score and compare the trained policy and its starting point; the JSON-able result."""

    weights = scored_weights(sources, cfg)
    judge = choose_judge(sources, judge, cfg)
    plan = eval_plan(models, cfg, sources, seed=seed, num_prompts=num_prompts, samples_per_prompt=samples_per_prompt)
    trained = sample_trained(models, plan)
    start = sample_start(models, plan)
    wins = compare(trained, start)
    r = cfg.rollout
    return {
        "model": models.model_path,
        "start": models.start_name,
        "run_dir": models.run_dir,
        "prompts": plan.num_prompts,
        "samples_per_prompt": samples_per_prompt,
        "held_out": plan.held_out,
        "temperature": r.temperature,
        "max_new_tokens": r.max_new_tokens,
        "seed": seed,
        "precision": plan.precision,
        "backend": plan.road.engine_name,
        "judge": judge,
        "weights": weights,
        "watch": watched(sources),
        "trained": trained.means(),
        "start_point": {**start.means(), "kl": 0.0, "kl_k3": 0.0, "kl_exact": 0.0},
        "win_rate": wins[judge],
        "win_rate_by_source": wins,
        "samples": [
            {
                "prompt": plan.shown[i],
                "start": start.responses[i],
                "trained": trained.responses[i],
                "start_scores": {k: float(v[i]) for k, v in start.scores.items()},
                "trained_scores": {k: float(v[i]) for k, v in trained.scores.items()},
                "trained_kl": float(trained.kl_k1[i]) if trained.kl_k1 is not None else 0.0,
            }  # this response's log pi - log pi_start, summed (k1)
            for i in range(len(plan.prompts.ids))
        ],
    }


def _write_json(data: EvalResult, path: str) -> None:

    write_json(path, data, f"the evaluation ({os.path.basename(path)})", indent=2, default=_json_default)


def _json_default(v: object) -> str:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    raise TypeError(f"not JSON-able: {type(v).__name__}")
