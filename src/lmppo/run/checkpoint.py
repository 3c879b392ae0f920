"""Checkpoints: atomic writes, exact resume, and a run folder that is never clobbered by accident.

Layout of a run folder (`output_dir`)::

    config.yaml               the run's config, secrets masked (`redacted_config_dict`)
    metrics.jsonl             one JSON line per iteration; samples.jsonl: the sample tables
    checkpoints/iter-00000004/
        trained.safetensors   every trainable tensor: the policy (or its LoRA adapters), the value head or critic
        reference.safetensors the reference policy's tensors, when it keeps any (reference.mode sync / ema)
        optimizer.pt          the AdamW state (tensors and numbers only; loaded with torch.load(weights_only=True))
        state.json            counters, train_seconds, prompt-stream position, KL controller, score normaliser,
                              LR scheduler, the config (secrets masked), a fingerprint of the frozen weights
        rng-rank0.safetensors torch CPU (+ CUDA) RNG and the minibatch-order generator of process 0 (rng-rank1.* ...:
        rng-rank0.json        python and numpy RNG, score normaliser of process 0         one pair per process)
        manifest.json         sha256 and size of every other file; written last
    final/                    the trained model in Hugging Face format (`PPOTrainer.save_model`), each folder with a
                              model card README.md: policy/ (a LoRA run: the adapter), policy-merged/ (a LoRA run's
                              adapter merged into full weights, `model.lora.save_merged`), value/

When checkpoints are written: after iterations `checkpoint.every`, 2 * every, ... and always after the last
iteration (`every: 0` means only then). `final/` is the export for inference; the last checkpoint (same iteration)
is what resumes, so a finished run can be extended by resuming it with a larger `total_episodes`.

Crash safety: a checkpoint is written into `checkpoints/.iter-N.tmp`, the manifest last, every file flushed to
disk, then renamed to `iter-N`. A run killed at any moment leaves complete checkpoints and at most a temporary
folder (ignored, removed by the next write). On load the manifest is verified (sizes and sha256); a checkpoint
whose manifest is missing, unreadable or does not match is skipped with a warning and the one before it is used.
Weights or optimizer moments that are not finite are never written (CheckpointError instead). A failed write
(full disk, ...) leaves the earlier checkpoints untouched and stops the run with one message saying why and where.

Exact resume: everything that decides the next iteration is restored: trainable weights, optimizer moments and
step counts, the LR scheduler's step, the python / numpy / torch (CPU and CUDA) RNG states (which drive sampling),
the minibatch-order generator, the prompt stream's position, the adaptive KL coefficient, the score normaliser,
the reference weights when they move, the counters and the non-finite streak. A checkpoint is taken between two
iterations, after everything of the first has happened, so on CPU a resumed run's weights and metrics equal an
uninterrupted run's bit for bit (wall-clock metrics aside). Not stored, but loaded again from the config: the
frozen weights (the frozen reference copy of the initial policy, LoRA base weights); a sha256 of them in
state.json makes a resume from different initial weights fail instead of silently training something else.

Departure from TRL / accelerate's `save_state`: no pickle (tensors in safetensors, the rest JSON, the optimizer
through `weights_only` loading; DeepSpeed's own shard files, below, are the exception), a manifest with checksums,
and a config compatibility check that refuses a resume which would mean something else (`INCOMPATIBLE_FIELDS`) with
the field, old and new value.

Several processes: every process writes its own RNG files (and score normaliser) into the shared temporary folder,
then all wait for each other (a barrier), then process 0 writes the rest, the manifest last, and publishes the
folder: a checkpoint is complete for every process or does not exist. The files are read from a folder every
process sees (one machine, or a shared file system).

Under DeepSpeed ZeRO-2 / ZeRO-3 (`Strategy.sharded_checkpoint`) the model and optimizer state are sharded: instead
of trained.safetensors and optimizer.pt, every process writes its shards through DeepSpeed's own
`engine.save_checkpoint` into `deepspeed/` (`mp_rank_00_model_states.pt` or one `zero_pp_rank_R_..._model_states.pt`
per process under ZeRO-3, one `..._optim_states.pt` per process; DeepSpeed's `zero_to_fp32.py` beside them turns
them into full fp32 weights: `python zero_to_fp32.py . OUT --tag deepspeed`). These are DeepSpeed's pickles, read
back by `engine.load_checkpoint`: a checkpoint folder is trusted like code. A moving reference partitioned by
ZeRO-3 is one `reference-rankR.safetensors` per process. state.json and the manifest record the layout
(`deepspeed_stage`) and the number of processes; a resume under another stage or number of processes is refused
with one message naming both (`check_layout`): the shards belong to the processes that wrote them.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import uuid
import warnings
from typing import Any, Callable, Optional, Sequence

import lmppo.config.schema as config_module
import lmppo.run.lock as lock
import lmppo.run.ownership as ownership
import lmppo.run.storage as storage
from lmppo.config.schema import Config, apply_override, from_dict, load_config
from lmppo.distributed.zero import ENGINE_TAG, requested_zero_stage
from lmppo.errors import CheckpointError, ConfigError, LmppoError, StorageError
from lmppo.models.loading import save_merged
from lmppo.models.optim import lr_factor
from lmppo.models.partition import real_shard
from lmppo.redact import _SECRET_KEY, MASK, is_env_template, redact_text  # noqa: F401  (redact_text: re-exported)

Trainer = Any
"""What saving and loading read and restore: an object with `config`, `accelerator`, `actor`, `critic`,
`optimizer`, `scheduler`, `reference`, `kl_controller`, `score_moments`, `stream`, `update_generator`, the counters
and `state_for_checkpoint()` (a `PPOTrainer`; this module does not import the trainer, which sits above it)."""

FORMAT = 1
"""Version of the checkpoint layout; bumped when it changes incompatibly."""
CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
REQUIRED_FILES = ("state.json", "trained.safetensors", "optimizer.pt")
"""Files every checkpoint of whole tensors lists (a sharded one: `required_files`)."""
_CKPT_NAME = re.compile(r"^iter-(\d+)$")

INCOMPATIBLE_FIELDS = (
    "model.policy",
    "model.tokenizer",
    "model.lora.enabled",
    "model.lora.r",
    "model.lora.alpha",
    "model.lora.target_modules",
    "value.mode",
    "rollout.batch_size",
    "ppo.num_minibatches",
    "seed",
    "data.shuffle",
    "reference.mode",
    "kl.controller",
)
"""Fields a resumed run must keep: the checkpoint cannot be loaded, or would mean something else, with another
value (`value.init_from` too when value.mode is `critic`). Everything else may change on resume: total_episodes
(extend a run), log.*, checkpoint.*, learning rate and schedule (applied from the next iteration), kl.coef (fixed
controller; the adaptive controller continues from its checkpointed value), micro_batch_size, ..."""

RUN_ARTIFACTS = ("metrics.jsonl", "samples.jsonl", CHECKPOINTS, "final", "tensorboard")
"""What a run writes into output_dir (removed by `overwrite: true`)."""
CONFIG_HEADER = "# lmppo run config (secrets masked); resume with: lmppo train --resume OUTPUT_DIR\n"


# ----------------------------------------------------------------------------- atomic folders


def _fsync_tree(path: str) -> None:
    storage.fsync_tree(path)


def _fsync_dir(path: str) -> None:
    storage.fsync_dir(path)


def _publish(tmp: str, final_path: str) -> None:
    """Flush `tmp` and rename it to `final_path`, replacing an older folder of that name (`lmppo.run.storage`)."""
    storage.publish(tmp, final_path)


def atomic_dir(final_path: str, what: str = "", keep: str = ""):
    """Yield a temporary folder beside `final_path`; on success flush it and rename it to `final_path`
    (replacing an older folder of that name). On failure the temporary folder is removed and any existing
    `final_path` is left untouched; a failed write is one StorageError (see `lmppo.run.storage.atomic_dir`)."""
    return storage.atomic_dir(final_path, what, keep)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(obj, fh, indent=1, allow_nan=True)
        fh.flush()
        os.fsync(fh.fileno())


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


# ----------------------------------------------------------------------------- secrets


def _config_field_names() -> frozenset[str]:
    names: set[str] = set()
    for obj in vars(config_module).values():
        if isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == config_module.__name__:
            names.update(f.name for f in dataclasses.fields(obj))
    return frozenset(names)


def _redact(value: Any, known: frozenset[str]) -> Any:
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, (list, tuple)):
        return [_redact(v, known) for v in value]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            secret_key = isinstance(k, str) and k not in known and _SECRET_KEY.search(k)
            env_only = isinstance(v, str) and is_env_template(v)  # `Bearer ${TOKEN}`: no secret in the text
            out[k] = MASK if secret_key and v not in (None, "", False) and not env_only else _redact(v, known)
        return out
    return value


def redacted_config_dict(cfg: Config | dict) -> dict:
    """The config as a plain dict, safe to write to files and trackers: credentials in URLs and strings masked
    (see `redact_text`), and values under secret-looking keys of free-form mappings (e.g. a `token` in
    rollout.generation_kwargs) replaced by `***`. Config fields themselves (`stop_token`, ...) are kept."""
    data = cfg if isinstance(cfg, dict) else cfg.to_dict()
    return _redact(copy.deepcopy(data), _config_field_names())


def _masked_fields(data: Any, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, value) of the string leaves of a config dict that hold a mask."""
    out: list[tuple[str, str]] = []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _masked_fields(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _masked_fields(v, f"{prefix}[{i}]")
    elif isinstance(data, str) and MASK in data:
        out.append((prefix, data))
    return out


def write_run_config(cfg: Config, path: str, comments: Sequence[str] = ()) -> None:
    """`config.yaml` of a run (secrets masked), written atomically; `comments`: lines after the header (how a
    value was chosen, e.g. `precision: auto`)."""
    import yaml

    text = CONFIG_HEADER + "".join(f"# {' '.join(line.split())}\n" for line in comments)
    text += yaml.safe_dump(redacted_config_dict(cfg), sort_keys=False, allow_unicode=True)
    storage.write_text(path, text, "the run's config (config.yaml)")


# ----------------------------------------------------------------------------- the run folder


def _is_own_config(path: str) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.readline() == CONFIG_HEADER.splitlines()[0] + "\n"
    except OSError:
        return False


def existing_run_files(output_dir: str) -> list[str]:
    """What in `output_dir` a run would write over: lmppo's own files of an earlier run and foreign files of the
    same names (see `lmppo.run.ownership`)."""
    own, foreign = ownership.survey(output_dir)
    return own + foreign


def prepare_output_dir(
    cfg: Config, is_main_process: bool = True, resuming: bool = False, comments: Sequence[str] = ()
) -> None:
    """Create `cfg.output_dir` and write its config.yaml (secrets masked).

    A folder that already holds a run is refused unless `overwrite: true`, which removes that run's files first
    (only lmppo's own: metrics, samples, checkpoints, final, tensorboard). A folder holding only a config.yaml
    lmppo wrote (a run that stopped before its first iteration) is reused. `resuming`: the folder is the run
    being continued; nothing is removed."""
    out = cfg.output_dir
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError("output_dir", out, "is a file; give a folder for the run's metrics and checkpoints")
    if is_main_process:  # one process per run folder (lmppo.run.lock); taken before anything in it is read or changed
        lock.acquire(out)
    try:
        _prepare_locked(cfg, out, is_main_process, resuming, comments)
    except BaseException:
        if is_main_process:
            lock.release(out)
        raise


def _prepare_locked(cfg: Config, out: str, is_main_process: bool, resuming: bool, comments: Sequence[str]) -> None:
    own, foreign = ownership.survey(out) if os.path.isdir(out) else ([], [])
    if foreign and not resuming:
        raise ConfigError(
            "output_dir",
            out,
            f"holds files lmppo did not write ({', '.join(foreign)}); a run would "
            "write over them, so lmppo neither uses nor removes them: choose another output_dir or "
            "move them away",
        )
    if own and not resuming:
        if not cfg.overwrite:
            raise ConfigError(
                "output_dir",
                out,
                f"already holds a run ({', '.join(own)}); choose another "
                f"folder, continue it with `lmppo train --resume {out}`, or set overwrite: true "
                f"(removes those files of the old run, nothing else)",
            )
        if is_main_process:
            ownership.remove_own(out, own)
    if is_main_process:
        try:
            os.makedirs(out, exist_ok=True)
            if not resuming:
                ownership.claim(out)
            write_run_config(cfg, os.path.join(out, "config.yaml"), comments)
        except OSError as err:
            raise ConfigError("output_dir", out, f"cannot be written: {_os_reason(err, out)}") from None


# ----------------------------------------------------------------------------- what is saved


def _unwrap(trainer: "Trainer", module):
    return trainer.accelerator.unwrap_model(module)


def trained_parameters(trainer: "Trainer") -> dict:
    """`actor.*` / `critic.*` name -> parameter, for every parameter training changes (requires_grad).
    Tied weights appear once (named_parameters removes duplicates)."""
    out = {}
    for prefix, module in (("actor.", trainer.actor), ("critic.", trainer.critic)):
        if module is None:
            continue
        for name, p in _unwrap(trainer, module).named_parameters():
            if p.requires_grad:
                out[prefix + name] = p
    return out


def frozen_fingerprint(trainer: "Trainer") -> str:
    """sha256 over the parameters of the policy / critic that training does not change (LoRA base weights,
    frozen layers): they are not stored, but loaded again from the config on resume."""
    cached = getattr(trainer, "_frozen_fingerprint", None)
    if cached is not None:
        return cached
    import torch

    h = hashlib.sha256()
    for prefix, module in (("actor.", trainer.actor), ("critic.", trainer.critic)):
        if module is None:
            continue
        for name, p in _unwrap(trainer, module).named_parameters():
            if p.requires_grad:
                continue
            if hasattr(p, "ds_shape"):  # ZeRO-3: each process holds another shard; only the layout is compared
                h.update(f"{prefix}{name}:{p.dtype}:{tuple(p.ds_shape)};".encode())
                continue
            t = p.detach().cpu().contiguous()
            h.update(f"{prefix}{name}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    trainer._frozen_fingerprint = h.hexdigest()
    return trainer._frozen_fingerprint


def _split_tensors(obj: Any, prefix: str, tensors: dict) -> Any:
    """Nested dict/list with tensor leaves -> the same with `{"__tensor__": key}` placeholders; tensors into
    `tensors`."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = prefix or "tensor"
        tensors[key] = obj.detach().cpu().contiguous()
        return {"__tensor__": key}
    if isinstance(obj, dict):
        return {k: _split_tensors(v, f"{prefix}/{k}" if prefix else str(k), tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_split_tensors(v, f"{prefix}/{i}", tensors) for i, v in enumerate(obj)]
    return obj


def _join_tensors(obj: Any, tensors: dict) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        return {k: _join_tensors(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_join_tensors(v, tensors) for v in obj]
    return obj


def _rng_state(trainer: "Trainer") -> tuple[dict, dict]:
    """(tensors, json) of every RNG of this process."""
    import torch

    tensors = {"torch_cpu": torch.get_rng_state(), "update_generator": trainer.update_generator.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda_{i}"] = state
    version, internal, gauss = random.getstate()
    info: dict[str, Any] = {
        "python": [version, list(internal), gauss],
        # each process normalises with the moments of the scores it has seen
        "score_moments": trainer.score_moments.state_dict(),
    }
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        info["numpy"] = [name, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:  # pragma: no cover
        pass
    return tensors, info


def _set_rng_state(trainer: "Trainer", tensors: dict, info: dict) -> None:
    import torch

    torch.set_rng_state(tensors["torch_cpu"])
    trainer.update_generator.set_state(tensors["update_generator"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("cuda_")), key=lambda k: int(k[5:]))]
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            warnings.warn(
                f"the checkpoint holds RNG states of {len(cuda)} GPUs, this machine has "
                f"{torch.cuda.device_count()}; sampling will not repeat the uninterrupted run exactly"
            )
    version, internal, gauss = info["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in info:
        import numpy as np

        name, keys, pos, has_gauss, cached = info["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "score_moments" in info:  # (older checkpoints: process 0's, from state.json)
        trainer.score_moments.load_state_dict(info["score_moments"])


def _nonfinite(tensors: dict) -> Optional[str]:
    import torch

    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return name
    return None


def _nonfinite_shards(trainer: "Trainer") -> Optional[str]:
    """Sharded layouts: the first trainable tensor holding NaN or inf in any process (each checks its own shards;
    a collective), or None."""
    import torch

    bad = None
    for prefix, module in (("actor.", trainer.actor), ("critic.", trainer.critic)):
        if module is None or bad is not None:
            continue
        for name, p in _unwrap(trainer, module).named_parameters():
            shard = real_shard(p)  # a ZeRO-3 partition's padding is uninitialised: only the real elements count
            if p.requires_grad and shard.is_floating_point() and not bool(torch.isfinite(shard).all()):
                bad = prefix + name
                break
    if not trainer.strategy.process_max(torch.tensor(float(bad is not None))):
        return None
    return bad or "a trainable tensor of another process"


def _optimizer_tensors(state: dict) -> dict:
    import torch

    out = {}
    for index, per_param in state.get("state", {}).items():
        for key, value in per_param.items():
            if isinstance(value, torch.Tensor):
                out[f"optimizer state of parameter {index}, `{key}`"] = value
    return out


# ----------------------------------------------------------------------------- listing and verifying


def checkpoints_dir(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS)


def list_checkpoints(output_dir: str) -> list[tuple[int, str]]:
    """(iteration, folder) of every published checkpoint folder, newest first (not yet verified)."""
    root = checkpoints_dir(output_dir)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _CKPT_NAME.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found, reverse=True)


def required_files(manifest: dict) -> list[str]:
    """What manifest `manifest` must list: state.json and, for whole tensors, the weights and the optimizer;
    for a sharded layout, every process's RNG files and DeepSpeed optimizer shard."""
    layout = manifest.get("layout") or {}
    if not layout.get("deepspeed_stage"):
        return list(REQUIRED_FILES)
    processes = manifest.get("processes")
    if not isinstance(processes, int) or processes < 1:
        return ["state.json", "(the number of processes)"]
    files = ["state.json"]
    for rank in range(processes):
        files += [f"rng-rank{rank}.safetensors", f"rng-rank{rank}.json"]
    return files


def _has_shard(files: dict, rank: int) -> bool:
    return any(
        name.startswith(ENGINE_TAG + "/") and f"zero_pp_rank_{rank}_" in name and name.endswith("optim_states.pt")
        for name in files
    )


def verify_checkpoint(path: str) -> dict:
    """The manifest of checkpoint folder `path` after checking every file it lists (size and sha256);
    CheckpointError saying what is wrong otherwise."""
    mpath = os.path.join(path, MANIFEST)
    if not os.path.isfile(mpath):
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST} (its write did not finish)")
    try:
        with open(mpath, encoding="utf-8") as fh:
            manifest = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is unreadable ({err})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} is not a lmppo checkpoint manifest of format {FORMAT}")
    missing = [f for f in required_files(manifest) if f not in files]
    if (manifest.get("layout") or {}).get("deepspeed_stage"):
        missing += [
            f"{ENGINE_TAG}/ optimizer shard of process {r}"
            for r in range(manifest.get("processes") or 0)
            if not _has_shard(files, r)
        ]
    if missing:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST} does not list {', '.join(missing)}")
    for name, info in files.items():
        parts = name.split("/") if isinstance(name, str) else [""]
        if (
            name in (MANIFEST, "")
            or os.path.isabs(name)
            or any(part in ("", ".", "..") for part in parts)
            or "\\" in name
        ):
            raise CheckpointError(f"checkpoint {path}: {MANIFEST} lists a file outside the folder: {name!r}")
        fpath = os.path.join(path, *parts)
        if not isinstance(info, dict) or not os.path.isfile(fpath):
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        if os.path.getsize(fpath) != info.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {name} has {os.path.getsize(fpath)} bytes, the manifest "
                f"says {info.get('bytes')} (truncated or changed)"
            )
        if _sha256(fpath) != info.get("sha256"):
            raise CheckpointError(f"checkpoint {path}: {name} does not match its sha256 in the manifest (corrupt)")
    return manifest


