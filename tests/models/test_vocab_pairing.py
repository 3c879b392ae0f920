"""The tokenizer and the policy are paired before the first sample: ids the embedding has no row for are one
line naming both sizes and the added tokens (lmppo.models.loading.check_vocab_fits), not torch's IndexError."""

from __future__ import annotations

import copy
import os
import re

import pytest

from cli_support import assert_one_clean_line, changed, env, run_cli, write  # noqa: F401  (env: a fixture)
from conftest import tiny_llama
from helpers_tokenizers import make_bpe_tokenizer
from lmppo.errors import LmppoError
from lmppo.models.loading import check_vocab_fits


def _with_tool_tokens():
    tok = copy.deepcopy(make_bpe_tokenizer())  # 400 tokens
    tok.add_tokens(["<tool>", "</tool>"])
    assert [tok.convert_tokens_to_ids(t) for t in ("<tool>", "</tool>")] == [400, 401]
    return tok


def test_added_tokens_without_rows_are_named_with_both_sizes():
    tok = _with_tool_tokens()
    model = tiny_llama(make_bpe_tokenizer())  # 400 embedding rows
    with pytest.raises(LmppoError) as info:
        check_vocab_fits(tok, model, "model.policy")
    msg = str(info.value)
    assert "the tokenizer (model.policy) has 402 tokens but the policy's input embedding has 400 rows" in msg
    assert "`<tool>` (400), `</tool>` (401)" in msg and "resize_token_embeddings(402)" in msg
    check_vocab_fits(make_bpe_tokenizer(), model, "model.policy")  # the matching pair passes
    model.resize_token_embeddings(402)
    check_vocab_fits(tok, model, "model.policy")  # a resized model passes


def test_a_larger_base_vocabulary_is_named_by_its_ids():
    model = tiny_llama(make_bpe_tokenizer(vocab_size=300))
    with pytest.raises(LmppoError, match=r"has 400 tokens .* 300 rows \(ids 300-399 have no row\)"):
        check_vocab_fits(make_bpe_tokenizer(), model, "model.tokenizer")


def test_the_cli_refuses_the_pair_in_one_line_before_the_first_sample(env, capsys, tmp_path):
    base_dir, base = env
    tok_dir = str(tmp_path / "tool_tokenizer")
    _with_tool_tokens().save_pretrained(tok_dir)
    prompts = write(base_dir, "tools.txt", text="call <tool> now </tool>\nthe movie was <tool>\n")
    cfg = changed(base, model__tokenizer=tok_dir, data__prompts=prompts)
    code, err = run_cli(["train", write(base_dir, "c.yaml", data=cfg)], capsys)
    assert_one_clean_line(code, err, "model.tokenizer", "402 tokens", "400 rows", "`<tool>` (400), `</tool>` (401)")
    assert "IndexError" not in err and "index out of range" not in err
    assert not os.path.exists(os.path.join(base["output_dir"], "metrics.jsonl"))  # no iteration ran


def test_a_hidden_size_mismatch_names_a_tensor_and_both_shapes(tmp_path):
    import json

    from lmppo.config import ModelConfig
    from lmppo.models.files import ModelFolderError
    from lmppo.models.loading import load_policy

    folder = tmp_path / "model"
    tiny_llama(make_bpe_tokenizer()).save_pretrained(folder)  # hidden size 32
    config = json.loads((folder / "config.json").read_text())
    config["hidden_size"] = 64  # a config.json of another model
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError) as info:
        load_policy(ModelConfig(policy=str(folder)), str(folder))
    msg = str(info.value)
    assert "above report" not in msg and "\n" not in msg
    assert "the weights do not have the shapes its config.json gives: `" in msg
    shapes = r"`[\w.]+` is \[(400, )?32\] in the weights file, \[(400, )?64\] by config.json \(and \d+ more tensors\)"
    assert re.search(shapes, msg), msg


def test_a_critic_with_fewer_rows_than_the_tokenizer_is_named():
    from transformers import LlamaConfig, LlamaForSequenceClassification

    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4)
    critic = LlamaForSequenceClassification(cfg)  # a reward model with another, smaller vocabulary
    with pytest.raises(
        LmppoError, match=r"\(value.init_from\) has 400 tokens but the critic's input embedding has 300"
    ):
        check_vocab_fits(make_bpe_tokenizer(), critic, "value.init_from", "critic")
