"""Shared fixtures: tiny models and a tokenizer built in-process (no downloads)."""

from __future__ import annotations

import os
import sys
import warnings

import pytest
import torch

TESTS = os.path.dirname(os.path.abspath(__file__))
"""The tests folder: helper scripts (workers, stand-ins) and data live here, beside this file."""
REPO = os.path.dirname(TESTS)
sys.path.insert(0, TESTS)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(1)

from helpers_tokenizers import make_bpe_tokenizer  # noqa: E402


def ctrl_c_as_in_a_terminal() -> None:
    """`preexec_fn` of a child a test sends Ctrl-C (SIGINT): handled as in a terminal. A shell starts background jobs
    with SIGINT ignored (the test suite under `&` or a job runner), and Python then keeps ignoring it, as it should: the
    child would not stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(autouse=True)
def _cli_settings_do_not_leak():
    """`lmppo.apps.cli.main` called in-process sets process-wide console settings (LMPPO_DEBUG for `--debug`, the
    one-line warning format): each test gets them back as they were, so a later subprocess test is not changed."""
    env = {k: os.environ.get(k) for k in ("LMPPO_DEBUG", "TQDM_DISABLE")}
    formatwarning = warnings.formatwarning
    yield
    warnings.formatwarning = formatwarning
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@pytest.fixture(scope="session")
def tokenizer():
    return make_bpe_tokenizer()


def tiny_llama(tokenizer, seed: int = 0, hidden: int = 32, layers: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(cfg).eval()


def tiny_gpt2(tokenizer, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(
        vocab_size=len(tokenizer),
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=256,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    return GPT2LMHeadModel(cfg).eval()


@pytest.fixture()
def llama(tokenizer):
    return tiny_llama(tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama policy saved as an HF folder (safetensors), with its tokenizer."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tiny_llama(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory, tokenizer):
    """A tiny LlamaForSequenceClassification reward model folder (one label)."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
    )
    path = tmp_path_factory.mktemp("tiny_rm")
    LlamaForSequenceClassification(cfg).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


PROMPTS = [
    "the movie was",
    "this film is",
    "my friend felt",
    "the story seemed",
    "a critic said",
    "the ending was",
    "the actor looked",
    "we left early because",
]


@pytest.fixture()
def prompts():
    return list(PROMPTS)


def count_forward_calls(monkeypatch, cls) -> list[bool]:
    """One entry per `cls.forward` call from now on: whether it ran with an autograd graph."""
    calls: list[bool] = []
    original = cls.forward

    def counted(self, *args, **kwargs):
        calls.append(torch.is_grad_enabled() and not torch.is_inference_mode_enabled())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, "forward", counted)
    return calls


def set_fields(cfg, **fields):
    """Set config fields named with `__` for dots (value__mode="critic" sets cfg.value.mode)."""
    for dotted, value in fields.items():
        obj = cfg
        *parents, leaf = dotted.split("__")
        for p in parents:
            obj = getattr(obj, p)
        assert hasattr(obj, leaf), dotted
        setattr(obj, leaf, value)
    return cfg


def small_config(output_dir: str, iterations: int = 2, batch: int = 8, **fields):
    """A small, fast config: 6 new tokens, 2 minibatches of 2 micro-batches, 2 epochs, lr 1e-3, no trackers."""
    from lmppo.config import Config

    cfg = Config()
    cfg.precision = "fp32"  # the same numbers on every CPU (`auto` picks bf16 where it is native)
    cfg.output_dir = str(output_dir)
    cfg.total_episodes = iterations * batch
    cfg.rollout.batch_size = batch
    cfg.rollout.max_new_tokens = 6
    cfg.rollout.temperature = 1.0
    cfg.ppo.micro_batch_size = 4
    cfg.ppo.num_minibatches = 2
    cfg.ppo.num_epochs = 2
    cfg.ppo.learning_rate = 1e-3
    cfg.log.trackers = []
    cfg.log.sample_every = 0
    return set_fields(cfg, **fields)


def frac_target_reward(tokenizer):
    """A rule-based reward: the fraction of response tokens in the first quarter of the vocabulary."""
    target = set(range(len(tokenizer) // 4))

    def frac_target(prompts, completions):
        ids = [tokenizer.encode(c, add_special_tokens=False) for c in completions]
        return [sum(i in target for i in x) / max(len(x), 1) for x in ids]

    return frac_target


def hand_episodes(prompt_ids, prompt_mask, response_ids, response_mask, terminated, truncated, prompts_text, texts):
    """Hand-made single responses as the road's episodes (one turn each), for a hand-made `Rollout`."""
    from lmppo.episodes.road import EpisodePrompts, single_responses
    from lmppo.sampling.engines import PromptBatch

    token_lists = [row[m].tolist() for row, m in zip(prompt_ids, prompt_mask.bool())]
    batch = PromptBatch(prompt_ids, prompt_mask, token_lists, seeds=[0] * len(token_lists))
    prompts = EpisodePrompts(batch, list(prompts_text))
    return single_responses(prompts, response_ids, response_mask, terminated, truncated, list(texts))


def hand_rollout(**fields):
    """A `Rollout` of hand-made single responses: its tensors from `fields`, its episodes (`hand_episodes`) from
    them and `prompts_text` / `responses_text`; `action_mask` is the response mask."""
    from lmppo.training.batch import Rollout

    prompts_text, texts = fields.pop("prompts_text"), fields.pop("responses_text")
    episodes = hand_episodes(
        fields["prompt_ids"], fields["prompt_mask"], fields["response_ids"], fields["response_mask"],
        fields["terminated"], fields["truncated"], prompts_text, texts,
    )  # fmt: skip
    shown = fields.pop("prompts_shown", list(prompts_text))
    return Rollout(**fields, action_mask=fields["response_mask"], episodes=episodes, prompts_shown=shown)
