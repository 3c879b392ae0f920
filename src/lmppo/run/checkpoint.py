"""The checkpoint format: a `TrainingState` and the trained tensors written atomically into
`output_dir/checkpoints/iter-N`, and read back. The layout, crash safety and resume design: docs/checkpoints.md."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Optional, cast

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import lmppo.run.signals as signals
import lmppo.run.storage as storage
from lmppo.errors import CheckpointError, StorageError
from lmppo.models.partition import real_shard
from lmppo.run.folder import checkpoints_dir, list_checkpoints, os_reason
from lmppo.run.layout import OPTIMIZER, STATE, TRAINED, checkpoint_name, checkpoint_temporary, rng_files
from lmppo.run.manifest import FORMAT, prune_checkpoints, write_json, write_manifest
from lmppo.run.state import RngState, TrainingState

if TYPE_CHECKING:
    from accelerate import Accelerator

    from lmppo.distributed.strategy import Strategy


@dataclass
class ModelParts:
    """Where this process's trained tensors live, and what it needs to write and read them."""

    modules: dict[str, Optional[nn.Module]]  # "actor." / "critic." -> the module as trained (unwrapped), or None
    engine: nn.Module  # the actor as wrapped: DeepSpeed's engine writes and reads its own shards
    strategy: Strategy
    accelerator: Accelerator
    reference_partitioned: bool  # ZeRO-3 partitions a moving reference: one file per process


def _publish(tmp: str, final_path: str) -> None:
    """Flush `tmp` and rename it to `final_path`, replacing an older folder of that name (`lmppo.run.storage`)."""
    storage.publish(tmp, final_path)


def trained_parameters(modules: dict[str, Optional[nn.Module]]) -> dict[str, nn.Parameter]:
    """`actor.*` / `critic.*` name -> parameter, for every parameter training changes (requires_grad).
    Tied weights appear once (named_parameters removes duplicates)."""
    out = {}
    for prefix, module in modules.items():
        for name, p in module.named_parameters() if module is not None else ():
            if p.requires_grad:
                out[prefix + name] = p
    return out


