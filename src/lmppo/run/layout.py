"""The run folder's names and patterns, each spelled once: every module of `lmppo.run` reads them here (a leaf: it
imports nothing of lmppo, so the modules below `run/folder.py` can too). Drawn in docs/checkpoints.md:

    OUTPUT_DIR/  config.yaml  metrics.jsonl  samples.jsonl  summary.json  tensorboard/  final/policy/ ...
                 (`lmppo reward-model`: config.yaml  metrics.jsonl  tensorboard/  final/reward-model/)
                 checkpoints/iter-00000004/  manifest.json state.json trained.safetensors optimizer.pt rng-rank0.*
                 .lmppo.lock  .lmppo-owned.json
"""

from __future__ import annotations

import re

CONFIG = "config.yaml"
"""The run's config, secrets masked (`lmppo.run.config_file`)."""
METRICS = "metrics.jsonl"
SAMPLES = "samples.jsonl"
SUMMARY = "summary.json"
TENSORBOARD = "tensorboard"
FINAL = "final"
"""The exported models, `final/policy`, ... (`lmppo.run.export`)."""
POLICY = "policy"
"""`final/policy`: the trained policy in Hugging Face format (a LoRA policy: its adapter), with its tokenizer."""
POLICY_MERGED = "policy-merged"
"""`final/policy-merged`: a LoRA policy's adapters merged into full weights (`model.lora.save_merged`)."""
VALUE = "value"
"""`final/value`: the critic's model, or the shared value head's tensors."""
REWARD_MODEL = "reward-model"
"""`final/reward-model`: the model `lmppo reward-model` trains (LoRA merged in), with its tokenizer."""
FINAL_FOLDERS = (POLICY, POLICY_MERGED, VALUE, REWARD_MODEL)
"""The folders of `final/`, each with its model card when it exists."""
CHECKPOINTS = "checkpoints"
"""The folder of the run's checkpoints, `checkpoints/iter-00000004/`, ..."""
ARTIFACTS = (METRICS, SAMPLES, CHECKPOINTS, FINAL, TENSORBOARD, SUMMARY, CONFIG)
"""What a run writes at the top of its folder: the names its ownership record lists (`lmppo.run.ownership`)."""
LINKABLE_FOLDERS = (CHECKPOINTS, FINAL, TENSORBOARD)
"""Run sub-folders that may be links to another disk: their temporaries are looked for in the link's target (and a
`final/` link is written through, `lmppo.run.storage.atomic_dir`)."""
LOCK = ".lmppo.lock"
"""The run lock's file (`lmppo.run.lock`)."""
OWNED = ".lmppo-owned.json"
"""The record of the files this run wrote (`lmppo.run.ownership`)."""

# ----------------------------------------------------------------------------- a checkpoint folder
MANIFEST = "manifest.json"
"""The last file written into a checkpoint folder: sizes and sha256 of the others (`lmppo.run.manifest`)."""
STATE = "state.json"
TRAINED = "trained.safetensors"
OPTIMIZER = "optimizer.pt"
REQUIRED_FILES = (STATE, TRAINED, OPTIMIZER)
"""The files of every checkpoint (beside the RNG files of each process, `rng_files`)."""
CHECKPOINT_NAME = re.compile(r"^iter-(\d+)$")
"""A published checkpoint folder's name; group 1: its iteration."""
CHECKPOINT_ENTRY = re.compile(r"^(iter-\d+|\.iter-\d+\..*|corrupt-iter-\d+-\w+)$")
"""Everything lmppo puts in `checkpoints/`: published folders, the writer's and pruner's temporaries
(`.iter-N.tmp`, `.iter-N.old-*`, `.iter-N.del-*`) and folders a resume set aside (`set_aside_name`)."""
CHECKPOINT_TEMPORARY = re.compile(r"^\.iter-\d+\.tmp$")
"""The checkpoint writer's folder before it is published (`checkpoint_temporary`)."""


def checkpoint_name(iteration: int) -> str:
    """`iter-00000004`: the folder of the checkpoint after `iteration` iterations."""
    return f"iter-{iteration:08d}"


def checkpoint_temporary(name: str) -> str:
    """`.iter-00000004.tmp`: where checkpoint `name` is written before it is renamed into place."""
    return f".{name}.tmp"


def set_aside_name(name: str, tag: str) -> str:
    """`corrupt-iter-00000004-TAG`: checkpoint `name` set aside by a resume (it failed verification)."""
    return f"corrupt-{name}-{tag}"


def is_checkpoint_leftover(name: str) -> bool:
    """Whether `name` in `checkpoints/` is the temporary of a killed write or removal (`.iter-N.tmp`, ...)."""
    return name.startswith(".iter-") and any(mark in name for mark in (".tmp", ".old-", ".del-"))


def rng_files(rank: int) -> tuple[str, str]:
    """(tensors, JSON) of process `rank`'s random-number state in a checkpoint."""
    return f"rng-rank{rank}.safetensors", f"rng-rank{rank}.json"
