"""`lmppo merge RUN RUN [...] --output DIR [--toward-start LAMBDA | --kl-budget NATS]`: average the policies of runs
that started from the same model (WARP's merging step, Ramé et al. 2024), optionally moved back toward that start.

Design notes: docs/design.md, `lmppo.apps.merge`."""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import asdict
from typing import Any, Callable, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from lmppo.apps.arguments import merge_parser
from lmppo.config import load_config
from lmppo.core.kl_budget import BudgetStep, search_lambda
from lmppo.errors import LmppoError
from lmppo.evaluation.evaluate import (
    LoadedModels,
    build_sources,
    eval_device,
    eval_plan,
    find_run,
    load_models,
    sample_trained,
)
from lmppo.models.files import is_adapter_folder
from lmppo.models.loading import resolve_model_path
from lmppo.run.layout import CONFIG, FINAL, POLICY
from lmppo.run.outputs import result_output
from lmppo.run.storage import atomic_dir, discard, temp_name, write_json, writing

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def policy_folder(path: str) -> str:
    """A run's output_dir (its `final/policy`) or a model folder (a LoRA adapter or full weights in safetensors)."""
    if not os.path.isdir(path):
        raise LmppoError(f"lmppo merge: {path!r}: no such folder; give a run's output_dir or a model folder")
    final = os.path.join(path, FINAL, POLICY)
    if os.path.isdir(final):
        return final
    if is_adapter_folder(path) or _weight_files(path):
        return path
    raise LmppoError(
        f"lmppo merge: {path!r} is neither a run (no final/policy) nor a model folder (no "
        f"{ADAPTER_CONFIG}, no *.safetensors)"
    )


def _weight_files(folder: str) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))


def merge_adapters(folders: Sequence[str], toward_start: float) -> tuple[dict[str, torch.Tensor], dict]:
    """(weights, adapter config) of the LoRA adapter whose weight change is `toward_start` times the mean of the
    adapters' changes B_i A_i (scale alpha / r each): A stacked, B side by side, B scaled by toward_start / K."""
    configs = [json.loads(open(os.path.join(f, ADAPTER_CONFIG)).read()) for f in folders]
    first = configs[0]
    for folder, cfg in zip(folders[1:], configs[1:]):
        for key in ("base_model_name_or_path", "r", "lora_alpha", "target_modules", "peft_type", "use_rslora"):
            if _comparable(key, cfg.get(key)) != _comparable(key, first.get(key)):
                raise LmppoError(
                    f"lmppo merge: {folder}: adapter_config.json `{key}` is {cfg.get(key)!r}, but "
                    f"{folders[0]} has {first.get(key)!r}; merge adapters of one base model and shape"
                )
    for folder, cfg in zip(folders, configs):
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_rslora"):
            raise LmppoError(
                f"lmppo merge: {folder}: adapters with rank_pattern, alpha_pattern or use_rslora are "
                "not supported (their scale is not alpha / r for every layer)"
            )
    states = [load_file(os.path.join(f, ADAPTER_WEIGHTS)) for f in folders]
    _same_tensors(folders, states)
    k = len(states)
    merged = {}
    for name, tensor in states[0].items():
        if ".lora_A." in name:
            merged[name] = torch.cat([s[name] for s in states], dim=0).contiguous()
        elif ".lora_B." in name:
            merged[name] = (torch.cat([s[name] for s in states], dim=1) * (toward_start / k)).to(tensor.dtype)
        else:
            raise LmppoError(
                f"lmppo merge: {folders[0]}: tensor {name!r} is neither a LoRA A nor a LoRA B "
                "factor (modules_to_save and bias adapters cannot be merged exactly)"
            )
    config = dict(first, r=first["r"] * k, lora_alpha=first["lora_alpha"] * k)
    return merged, config