def frozen_fingerprint(modules: dict[str, Optional[nn.Module]]) -> str:
    """sha256 over the parameters training does not change (LoRA base weights, frozen layers): they are not
    stored, but loaded again from the config on resume."""
    h = hashlib.sha256()
    for prefix, module in modules.items():
        for name, p in module.named_parameters() if module is not None else ():
            if p.requires_grad:
                continue
            if hasattr(p, "ds_shape"):  # ZeRO-3: each process holds another shard; only the layout is compared
                h.update(f"{prefix}{name}:{p.dtype}:{tuple(p.ds_shape)};".encode())
                continue
            t = p.detach().cpu().contiguous()
            h.update(f"{prefix}{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs: no buffer protocol
    return h.hexdigest()


def _split_tensors(obj: object, prefix: str, tensors: dict[str, torch.Tensor]) -> object:
    """Nested dict/list with tensor leaves -> the same with `{"__tensor__": key}` placeholders; tensors into
    `tensors`."""
    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {k: _split_tensors(v, f"{prefix}/{k}" if prefix else str(k), tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj: object, tensors: Mapping[str, torch.Tensor]) -> object:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def _nonfinite(tensors: dict) -> Optional[str]:
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _nonfinite_shards(parts: ModelParts) -> Optional[str]:
    """Sharded layouts: the first trainable tensor holding NaN or inf in any process (each checks its own shards;
    a collective), or None."""
    bad = None
    for name, p in trained_parameters(parts.modules).items():
        shard = real_shard(p)  # a ZeRO-3 partition's padding is uninitialised: only the real elements count
        if shard.is_floating_point() and not bool(torch.isfinite(shard).all()):
            bad = name
            break
    if not parts.strategy.process_max(torch.tensor(float(bad is not None))):
        return None
    return bad or "a trainable tensor of another process"


def _optimizer_tensors(state: dict) -> dict:
    out = {}
    for index, per_param in state.get("state", {}).items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer state of parameter {index}, `{key}`"] = value
    return out


def _write_rng(folder: str, rank: int, state: TrainingState) -> None:
    rng = state.rng
    tensors = {"torch_cpu": rng.torch_cpu, "update_generator": state.update_generator}
    tensors.update({f"cuda_{i}": t for i, t in enumerate(rng.cuda)})
    info: dict[str, object] = {"python": rng.python, "score_moments": state.score_moments}  # this process's moments
    if rng.numpy is not None:
        info["numpy"] = rng.numpy
    tensors_file, info_file = rng_files(rank)
    save_file(tensors, os.path.join(folder, tensors_file))
    write_json(os.path.join(folder, info_file), info)


def save_checkpoint(output_dir: str, state: TrainingState, parts: ModelParts, keep_last: int) -> str:
    """Write `state` and the trained tensors to `output_dir/checkpoints/iter-N` atomically; returns the folder.

    Raises CheckpointError (and writes nothing) when a weight or optimizer moment is not finite, and StorageError
    when the write fails (full disk, ...), in which case the earlier checkpoints are untouched."""
    acc, strategy = parts.accelerator, parts.strategy
    sharded = strategy.sharded_checkpoint  # DeepSpeed: the engine writes model and optimizer, a shard per process
    root = checkpoints_dir(output_dir)
    name = checkpoint_name(state.iteration)
    final = os.path.join(root, name)
    tmp = os.path.join(root, checkpoint_temporary(name))
    main = acc.is_main_process
    previous = [p for _i, p in list_checkpoints(output_dir) if p != final]
    if sharded:
        trained, bad = {}, _nonfinite_shards(parts)
    else:
        trained = {n: p.detach().cpu().contiguous() for n, p in trained_parameters(parts.modules).items()}
        bad = _nonfinite(trained) or _nonfinite(_optimizer_tensors(state.optimizer or {}))
    if bad is not None:
        keep = f"the previous checkpoint {previous[0]} is kept" if previous else "no checkpoint was written before"
        raise CheckpointError(
            f"refusing to write the checkpoint of iteration {state.iteration}: {bad} holds NaN or inf values; {keep}"
        )
    try:
        if main:
            os.makedirs(root, exist_ok=True)
            storage.discard(tmp)
            os.makedirs(tmp)
        acc.wait_for_everyone()
        # every process writes its own part: RNG streams, reference shards (ZeRO-3), model and optimizer shards
        rank = acc.process_index
        _write_rng(tmp, rank, state)
        reference_tensors: dict[str, torch.Tensor] = {}
        reference_state: object = {}
        if main or parts.reference_partitioned:
            reference_state = _split_tensors(state.reference, "", reference_tensors)
        if reference_tensors and parts.reference_partitioned:
            save_file(reference_tensors, os.path.join(tmp, f"reference-rank{rank}.safetensors"))
        if sharded:
            strategy.write_shards(parts.engine, tmp)
        acc.wait_for_everyone()  # every part is written: process 0 completes and publishes the folder
        if main:
            if not sharded:
                save_file(trained, os.path.join(tmp, TRAINED))
                torch.save(state.optimizer, os.path.join(tmp, OPTIMIZER))
            if reference_tensors and not parts.reference_partitioned:
                save_file(reference_tensors, os.path.join(tmp, "reference.safetensors"))
            layout = strategy.checkpoint_layout()
            saved = state.counters()
            saved.update(
                format=FORMAT,
                reference=reference_state,
                frozen_fingerprint=state.frozen_fingerprint,
                num_processes=acc.num_processes,
                layout=layout,
                config=state.config,
                inputs=state.inputs,
            )
            write_json(os.path.join(tmp, STATE), saved)
            write_manifest(tmp, state.iteration, acc.num_processes, layout)
            _publish(tmp, final)
    except BaseException as err:  # the real writers raise OSError, RuntimeError (torch), SafetensorError, ...
        why = os_reason(err, root) if storage.is_write_failure(err) else ""  # before the clean-up frees space
        if main:
            storage.discard(tmp)
        if not why:
            raise
        keep = f"the previous checkpoint {previous[0]} is intact" if previous else "there is no earlier checkpoint"
        raise StorageError(
            f"could not write the checkpoint of iteration {state.iteration} to {root}: "
            f"{why}; {keep}. Free space (or fix the folder), then {signals.go_on(output_dir)}"
        ) from None
    acc.wait_for_everyone()
    if main:
        prune_checkpoints(output_dir, keep_last, final)
    return final


def read_state_file(path: str) -> dict:
    """state.json of checkpoint folder `path`; CheckpointError when it is unreadable or of another format."""
    try:
        with open(os.path.join(path, STATE), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({err})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: state.json is not of checkpoint format {FORMAT}")
    return state


def _setting(stage: int, processes: int) -> str:
    plural = "es" if processes != 1 else ""
    return (
        f"under DeepSpeed ZeRO-{stage} with {processes} process{plural}"
        if stage
        else f"without DeepSpeed with {processes} process{plural}"
    )


def check_layout(state: dict, processes: int, stage: Optional[int], where: str, warn: bool = True) -> None:
    """CheckpointError when checkpoint `where` (its state.json `state`) cannot be resumed by `processes` processes
    under ZeRO stage `stage` (0: no DeepSpeed; None: not known yet, not compared): a DeepSpeed checkpoint's model
    and optimizer shards belong to the stage and the processes that wrote them. A checkpoint of whole tensors
    resumes with another number of processes, with a warning (`warn`) that it does not repeat the run exactly."""
    saved_stage = int((state.get("layout") or {}).get("deepspeed_stage", 0))
    saved_processes = int(state.get("num_processes", 1))
    if stage is not None and stage != saved_stage or saved_stage and processes != saved_processes:
        now = _setting(stage if stage is not None else saved_stage, processes)
        raise CheckpointError(
            f"cannot resume from {where} {now}: it was written {_setting(saved_stage, saved_processes)}"
            ", and a DeepSpeed checkpoint's model and optimizer shards belong to the ZeRO stage and "
            "the processes that wrote them; resume with the same launcher, DeepSpeed setting and "
            f"number of processes ({saved_processes})"
        )
    if warn and processes != saved_processes:
        warnings.warn(
            f"checkpoint {where} was written by {saved_processes} processes, this run has {processes}; it "
            "continues, but not exactly as it would have"
        )


def _load_whole_tensors(path: str, modules: dict[str, Optional[nn.Module]]) -> dict:
    """trained.safetensors of checkpoint `path` into `modules`; returns the optimizer's state_dict."""
    params = trained_parameters(modules)
    loaded = load_file(os.path.join(path, TRAINED))
    if set(loaded) != set(params):
        diff = sorted(set(loaded) ^ set(params))[:3]
        raise CheckpointError(f"checkpoint {path}: its trained tensors do not match this model's (e.g. {diff})")
    with torch.no_grad():
        for name, p in params.items():
            t = loaded[name]
            if t.shape != p.shape or t.dtype != p.dtype:
                raise CheckpointError(
                    f"checkpoint {path}: `{name}` has shape {tuple(t.shape)} {t.dtype}, this "
                    f"model has {tuple(p.shape)} {p.dtype}"
                )
            p.copy_(t)
    return torch.load(os.path.join(path, OPTIMIZER), map_location="cpu", weights_only=True)


def read_checkpoint(path: str, parts: ModelParts) -> TrainingState:
    """The training state of checkpoint folder `path` (verified by the caller), with its trained tensors loaded
    into `parts` in place (DeepSpeed: through the engine, which also loads the optimizer's shards)."""
    saved = read_state_file(path)
    acc, strategy = parts.accelerator, parts.strategy
    optimizer = None
    if strategy.sharded_checkpoint:
        iteration = float(saved["iteration"])  # every process must have picked the same checkpoint
        if strategy.process_max(torch.tensor(iteration)) != -strategy.process_max(torch.tensor(-iteration)):
            raise CheckpointError(
                f"the processes of this run chose different checkpoints to resume from ({path} on "
                f"process {acc.process_index}); is the run folder the same on every machine?"
            )
        strategy.read_shards(parts.engine, path)
    else:
        optimizer = _load_whole_tensors(path, parts.modules)
    reference_file = f"reference-rank{acc.process_index}" if parts.reference_partitioned else "reference"
    reference_tensors = {}
    if os.path.isfile(os.path.join(path, reference_file + ".safetensors")):
        reference_tensors = load_file(os.path.join(path, reference_file + ".safetensors"))
    tensors_file, info_file = rng_files(acc.process_index)
    if not os.path.isfile(os.path.join(path, tensors_file)):
        tensors_file, info_file = rng_files(0)
    with open(os.path.join(path, info_file), encoding="utf-8") as fh:
        info = json.load(fh)
    tensors = load_file(os.path.join(path, tensors_file))
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    return TrainingState(
        iteration=int(saved["iteration"]),
        episode=int(saved["episode"]),
        train_seconds=float(saved["train_seconds"]),
        nonfinite_in_a_row=int(saved["nonfinite_in_a_row"]),
        stream=saved["stream"],
        kl_controller=saved["kl_controller"],
        # each process's own moments (older checkpoints: process 0's, from state.json)
        score_moments=info.get("score_moments", saved["score_moments"]),
        scheduler=saved["scheduler"],
        reference=cast("dict[str, object]", _join_tensors(saved.get("reference", {}), reference_tensors)),  # a dict in
        update_generator=tensors["update_generator"],
        rng=RngState(tensors["torch_cpu"], cuda, info["python"], info.get("numpy")),
        frozen_fingerprint=saved.get("frozen_fingerprint", ""),
        optimizer=optimizer,
        config=saved.get("config", {}),
        inputs=saved.get("inputs", {}),
    )