def latest_checkpoint(output_dir: str) -> Optional[str]:
    """The newest checkpoint of the run in `output_dir` that verifies; ones that do not are skipped with a
    warning. None when there is none."""
    for _iteration, path in list_checkpoints(output_dir):
        try:
            verify_checkpoint(path)
            return path
        except CheckpointError as err:
            warnings.warn(f"skipping a checkpoint: {err}; trying the one before it", stacklevel=2)
    return None


def write_manifest(folder: str, iteration: int, processes: int = 1, layout: Optional[dict] = None) -> None:
    """manifest.json of `folder`: format, iteration, number of processes, layout (`Strategy.checkpoint_layout`),
    size and sha256 of every other file (sub-folders included, as `a/b`). Written last."""
    files = {}
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(top, name)
            rel = os.path.relpath(path, folder).replace(os.sep, "/")
            if rel != MANIFEST:
                files[rel] = {"bytes": os.path.getsize(path), "sha256": _sha256(path)}
    _write_json(
        os.path.join(folder, MANIFEST),
        {"format": FORMAT, "iteration": iteration, "processes": processes, "layout": layout or {}, "files": files},
    )


def prune_checkpoints(output_dir: str, keep_last: int, newest: str) -> None:
    """Keep the `keep_last` newest checkpoints up to `newest`; remove older ones and leftovers of killed writes."""
    root = checkpoints_dir(output_dir)
    kept = 0
    for _iteration, path in list_checkpoints(output_dir):
        if kept == 0 and os.path.abspath(path) != os.path.abspath(newest):
            continue  # newer than the one just written: left for inspection (see resume_trainer)
        kept += 1
        if kept > keep_last:  # renamed aside first: a kill never leaves a half-removed iter-N under its name
            with contextlib.suppress(LmppoError):
                storage.remove_tree(path, f"the old checkpoint {os.path.basename(path)}")
    for name in os.listdir(root):
        if name.startswith(".iter-") and (".tmp" in name or ".old-" in name or ".del-" in name):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ----------------------------------------------------------------------------- saving