def merge_full(folders: Sequence[str], toward_start: float, start: Optional[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per safetensors file: start + toward_start * (mean of the models - start), float tensors only (others must
    be equal and are copied)."""
    files = _weight_files(folders[0])
    for folder in folders[1:]:
        if _weight_files(folder) != files:
            raise LmppoError(
                f"lmppo merge: {folder} holds the weight files {_weight_files(folder)}, but "
                f"{folders[0]} holds {files}; merge models of one architecture"
            )
    if toward_start != 1.0 and start is None:
        raise LmppoError(
            "lmppo merge: --toward-start with full-weight models needs --start (the model the runs started from)"
        )
    out = {}
    for name in files:
        states = [load_file(os.path.join(f, name)) for f in folders]
        _same_tensors(folders, states)
        base = load_file(os.path.join(start, name)) if start is not None and toward_start != 1.0 else None
        if base is not None:
            _same_tensors([folders[0], start], [states[0], base])
        merged = {}
        for key, tensor in states[0].items():
            if not tensor.is_floating_point():
                if any(not torch.equal(s[key], tensor) for s in states[1:]):
                    raise LmppoError(f"lmppo merge: the non-float tensor {key!r} differs between the models")
                merged[key] = tensor
                continue
            mean = torch.stack([s[key].double() for s in states]).mean(0)
            if base is not None:
                mean = base[key].double() + toward_start * (mean - base[key].double())
            merged[key] = mean.to(tensor.dtype)
        out[name] = merged
    return out


def _comparable(key: str, value: Any) -> Any:
    """A base model given as a local folder compares by where it really is (clones of one cache, links)."""
    if key == "base_model_name_or_path" and isinstance(value, str) and os.path.isdir(value):
        return os.path.realpath(value)
    return sorted(value) if isinstance(value, list) else value


def _same_tensors(folders: Sequence[str], states: Sequence[dict[str, torch.Tensor]]) -> None:
    names = set(states[0])
    for folder, state in zip(folders[1:], states[1:]):
        if set(state) != names:
            missing = sorted(names ^ set(state))[:3]
            raise LmppoError(
                f"lmppo merge: {folder} and {folders[0]} hold different tensors (e.g. {missing}); "
                "merge models of one architecture"
            )
        for key, tensor in state.items():
            if tensor.shape != states[0][key].shape:
                raise LmppoError(
                    f"lmppo merge: {key!r} has shape {tuple(tensor.shape)} in {folder} but "
                    f"{tuple(states[0][key].shape)} in {folders[0]}"
                )


def merge(inputs: Sequence[str], output: str, toward_start: float = 1.0, start: Optional[str] = None) -> str:
    """Write the merged policy of `inputs` (runs or model folders) to the new folder `output`; returns it."""
    if toward_start < 0 or toward_start != toward_start:
        raise LmppoError(
            f"lmppo merge: --toward-start {toward_start}: must be >= 0 (1 keeps the averaged change, "
            "0 gives the start back)"
        )
    if len(inputs) < 2 and toward_start == 1.0:
        raise LmppoError("lmppo merge: give at least two runs (or one with --toward-start below 1)")
    _check_output(output)
    folders = _policy_folders(inputs)
    with result_output(output, "the merged policy", "`lmppo merge`"):  # checked writable before the work
        return _write_merge(folders, output, toward_start, start, None)


def _write_merge(
    folders: Sequence[str], output: str, toward_start: float, start: Optional[str], record: Optional[dict]
) -> str:
    """The merge of the policy folders `folders` into the new folder `output`; `record`: more for its merge.json."""
    with atomic_dir(output, "the merged policy") as tmp:
        for name in os.listdir(folders[0]):
            src = os.path.join(folders[0], name)
            if (
                os.path.isfile(src)
                and not name.endswith(".safetensors")
                and name not in (ADAPTER_CONFIG, "model.safetensors.index.json")
            ):
                shutil.copy(src, os.path.join(tmp, name))
        if is_adapter_folder(folders[0]):
            weights, config = merge_adapters(folders, toward_start)
            save_file(weights, os.path.join(tmp, ADAPTER_WEIGHTS))
            write_json(os.path.join(tmp, ADAPTER_CONFIG), config, "the merged adapter's config", indent=2)
        else:
            for name, weights in merge_full(folders, toward_start, start).items():
                save_file(weights, os.path.join(tmp, name), metadata={"format": "pt"})
            index = os.path.join(folders[0], "model.safetensors.index.json")
            if os.path.isfile(index):
                shutil.copy(index, os.path.join(tmp, "model.safetensors.index.json"))
        write_json(
            os.path.join(tmp, "merge.json"),
            {
                "inputs": [os.path.abspath(f) for f in folders],
                "toward_start": toward_start,
                "start": start,
                "method": "mean of the weight changes (WARP merge)",
            }
            | (record or {}),
            "the merge record",
            indent=1,
        )
    return output


def _check_output(output: str) -> None:
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise LmppoError(
            f"lmppo merge: --output {output!r} already exists and is not empty; nothing was written (give a new folder)"
        )


def _policy_folders(inputs: Sequence[str]) -> list[str]:
    folders = [policy_folder(p) for p in inputs]
    if len({is_adapter_folder(f) for f in folders}) > 1:
        raise LmppoError("lmppo merge: some inputs are LoRA adapters and some full models; merge one kind")
    return folders


# ----------------------------------------------------------------------------- choosing LAMBDA for a KL budget


class LambdaSetter:
    """Sets a loaded merged policy to LAMBDA times its weight change, in place: for a LoRA adapter its B factors
    (the change is linear in them), for full weights W_start + LAMBDA * (W_merged - W_start)."""

    def __init__(self, models: LoadedModels):
        self.params: list[tuple[torch.nn.Parameter, torch.Tensor, Optional[torch.Tensor]]] = []
        if models.start is None:  # an adapter on its base
            for name, p in models.policy.named_parameters():
                if ".lora_B." in name:
                    self.params.append((p, p.detach().clone(), None))
        else:
            start = dict(models.start.named_parameters())
            for name, p in models.policy.named_parameters():
                self.params.append((p, p.detach().clone(), start[name].detach()))
        if not self.params:
            raise LmppoError("lmppo merge: the merged policy has no weights to scale (no LoRA B factors)")

    @torch.no_grad()
    def set(self, toward_start: float) -> None:
        for p, merged, start in self.params:
            p.copy_(merged * toward_start if start is None else start + toward_start * (merged - start))


def check_budget_options(
    budget: float, tolerance: float = 0.1, max_evals: int = 5, samples_per_prompt: int = 4, command: str = "lmppo merge"
) -> None:
    """One LmppoError line, naming `command`, for a bad --kl-budget search option (before any model loads or
    trains)."""
    if not budget > 0 or math.isinf(budget):
        raise LmppoError(f"{command}: --kl-budget {budget}: must be a number of nats > 0")
    if not 0 < tolerance < 1:
        raise LmppoError(f"{command}: --tolerance {tolerance}: must be a fraction of the budget, in (0, 1)")
    if max_evals < 1:
        raise LmppoError(f"{command}: --max-evals {max_evals}: must be >= 1")
    if samples_per_prompt < 1:
        raise LmppoError(f"{command}: --samples-per-prompt {samples_per_prompt}: must be >= 1")


def merge_to_budget(
    inputs: Sequence[str],
    output: str,
    budget: float,
    *,
    start: Optional[str] = None,
    config: Optional[str] = None,
    seed: Optional[int] = None,
    samples_per_prompt: int = 4,
    tolerance: float = 0.1,
    max_evals: int = 5,
    say: Callable[[str], None] = print,
) -> tuple[str, BudgetStep, list[BudgetStep]]:
    """Merge `inputs` at the LAMBDA whose held-out KL to the start is `budget` nats per response (see the module's
    docstring); returns (output, the chosen step, every step)."""
    check_budget_options(budget, tolerance, max_evals, samples_per_prompt)
    _check_output(output)
    folders = _policy_folders(inputs)
    run_dir = find_run(inputs[0])[1]
    config = config or (os.path.join(run_dir, CONFIG) if run_dir else None)
    if config is None:
        raise LmppoError(
            f"lmppo merge: --kl-budget measures the KL on the runs' held-out prompts, but {inputs[0]!r} "
            "is not a run folder (no config.yaml beside final/); give the runs' config with --config"
        )
    cfg = load_config(config)
    cfg.validate()
    full = not is_adapter_folder(folders[0])
    if full and start is None:
        start = resolve_model_path(cfg.model.policy, "model.policy", cfg.model.allow_pickle)
    seed = cfg.seed if seed is None else seed
    device = eval_device(cfg)
    sources = build_sources(cfg, device)
    with result_output(output, "the merged policy", "`lmppo merge`"):  # checked writable before the work
        # the merge at LAMBDA 1, beside the output (a model's size: not in a small /tmp), under the output's temporary
        # name: a run of this command killed with SIGKILL leaves it, and the next one removes it (`result_output`)
        scratch = temp_name(output)
        with writing("the scratch merge (lambda 1)", scratch):
            os.makedirs(scratch)
        try:
            whole = _write_merge(folders, os.path.join(scratch, "merged"), 1.0, None, None)
            models = load_models(whole, start if full else None, cfg, None, device, config_given=True)
            plan = eval_plan(models, cfg, sources, seed=seed, samples_per_prompt=samples_per_prompt)
            setter = LambdaSetter(models)

            def measure(lam: float) -> BudgetStep:
                setter.set(lam)
                ev = sample_trained(models, plan)
                n = len(ev.kl_exact)
                sd = float(ev.kl_exact.std()) if n > 1 else 0.0
                step = BudgetStep(
                    lam, float(ev.kl_exact.mean()), sd / math.sqrt(n), float(ev.kl_k1.mean()), float(ev.total.mean())
                )
                say(
                    f"  lambda {lam:.3f}: held-out KL {step.kl_exact:.2f} nats (SE {step.kl_exact_se:.2f}; k1 "
                    f"{step.kl_k1:.2f}), score {step.score:+.3f}"
                )
                return step

            chosen, steps = search_lambda(measure, budget, tolerance, max_evals)
        finally:
            discard(scratch)
        record = {
            "kl_budget": {
                "budget": budget,
                "tolerance": tolerance,
                "config": os.path.abspath(config),
                "seed": seed,
                "prompts": plan.num_prompts,
                "samples_per_prompt": samples_per_prompt,
                "held_out": plan.held_out,
                "chosen": asdict(chosen),
                "steps": [asdict(s) for s in steps],
            }
        }
        _write_merge(folders, output, chosen.toward_start, start if full else None, record)
    return output, chosen, steps


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo merge`; returns the exit code. Mistakes raise LmppoError (one line from the CLI)."""
    args = merge_parser().parse_args(list(argv))
    say = console.print if console is not None else print
    if args.kl_budget is None:
        toward = 1.0 if args.toward_start is None else args.toward_start
        out = merge(args.inputs, args.output, toward, args.start)
        say(
            f"wrote {out}: the mean of {len(args.inputs)} policies' weight changes"
            + (f", times {toward:g}" if toward != 1.0 else "")
        )
        return 0
    if args.toward_start is not None:
        raise LmppoError("lmppo merge: give --toward-start or --kl-budget, not both (--kl-budget chooses LAMBDA)")
    say(f"choosing lambda for a held-out KL of {args.kl_budget:g} nats (within {args.tolerance:.0%}):")
    out, chosen, steps = merge_to_budget(
        args.inputs,
        args.output,
        args.kl_budget,
        start=args.start,
        config=args.config,
        seed=args.seed,
        samples_per_prompt=args.samples_per_prompt,
        tolerance=args.tolerance,
        max_evals=args.max_evals,
        say=say,
    )
    where = (
        "within the budget"
        if abs(chosen.kl_exact - args.kl_budget) <= args.tolerance * args.kl_budget
        else "the whole merge is under the budget"
        if chosen.toward_start == 1.0 and chosen.kl_exact < args.kl_budget
        else f"not within {args.tolerance:.0%} of the budget after {len(steps)} tries"
    )
    say(
        f"wrote {out}: the mean of {len(args.inputs)} policies' weight changes, times {chosen.toward_start:.3f}: "
        f"held-out KL {chosen.kl_exact:.2f} nats, score {chosen.score:+.3f} ({where})"
    )
    return 0
