"""`lmppo merge RUN RUN [...] --output DIR [--toward-start LAMBDA]`: average the policies of runs that started
from the same model (WARP's merging step, Ramé et al. 2024), optionally moved back toward that start.

Runs from one start with different seeds each drift in directions of their own besides the one the reward asks
for. Averaging their weight changes keeps what they share and shrinks the rest, so the merged policy spends fewer
nats of KL on the reward it keeps (measured in docs/choosing.md). `--toward-start LAMBDA` scales the averaged
change by LAMBDA (WARP's interpolation toward the initialisation): 1 keeps it, 0 gives the start back.

LoRA runs: the mean of the weight changes B_i A_i is itself a LoRA adapter, exactly: the A_i stacked (rank
r * K) and the B_i side by side, times LAMBDA / K, with lora_alpha scaled by K so that alpha / r stays.
Full-weight runs: W = W_start + LAMBDA * (mean of the W_i - W_start); the start (`--start`) is needed only when
LAMBDA is not 1. The other files (tokenizer, chat template) come from the first input.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any, Optional, Sequence

import torch
from safetensors.torch import load_file, save_file

from lmppo.errors import LmppoError
from lmppo.model_files import is_adapter_folder
from lmppo.storage import atomic_dir, write_json

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def policy_folder(path: str) -> str:
    """A run's output_dir (its `final/policy`) or a model folder (a LoRA adapter or full weights in safetensors)."""
    if not os.path.isdir(path):
        raise LmppoError(f"lmppo merge: {path!r}: no such folder; give a run's output_dir or a model folder")
    final = os.path.join(path, "final", "policy")
    if os.path.isdir(final):
        return final
    if is_adapter_folder(path) or _weight_files(path):
        return path
    raise LmppoError(f"lmppo merge: {path!r} is neither a run (no final/policy) nor a model folder (no "
                     f"{ADAPTER_CONFIG}, no *.safetensors)")


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
                raise LmppoError(f"lmppo merge: {folder}: adapter_config.json `{key}` is {cfg.get(key)!r}, but "
                                 f"{folders[0]} has {first.get(key)!r}; merge adapters of one base model and shape")
    for folder, cfg in zip(folders, configs):
        if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("use_rslora"):
            raise LmppoError(f"lmppo merge: {folder}: adapters with rank_pattern, alpha_pattern or use_rslora are "
                             "not supported (their scale is not alpha / r for every layer)")
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
            raise LmppoError(f"lmppo merge: {folders[0]}: tensor {name!r} is neither a LoRA A nor a LoRA B "
                             "factor (modules_to_save and bias adapters cannot be merged exactly)")
    config = dict(first, r=first["r"] * k, lora_alpha=first["lora_alpha"] * k)
    return merged, config


def merge_full(folders: Sequence[str], toward_start: float, start: Optional[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per safetensors file: start + toward_start * (mean of the models - start), float tensors only (others must
    be equal and are copied)."""
    files = _weight_files(folders[0])
    for folder in folders[1:]:
        if _weight_files(folder) != files:
            raise LmppoError(f"lmppo merge: {folder} holds the weight files {_weight_files(folder)}, but "
                             f"{folders[0]} holds {files}; merge models of one architecture")
    if toward_start != 1.0 and start is None:
        raise LmppoError("lmppo merge: --toward-start with full-weight models needs --start (the model the runs "
                         "started from)")
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
            raise LmppoError(f"lmppo merge: {folder} and {folders[0]} hold different tensors (e.g. {missing}); "
                             "merge models of one architecture")
        for key, tensor in state.items():
            if tensor.shape != states[0][key].shape:
                raise LmppoError(f"lmppo merge: {key!r} has shape {tuple(tensor.shape)} in {folder} but "
                                 f"{tuple(states[0][key].shape)} in {folders[0]}")


def merge(inputs: Sequence[str], output: str, toward_start: float = 1.0, start: Optional[str] = None) -> str:
    """Write the merged policy of `inputs` (runs or model folders) to the new folder `output`; returns it."""
    if toward_start < 0 or toward_start != toward_start:
        raise LmppoError(f"lmppo merge: --toward-start {toward_start}: must be >= 0 (1 keeps the averaged change, "
                         "0 gives the start back)")
    if len(inputs) < 2 and toward_start == 1.0:
        raise LmppoError("lmppo merge: give at least two runs (or one with --toward-start below 1)")
    if os.path.exists(output) and (not os.path.isdir(output) or os.listdir(output)):
        raise LmppoError(f"lmppo merge: --output {output!r} already exists and is not empty; nothing was written "
                         "(give a new folder)")
    folders = [policy_folder(p) for p in inputs]
    kinds = {is_adapter_folder(f) for f in folders}
    if len(kinds) > 1:
        raise LmppoError("lmppo merge: some inputs are LoRA adapters and some full models; merge one kind")
    with atomic_dir(output, "the merged policy") as tmp:
        for name in os.listdir(folders[0]):
            src = os.path.join(folders[0], name)
            if os.path.isfile(src) and not name.endswith(".safetensors") and name not in (ADAPTER_CONFIG,
                                                                                        "model.safetensors.index.json"):
                shutil.copy(src, os.path.join(tmp, name))
        if kinds == {True}:
            weights, config = merge_adapters(folders, toward_start)
            save_file(weights, os.path.join(tmp, ADAPTER_WEIGHTS))
            write_json(os.path.join(tmp, ADAPTER_CONFIG), config, "the merged adapter's config", indent=2)
        else:
            for name, weights in merge_full(folders, toward_start, start).items():
                save_file(weights, os.path.join(tmp, name), metadata={"format": "pt"})
            index = os.path.join(folders[0], "model.safetensors.index.json")
            if os.path.isfile(index):
                shutil.copy(index, os.path.join(tmp, "model.safetensors.index.json"))
        write_json(os.path.join(tmp, "merge.json"), {"inputs": [os.path.abspath(f) for f in folders],
                                                     "toward_start": toward_start, "start": start,
                                                     "method": "mean of the weight changes (WARP merge)"},
                   "the merge record", indent=1)
    return output


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lmppo merge", description=__doc__.split("\n\n")[0])
    p.add_argument("inputs", nargs="+", help="runs (their final/policy) or model folders, all from one start model")
    p.add_argument("--output", "-o", required=True, help="a new folder for the merged policy")
    p.add_argument("--toward-start", type=float, default=1.0, metavar="LAMBDA",
                   help="scale the averaged weight change by LAMBDA (default 1; 0 gives the start model back)")
    p.add_argument("--start", default=None, help="full-weight models only: the model the runs started from "
                   "(needed with --toward-start)")
    return p


def main(argv: Sequence[str], console: Any = None) -> int:
    """`lmppo merge`; returns the exit code. Mistakes raise LmppoError (one line from the CLI)."""
    args = _parser().parse_args(list(argv))
    out = merge(args.inputs, args.output, args.toward_start, args.start)
    message = f"wrote {out}: the mean of {len(args.inputs)} policies' weight changes" + (
        f", times {args.toward_start:g}" if args.toward_start != 1.0 else "")
    (console.print if console is not None else print)(message)
    return 0