def _os_reason(err: BaseException, where: str = "") -> str:
    """Why a write failed (`lmppo.run.storage.reason`), with the file when the error names one."""
    filename = getattr(err, "filename", None)
    return storage.reason(err, filename or where) + (f" ({filename})" if filename else "")


def save_checkpoint(trainer: "Trainer") -> str:
    """Write the trainer's complete state to `output_dir/checkpoints/iter-N` atomically; returns the folder.

    Raises CheckpointError (and writes nothing) when a weight or optimizer moment is not finite, and when the
    write fails (full disk, ...), in which case the earlier checkpoints are untouched."""
    import torch
    from safetensors.torch import save_file

    cfg, acc, strategy = trainer.config, trainer.accelerator, trainer.strategy
    sharded = strategy.sharded_checkpoint  # DeepSpeed: the engine writes model and optimizer, a shard per process
    root = checkpoints_dir(cfg.output_dir)
    name = f"iter-{trainer.iteration:08d}"
    final = os.path.join(root, name)
    tmp = os.path.join(root, f".{name}.tmp")
    main = acc.is_main_process
    previous = [p for _i, p in list_checkpoints(cfg.output_dir) if p != final]
    if sharded:
        trained, optimizer_state, bad = {}, {}, _nonfinite_shards(trainer)
    else:
        trained = {n: p.detach().cpu().contiguous() for n, p in trained_parameters(trainer).items()}
        optimizer_state = trainer.optimizer.state_dict()
        bad = _nonfinite(trained) or _nonfinite(_optimizer_tensors(optimizer_state))
    if bad is not None:
        keep = f"the previous checkpoint {previous[0]} is kept" if previous else "no checkpoint was written before"
        raise CheckpointError(
            f"refusing to write the checkpoint of iteration {trainer.iteration}: {bad} holds NaN or inf values; {keep}"
        )
    try:
        if main:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        acc.wait_for_everyone()
        # every process writes its own part: RNG streams, reference shards (ZeRO-3), model and optimizer shards
        rng_tensors, rng_info = _rng_state(trainer)
        rank = acc.process_index
        save_file(rng_tensors, os.path.join(tmp, f"rng-rank{rank}.safetensors"))
        _write_json(os.path.join(tmp, f"rng-rank{rank}.json"), rng_info)
        reference_tensors: dict = {}
        reference_state: dict = {}
        if main or trainer.reference.partitioned:
            reference_state = _split_tensors(trainer.reference.state_dict(), "", reference_tensors)
        if reference_tensors and trainer.reference.partitioned:
            save_file(reference_tensors, os.path.join(tmp, f"reference-rank{rank}.safetensors"))
        if sharded:
            strategy.write_shards(trainer.actor, tmp)
        acc.wait_for_everyone()  # every part is written: process 0 completes and publishes the folder
        if main:
            if not sharded:
                save_file(trained, os.path.join(tmp, "trained.safetensors"))
                torch.save(optimizer_state, os.path.join(tmp, "optimizer.pt"))
            if reference_tensors and not trainer.reference.partitioned:
                save_file(reference_tensors, os.path.join(tmp, "reference.safetensors"))
            state = trainer.state_for_checkpoint()
            state.update(
                format=FORMAT,
                reference=reference_state,
                frozen_fingerprint=frozen_fingerprint(trainer),
                num_processes=acc.num_processes,
                layout=strategy.checkpoint_layout(),
                config=redacted_config_dict(cfg),
            )
            _write_json(os.path.join(tmp, "state.json"), state)
            write_manifest(tmp, trainer.iteration, acc.num_processes, strategy.checkpoint_layout())
            _publish(tmp, final)
    except BaseException as err:  # the real writers raise OSError, RuntimeError (torch), SafetensorError, ...
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        if not storage.is_write_failure(err):
            raise
        keep = f"the previous checkpoint {previous[0]} is intact" if previous else "there is no earlier checkpoint"
        raise StorageError(
            f"could not write the checkpoint of iteration {trainer.iteration} to {root}: "
            f"{_os_reason(err, root)}; {keep}. Free space (or fix the folder) and continue with "
            f"`lmppo train --resume {cfg.output_dir}`"
        ) from None
    acc.wait_for_everyone()
    if main:
        prune_checkpoints(cfg.output_dir, cfg.checkpoint.keep_last, final)
    return final


