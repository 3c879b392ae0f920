"""Small deterministic tokenizers built in-process for tests (no downloads).

``make_bpe_tokenizer()``: a byte-level BPE (GPT-2 style, spaces carried as a ``Ġ`` prefix) trained on a few
hundred lines of generated English with some accented and CJK words, vocabulary ~400. Tokens and characters do
not align one to one: common words are one multi-character token, rare words split into pieces, and
non-ASCII characters may be split across two tokens at the byte level. It has pad/bos/eos tokens, chat tokens
``<|im_start|>`` / ``<|im_end|>`` and a ChatML chat template. ``add_bos=True`` gives a variant whose
``tokenizer(text)`` prepends BOS (like Llama's).

``make_wordpiece_tokenizer()``: a BERT-like WordPiece tokenizer ([CLS] text [SEP]) for encoder reward models,
so reward-model tests use a tokenizer different from the policy's.
"""

from __future__ import annotations

import random
from functools import lru_cache

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

BPE_SPECIAL = ["<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>"]

_SUBJECTS = [
    "the movie",
    "this film",
    "the story",
    "my friend",
    "the actor",
    "a critic",
    "the ending",
    "the music",
    "our team",
    "the city",
    "the café",
    "a naïve hero",
    "the old man",
    "the children",
]
_VERBS = ["was", "is", "felt", "seemed", "became", "looked", "sounded", "remained"]
_ADJS = [
    "good",
    "great",
    "bad",
    "boring",
    "wonderful",
    "terrible",
    "funny",
    "slow",
    "bright",
    "strange",
    "beautiful",
    "sad",
    "happy",
    "long",
    "short",
    "clever",
    "dull",
    "exciting",
]
_TAILS = [
    "and I loved it.",
    "but nobody cared.",
    "so we left early.",
    "because of the plot.",
    "in the end.",
    "after all.",
    "for a while.",
    "to be honest.",
    "as expected.",
    "today.",
    "with a smile.",
    "at the résumé desk.",
    "near 東京 station.",
    "said the über fan.",
]


def corpus(num_lines: int = 400, seed: int = 0) -> list[str]:
    """Deterministic English-like lines (a few with accented and CJK characters)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_ADJS)} {rng.choice(_TAILS)}"
        lines.append(s[0].upper() + s[1:])
    return lines


@lru_cache(maxsize=None)
def _bpe_json(vocab_size: int, add_bos: bool) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=BPE_SPECIAL,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    if add_bos:
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(
            single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", bos)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok.to_str()


def make_bpe_tokenizer(
    add_bos: bool = False, chat_template: bool = True, vocab_size: int = 400
) -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer (see the module docstring)."""
    tok = Tokenizer.from_str(_bpe_json(vocab_size, add_bos))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE if chat_template else None,
        model_max_length=512,
    )


@lru_cache(maxsize=None)
def _wordpiece_json() -> str:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=special, show_progress=False)
    tok.train_from_iterator(corpus(seed=1), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    return tok.to_str()


def make_wordpiece_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh BERT-like WordPiece tokenizer ([CLS] ... [SEP]), vocabulary ~300."""
    return PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_wordpiece_json()),
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        model_max_length=512,
    )
