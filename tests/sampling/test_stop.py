"""`rollout.stop_token` as ids (lmppo.sampling.stop), one resolution for training and `lmppo eval`."""

import pytest

from helpers_tokenizers import make_bpe_tokenizer
from lmppo.errors import ConfigError
from lmppo.sampling.stop import stop_token_ids


@pytest.fixture(scope="module")
def tok():
    return make_bpe_tokenizer()


def test_eos_none_and_a_named_token(tok):
    assert stop_token_ids("eos", tok).tolist() == [tok.eos_token_id]
    assert stop_token_ids("none", tok).tolist() == []
    assert stop_token_ids("<|im_end|>", tok).tolist() == [tok.convert_tokens_to_ids("<|im_end|>")]


def test_text_that_is_not_one_token_is_refused(tok):
    with pytest.raises(ConfigError, match=r"rollout.stop_token.*is not a single token of this tokenizer \(it encodes"):
        stop_token_ids("the whole sentence here", tok)