# ----------------------------------------------------------------------------- compatibility


def _get(data: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(data, dict) or part not in data:
            return None
        data = data[part]
    return data


def check_compatible(cfg: Config, saved: dict, where: str) -> None:
    """ConfigError naming the first field of `INCOMPATIBLE_FIELDS` whose value in `cfg` differs from the
    checkpointed config `saved` (a redacted dict)."""
    new = redacted_config_dict(cfg)
    fields = list(INCOMPATIBLE_FIELDS)
    if _get(new, "value.mode") == "critic":
        fields.append("value.init_from")
    for name in fields:
        old_value, new_value = _get(saved, name), _get(new, name)
        if old_value != new_value:
            raise ConfigError(
                name,
                new_value,
                f"cannot change when resuming: the checkpoint {where} was trained "
                f"with {old_value!r}. Keep {name} = {old_value!r}, or start a new run in another "
                "output_dir",
            )


def _check_length(cfg: Config, state: dict, where: str) -> None:
    if state["iteration"] > cfg.num_iterations:
        raise ConfigError(
            "total_episodes",
            cfg.total_episodes,
            f"is less than the {state['episode']} episodes the "
            f"checkpoint {where} has already trained; give at least that many (more to go on)",
        )


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


# ----------------------------------------------------------------------------- loading


def _read_state(path: str) -> dict:
    try:
        with open(os.path.join(path, "state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({err})") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path}: state.json is not of checkpoint format {FORMAT}")
    return state


def resolve_checkpoint(path: str) -> str:
    """`path` if it is a checkpoint folder (verified), else the latest verified checkpoint of run folder `path`."""
    if os.path.isfile(os.path.join(path, MANIFEST)) or _CKPT_NAME.match(os.path.basename(os.path.normpath(path))):
        verify_checkpoint(path)
        return path
    if not os.path.isdir(path):
        raise CheckpointError(f"cannot resume from {path}: no such folder")
    found = latest_checkpoint(path)
    if found is None:
        raise CheckpointError(no_checkpoint_diagnosis(path))
    return found


def no_checkpoint_diagnosis(output_dir: str) -> str:
    """Why run folder `output_dir` cannot be resumed: no checkpoint was ever published, or none verifies (and
    why each does not). Never advises a step that deletes something without saying what it deletes."""
    published = list_checkpoints(output_dir)
    if published:
        reasons = []
        for _i, p in published[:3]:
            try:
                verify_checkpoint(p)
            except CheckpointError as err:
                reasons.append(str(err).replace(f"checkpoint {p}", os.path.basename(p)).replace(p, os.path.basename(p)))
        more = f"; and {len(published) - 3} more" if len(published) > 3 else ""
        return (
            f"cannot resume from {output_dir}: none of its {len(published)} checkpoints verifies "
            f"({'; '.join(reasons)}{more}). Nothing was changed: they are kept as they are for inspection "
            "(a disk or copy problem?)"
        )
    own, _foreign = ownership.survey(output_dir) if os.path.isdir(output_dir) else ([], [])
    removes = f" (which removes {', '.join(own)} of that run)" if own else ""
    return (
        f"cannot resume from {output_dir}: it holds no complete checkpoint ({CHECKPOINTS}/iter-N/{MANIFEST}); "
        f"the run stopped before its first checkpoint (checkpoint.every sets how often one is written). Start "
        f"it again with overwrite: true{removes}, or in another output_dir"
    )


def checkpoint_folder_run(path: str) -> Optional[str]:
    """The run folder of `path` when `path` is a checkpoint folder (`RUN/checkpoints/iter-N`), else None."""
    norm = os.path.normpath(os.path.abspath(path))
    parent = os.path.dirname(norm)
    if os.path.basename(parent) == CHECKPOINTS and (
        _CKPT_NAME.match(os.path.basename(norm)) or os.path.isfile(os.path.join(norm, MANIFEST))
    ):
        return os.path.dirname(parent)
    if os.path.isfile(os.path.join(norm, MANIFEST)) and os.path.isfile(os.path.join(norm, "state.json")):
        return parent
    return None


def load_checkpoint(trainer: "Trainer", path: Optional[str] = None, *, verified: bool = False) -> str:
    """Restore the trainer from checkpoint folder `path` (default: the latest one in its output_dir); returns
    the folder. The trainer's config must be compatible (`check_compatible`). metrics.jsonl and samples.jsonl
    of the trainer's output_dir are cut back to the checkpoint's iteration, so the continued run adds no
    line twice."""
    import torch
    from safetensors.torch import load_file

    path = path or trainer.config.output_dir
    path = path if verified else resolve_checkpoint(path)
    cfg = trainer.config
    state = _read_state(path)
    check_compatible(cfg, state.get("config", {}), path)
    _check_length(cfg, state, path)
    if state.get("frozen_fingerprint") != frozen_fingerprint(trainer):
        raise CheckpointError(
            f"checkpoint {path}: the frozen weights (LoRA base model, frozen layers) differ from "
            "the ones it was trained with; resume from the same initial policy (model.policy)"
        )
    strategy, acc = trainer.strategy, trainer.accelerator
    check_layout(state, acc.num_processes, int(strategy.checkpoint_layout().get("deepspeed_stage", 0)), path)

    # weights and optimizer
    if strategy.sharded_checkpoint:
        iteration = float(state["iteration"])  # every process must have picked the same checkpoint
        if strategy.process_max(torch.tensor(iteration)) != -strategy.process_max(torch.tensor(-iteration)):
            raise CheckpointError(
                f"the processes of this run chose different checkpoints to resume from ({path} on "
                f"process {acc.process_index}); is the run folder the same on every machine?"
            )
        strategy.read_shards(trainer.actor, path)
    else:
        _load_whole_tensors(trainer, path)
    reference_file = f"reference-rank{acc.process_index}" if trainer.reference.partitioned else "reference"
    reference_tensors = {}
    if os.path.isfile(os.path.join(path, reference_file + ".safetensors")):
        reference_tensors = load_file(os.path.join(path, reference_file + ".safetensors"))
    trainer.reference.load_state_dict(_join_tensors(state.get("reference", {}), reference_tensors))
    sched = dict(state["scheduler"])
    sched["lr_lambdas"] = [None] * len(trainer.scheduler.lr_lambdas)
    trainer.scheduler.load_state_dict(sched)
    _apply_changed_optimisation(trainer, state.get("config", {}))
    if cfg.kl.controller != "fixed":  # a fixed coefficient comes from the config (it may change on resume)
        trainer.kl_controller.load_state_dict(state["kl_controller"])
    trainer.score_moments.load_state_dict(state["score_moments"])
    trainer.stream.load_state_dict(state["stream"])
    trainer.iteration, trainer.episode = int(state["iteration"]), int(state["episode"])
    trainer.train_seconds = float(state["train_seconds"])
    trainer.nonfinite_in_a_row = int(state["nonfinite_in_a_row"])

    # random number generators, last: nothing may draw from them between here and the next iteration
    rank = trainer.accelerator.process_index
    rng_file = os.path.join(path, f"rng-rank{rank}")
    if not os.path.isfile(rng_file + ".safetensors"):
        rng_file = os.path.join(path, "rng-rank0")
    with open(rng_file + ".json", encoding="utf-8") as fh:
        rng_info = json.load(fh)
    _set_rng_state(trainer, load_file(rng_file + ".safetensors"), rng_info)

    if trainer.accelerator.is_main_process:
        truncate_logs(cfg.output_dir, trainer.iteration, trainer.episode)
    return path


def _load_whole_tensors(trainer: "Trainer", path: str) -> None:
    """trained.safetensors and optimizer.pt of checkpoint `path` into the trainer's model and optimizer."""
    import torch
    from safetensors.torch import load_file

    params = trained_parameters(trainer)
    loaded = load_file(os.path.join(path, "trained.safetensors"))
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
    opt_state = torch.load(os.path.join(path, "optimizer.pt"), map_location="cpu", weights_only=True)
    trainer.optimizer.load_state_dict(opt_state)


def _apply_changed_optimisation(trainer: "Trainer", saved: dict) -> None:
    """Optimizer settings come back from the checkpoint; apply the ones the resumed config changed."""
    p = trainer.config.ppo
    for group in trainer.optimizer.param_groups:
        group["eps"], group["weight_decay"] = p.adam_eps, p.weight_decay
    schedule = {
        "ppo.learning_rate": p.learning_rate,
        "ppo.lr_schedule": p.lr_schedule,
        "ppo.warmup_iterations": p.warmup_iterations,
        "total_episodes": trainer.config.total_episodes,
    }
    if all(_get(saved, k) == v for k, v in schedule.items()):
        return
    sched = trainer.scheduler
    factor = lr_factor(sched.last_epoch, p, trainer.config.num_iterations)
    sched.base_lrs = [p.learning_rate for _ in sched.base_lrs]
    for group in trainer.optimizer.param_groups:
        group["initial_lr"] = p.learning_rate
        group["lr"] = p.learning_rate * factor
    sched._last_lr = [group["lr"] for group in trainer.optimizer.param_groups]


def _truncate_jsonl(path: str, keep: Callable[[dict], bool]) -> None:
    if not os.path.isfile(path):
        return
    with open(path, encoding="utf-8", errors="replace") as fh:
        lines = fh.read().split("\n")
    kept = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # blank, or torn by a kill in the middle of a write
        if isinstance(row, dict) and keep(row):
            kept.append(line)
    text = "".join(line + "\n" for line in kept)
    storage.write_text(path, text, f"{os.path.basename(path)} (cut back to the checkpoint)")


def truncate_logs(output_dir: str, iteration: int, episode: int) -> None:
    """Cut metrics.jsonl back to iterations <= `iteration` and samples.jsonl to episodes <= `episode`."""

    def upto(key: str, limit: int) -> Callable[[dict], bool]:
        def keep(row: dict) -> bool:
            value = row.get(key)
            return isinstance(value, (int, float)) and value <= limit

        return keep

    _truncate_jsonl(os.path.join(output_dir, "metrics.jsonl"), upto("iteration", iteration))
    _truncate_jsonl(os.path.join(output_dir, "samples.jsonl"), upto("episode", episode))


# ----------------------------------------------------------------------------- resuming a run


def resume_trainer(
    output_dir: str,
    overrides: Optional[dict] = None,
    config_path: Optional[str] = None,
    console: Any = None,
    *,
    config: Optional[Config] = None,
    trainer_cls: Any,
    **trainer_kwargs: Any,
) -> "Trainer":
    """A trainer that continues the run in `output_dir` from its latest complete checkpoint.

    The config is `config` (a Config), else the file `config_path`, else the run's own `output_dir/config.yaml`
    (falling back to the one stored in the checkpoint), with `overrides` (dotted name -> value) applied and
    `output_dir` set to the run's folder. A change that makes the checkpoint unusable is refused with a
    ConfigError naming the field and both values, before any model is loaded. `trainer_kwargs` (policy,
    tokenizer, prompts, reward_functions) are passed to `trainer_cls` (`PPOTrainer`; `PPOTrainer.resume` calls
    this) as for a new run, with `resuming=True`: give the same initial policy and prompts the run started with.
    """
    if not os.path.isdir(output_dir):
        raise CheckpointError(f"cannot resume from {output_dir}: no such folder")
    run = checkpoint_folder_run(output_dir)
    if run is not None:  # resuming "into" a checkpoint folder would make it the run folder
        raise CheckpointError(
            f"cannot resume from {output_dir}: it is a checkpoint folder of the run {run}; resume "
            f"takes the run folder (`lmppo train --resume {run}`), which continues from its "
            "latest complete checkpoint"
        )
    path = resolve_checkpoint(output_dir)
    state = _read_state(path)
    if config is not None:
        cfg = copy.deepcopy(config)
        for dotted, raw in (overrides or {}).items():
            apply_override(cfg, dotted, raw)
    elif config_path:
        cfg = load_config(config_path, overrides)
    else:
        saved = os.path.join(output_dir, "config.yaml")
        if os.path.isfile(saved):
            cfg = load_config(saved, overrides)
        else:
            cfg = from_dict(Config, state.get("config", {}))
            for dotted, raw in (overrides or {}).items():
                apply_override(cfg, dotted, raw)
        masked = _masked_fields(cfg.to_dict())
        if masked:
            raise ConfigError(
                masked[0][0],
                masked[0][1],
                "holds a secret that was masked when the run was saved; give the run's own config "
                f"file again (`lmppo train CONFIG.yaml --resume {output_dir}`) or override the field",
            )
    cfg.output_dir = output_dir
    check_compatible(cfg, state.get("config", {}), path)
    _check_length(cfg, state, path)
    # the launcher's number of processes and the ZeRO stage, before any model loads (checked again once started)
    check_layout(state, int(os.environ.get("WORLD_SIZE", "1")), requested_zero_stage(cfg), path, warn=False)
    trainer = trainer_cls(cfg, console=console, resuming=True, **trainer_kwargs)
    stale = [p for i, p in list_checkpoints(output_dir) if i > state["iteration"]]
    for p in (
        stale if trainer.accelerator.is_main_process else []
    ):  # newer checkpoints that failed verification: set aside so they are neither used nor pruned
        with contextlib.suppress(OSError):
            os.rename(p, os.path.join(os.path.dirname(p), f"corrupt-{os.path.basename(p)}-{uuid.uuid4().hex[:6]}"))
    load_checkpoint(trainer, path, verified=True)
    if console is not None:
        done = trainer.iteration >= cfg.num_iterations
        console.print(
            f"resuming {output_dir} from {path}: iteration {trainer.iteration}/{cfg.num_iterations}, "
            f"episode {trainer.episode}" + (" (already complete: raise total_episodes to go on)" if done else ""),
            highlight=False,
        )
    return trainer


# ----------------------------------------------------------------------------- the trained model (final/)


def export_model(
    directory: str,
    policy: Any,
    tokenizer: Any,
    value_model: Any = None,
    value_head: Any = None,
    keep: str = "",
    merged: bool = False,
    cards: Optional[Callable[[str], str]] = None,
    adapter_base: Optional[str] = None,
) -> None:
    """`directory/policy` (the policy in Hugging Face format, safetensors, with its tokenizer; a LoRA policy: its
    adapter), `directory/policy-merged` when `merged` (a LoRA policy's adapters merged into full weights, with the
    tokenizer) and `directory/value` (the critic's model, or the shared value head's tensors), written atomically
    (`atomic_dir`); a failed write is one StorageError, with `keep` saying what is still intact. `cards`: folder
    name -> its README.md text (`lmppo.run.model_card`). `adapter_base`: the base model the adapter config names (a Hub
    id rather than the local cache folder it was loaded from)."""
    from safetensors.torch import save_file

    with atomic_dir(directory, "the trained model", keep) as tmp:
        policy.save_pretrained(os.path.join(tmp, "policy"), safe_serialization=True)
        tokenizer.save_pretrained(os.path.join(tmp, "policy"))
        adapter_config = os.path.join(tmp, "policy", "adapter_config.json")
        if adapter_base and os.path.isfile(adapter_config):
            with open(adapter_config, encoding="utf-8") as fh:
                data = json.load(fh)
            data["base_model_name_or_path"] = adapter_base
            with open(adapter_config, "w", encoding="utf-8") as fh:
                json.dump(data, fh, indent=2)
        if merged:
            save_merged(policy, os.path.join(tmp, "policy-merged"))
            tokenizer.save_pretrained(os.path.join(tmp, "policy-merged"))
        if value_model is not None:
            value_model.save_pretrained(os.path.join(tmp, "value"), safe_serialization=True)
        else:
            head = value_head
            os.makedirs(os.path.join(tmp, "value"), exist_ok=True)
            save_file(
                {k: v.contiguous() for k, v in head.state_dict().items()},
                os.path.join(tmp, "value", "value_head.safetensors"),
            )
        for folder in ("policy", "policy-merged", "value") if cards is not None else ():
            if os.path.isdir(os.path.join(tmp, folder)):  # (replaces the card peft writes for an adapter)
                with open(os.path.join(tmp, folder, "README.md"), "w", encoding="utf-8") as fh:
                    fh.write(cards(folder))
