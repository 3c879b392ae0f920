"""Reward models as sources (lmppo.rewards.model): scores equal to an unpadded forward pass, autocast, token-id
input, and the refusals (pickle weights, several labels, a missing folder)."""

from __future__ import annotations

import pytest
import torch

from helpers_tokenizers import make_bpe_tokenizer, make_wordpiece_tokenizer
from lmppo.config import RewardConfig, RewardSourceConfig
from lmppo.errors import RewardError
from lmppo.rewards import SourceContext, build_reward_sources


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory):
    from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("rms")
    dec_tok = make_bpe_tokenizer(add_bos=True)  # its own tokenizer, prepends BOS
    dec = LlamaForSequenceClassification(
        LlamaConfig(
            vocab_size=len(dec_tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=128,
            num_labels=1,
            pad_token_id=dec_tok.pad_token_id,
        )
    )
    dec.save_pretrained(root / "decoder")
    dec_tok.save_pretrained(root / "decoder")
    enc_tok = make_wordpiece_tokenizer()  # a different tokenizer than the policy's
    enc = BertForSequenceClassification(
        BertConfig(
            vocab_size=len(enc_tok),
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            max_position_embeddings=64,
            num_labels=1,
        )
    )
    enc.save_pretrained(root / "encoder")
    enc_tok.save_pretrained(root / "encoder")
    # a folder holding only pickle weights, and one with two labels
    (root / "pickled").mkdir()
    dec.config.save_pretrained(root / "pickled")
    torch.save({}, root / "pickled" / "pytorch_model.bin")
    (root / "twolabels").mkdir()
    two = LlamaConfig(num_labels=2)
    two.save_pretrained(root / "twolabels")
    (root / "twolabels" / "model.safetensors").write_bytes(b"")
    return root, dec.eval(), enc.eval()


TEXTS = (
    ["Prompt: ", "Q: ", "A much longer prompt that is here "],
    ["the movie was great.", "bad", "and the ending was sad and slow, to be honest."],
)


def model_source(path, input="text", **ctx):
    cfg = RewardConfig(sources=[RewardSourceConfig(kind="model", path=str(path), input=input)])
    return build_reward_sources(cfg, ctx=SourceContext(**ctx))[0]


@pytest.mark.parametrize("which", ["decoder", "encoder"])
def test_model_source_equals_unpadded_forward(rm_dirs, which):
    root, dec, enc = rm_dirs
    src = model_source(root / which, batch_size=2)  # batches of 2: padding inside a batch
    scores = src(*TEXTS)
    model = dec if which == "decoder" else enc
    expected = []
    with torch.no_grad():
        for p, c in zip(*TEXTS):
            enc_ids = src.tokenizer(p + c, return_tensors="pt")["input_ids"]
            expected.append(model(input_ids=enc_ids).logits[0, 0].item())
    assert src.decoder_head == (which == "decoder")
    assert scores == pytest.approx(expected, abs=1e-5)
    assert src.name == which


@pytest.mark.parametrize("which", ["decoder", "encoder"])
def test_model_source_runs_under_autocast_when_asked(rm_dirs, which):
    """precision: bf16 reaches the reward model: scores move by bf16 rounding, stay float32, keep their order."""
    root, _, _ = rm_dirs
    fp32 = torch.tensor(model_source(root / which, batch_size=2)(*TEXTS))
    src = model_source(root / which, batch_size=2, autocast_dtype=torch.bfloat16)
    bf16 = torch.tensor(src(*TEXTS))
    assert src.score_texts(["a text"]).dtype == torch.float32
    assert not torch.equal(bf16, fp32)  # autocast really ran
    torch.testing.assert_close(bf16, fp32, rtol=0.05, atol=0.02 * fp32.abs().max().item())


def test_model_source_reads_token_ids_as_given(rm_dirs):
    """input: tokens: the reward model sees exactly the ids it is given (no decode / re-encode), padding inside a
    batch does not change a score, and the score is read at the last real token."""
    root, dec, _ = rm_dirs
    src = model_source(root / "decoder", input="tokens", batch_size=2)
    sequences = [[5, 9, 17, 4], [8, 30], [12, 7, 7, 7, 7, 40]]
    scores = src(["p"] * 3, ["c"] * 3, token_ids=sequences)
    with torch.no_grad():
        expected = [dec(input_ids=torch.tensor([s])).logits[0, 0].item() for s in sequences]
    assert scores == pytest.approx(expected, abs=1e-5)
    with pytest.raises(RewardError, match="token_ids"):
        src(["p"], ["c"])  # a token-reading source called without ids is an error, not a silent text fallback


@pytest.mark.parametrize(
    "kind,path,value,match",
    [
        ("function", "m:f", "tokens", "is for reward models"),
        ("model", "", "bytes", "must be one of"),
    ],
)
def test_input_field_is_validated(tmp_path, kind, path, value, match):
    from lmppo.config import Config
    from lmppo.errors import ConfigError

    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.model.policy = str(tmp_path)
    with pytest.raises(ConfigError, match=match) as err:  # a value outside the choices: on assignment already
        cfg.reward.sources = [{"kind": kind, "path": path or str(tmp_path), "input": value}]
        cfg.validate()
    assert "reward.sources[0].input" in str(err.value)


def test_trainer_refuses_token_input_with_another_tokenizer(rm_dirs, tmp_path, tokenizer):
    from conftest import PROMPTS, small_config, tiny_llama
    from lmppo.errors import ConfigError
    from lmppo.training.trainer import PPOTrainer

    root, _, _ = rm_dirs
    cfg = small_config(tmp_path / "run")
    cfg.reward.sources = [RewardSourceConfig(kind="model", path=str(root / "encoder"), input="tokens")]
    with pytest.raises(ConfigError, match=r"reward.sources\[0\].input.*own tokenizer"):
        PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS)


def test_trainer_scores_the_sampled_ids_with_token_input(tmp_path, tokenizer, tiny_reward_model_dir):
    """End to end: with input: tokens the score of each response is the reward model's output on the exact
    prompt + response ids of the rollout."""
    from transformers import AutoModelForSequenceClassification

    from conftest import PROMPTS, small_config, tiny_llama
    from lmppo.training.trainer import PPOTrainer

    cfg = small_config(tmp_path / "run")
    cfg.reward.sources = [RewardSourceConfig(kind="model", path=tiny_reward_model_dir, input="tokens", name="rm")]
    trainer = PPOTrainer(cfg, policy=tiny_llama(tokenizer), tokenizer=tokenizer, prompts=PROMPTS)
    rollout = trainer.collect_rollout()
    scored = trainer.score(rollout)
    rm = AutoModelForSequenceClassification.from_pretrained(tiny_reward_model_dir).eval()
    with torch.no_grad():
        for i in range(rollout.batch_size):
            ids = torch.cat(
                [rollout.prompt_ids[i][rollout.prompt_mask[i]], rollout.response_ids[i][rollout.response_mask[i]]]
            )
            expected = rm(input_ids=ids[None]).logits[0, 0].item()
            assert scored.per_source["rm"][i].item() == pytest.approx(expected, abs=1e-4)


def test_model_source_refuses_pickles_and_several_labels(rm_dirs, tmp_path):
    root, *_ = rm_dirs
    with pytest.raises(RewardError, match=r"holds only pickle weights \(pytorch_model.bin\).*model.allow_pickle"):
        model_source(root / "pickled")
    with pytest.raises(RewardError, match="has 2 labels; a reward model must have exactly one"):
        model_source(root / "twolabels")
    with pytest.raises(RewardError, match="no such folder"):
        model_source(tmp_path / "nowhere")
