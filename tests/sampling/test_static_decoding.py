"""Static decoding (lmppo.sampling.static_decoding): the same tokens as the dynamic loop for the same noise, the
stop checked only every `stop_check_every` steps, batch buckets that change no token, and no host random numbers."""

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import tiny_gpt2, tiny_llama
from lmppo.sampling.cuda_graphs import BATCH_BUCKETS, PROMPT_MULTIPLE
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed, sample_native
from lmppo.sampling.noise import seed_tensor
from lmppo.sampling.static_decoding import StaticDecoder, decode, pad_batch, round_up, supports_static_decoding

PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20, 21], [30], [40, 41, 42, 43]]


class OpCounter(TorchDispatchMode):
    """Counts every aten op run inside it (a real run of the sampler, nothing replaced)."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def stop_heavy(model, tokenizer, boost: float = 3.0):
    """Make the stop token likely enough that rows stop at different steps."""
    with torch.no_grad():
        model.lm_head.weight[tokenizer.eos_token_id] += boost * model.lm_head.weight.std()
    return model


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2])
def test_static_decoding_gives_the_dynamic_loops_tokens(tokenizer, build):
    model = stop_heavy(build(tokenizer), tokenizer).eval()
    assert supports_static_decoding(model)
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    stop = torch.tensor([tokenizer.eos_token_id])
    for iteration, temperature in ((0, 1.0), (1, 0.5), (2, 2.0)):
        seeds = [response_seed(7, iteration, i) for i in range(len(PROMPTS))]
        want = sample_native(model, ids, mask, temperature, 24, stop, tokenizer.pad_token_id, seeds, "dynamic")
        for every in (1, 3, 50):
            got = sample_native(model, ids, mask, temperature, 24, stop, tokenizer.pad_token_id, seeds, "static", every)
            for w, g in zip(want, got):
                assert torch.equal(w, g), (iteration, every)
    terminated, lengths = want[2], want[1].sum(1)
    assert terminated.any() and lengths.min() < lengths.max()  # rows stopped, at different steps


def test_without_a_stop_token_every_response_runs_to_the_limit(tokenizer):
    model = tiny_llama(tokenizer).eval()
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    none = torch.tensor([], dtype=torch.long)
    seeds = [response_seed(1, 0, i) for i in range(len(PROMPTS))]
    want = sample_native(model, ids, mask, 1.0, 10, none, tokenizer.pad_token_id, seeds, "dynamic")
    got = sample_native(model, ids, mask, 1.0, 10, none, tokenizer.pad_token_id, seeds, "static", 4)
    assert all(torch.equal(w, g) for w, g in zip(want, got))
    assert got[0].shape == (len(PROMPTS), 10) and got[3].all()


def test_the_stop_is_read_from_the_device_every_stop_check_every_steps(tokenizer):
    model = tiny_llama(tokenizer).eval()
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    none = torch.tensor([], dtype=torch.long)  # no row stops: all 16 steps run
    seeds = [response_seed(0, 0, i) for i in range(len(PROMPTS))]
    syncs = {}
    for every in (1, 4, 16):
        with OpCounter() as counter:
            sample_native(model, ids, mask, 1.0, 16, none, tokenizer.pad_token_id, seeds, "static", every)
        syncs[every] = counter.ops["aten._local_scalar_dense"]  # .item() / bool() of a tensor: a host sync
    # checks at steps every, 2 * every, ... < 16, plus one read of the lengths at the end
    assert syncs == {1: 15 + 1, 4: 3 + 1, 16: 0 + 1}


def test_sampling_uses_no_host_generator_and_no_random_op(tokenizer):
    model = tiny_llama(tokenizer).eval()
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    stop = torch.tensor([tokenizer.eos_token_id])
    seeds = [response_seed(0, 0, i) for i in range(len(PROMPTS))]
    state = torch.get_rng_state()
    for decoding in ("dynamic", "static"):
        with OpCounter() as counter:
            sample_native(model, ids, mask, 1.0, 12, stop, tokenizer.pad_token_id, seeds, decoding)
        random_ops = [op for op in counter.ops if any(w in op for w in ("rand", "uniform", "normal", "bernoulli"))]
        assert random_ops == [] and counter.ops["aten.bitwise_xor"] > 0  # the noise is SplitMix64 in integer ops
    assert torch.equal(torch.get_rng_state(), state)


def test_a_batch_bucket_with_filler_rows_and_extra_left_padding_changes_no_token(tokenizer):
    """What the CUDA-graph path does to reach a bucket, run eagerly: 5 prompts of <= 6 tokens padded to 8 rows of
    32 columns give the 5 responses the unpadded batch gives."""
    model = stop_heavy(tiny_llama(tokenizer), tokenizer).eval()
    ids, mask = left_pad(PROMPTS, tokenizer.pad_token_id)
    seeds = seed_tensor([response_seed(3, 1, i) for i in range(len(PROMPTS))], "cpu")
    stop = torch.tensor([tokenizer.eos_token_id])
    batch, width = round_up(5, BATCH_BUCKETS, 64), round_up(6, (), PROMPT_MULTIPLE)
    assert (batch, width) == (8, 32)
    tokens = {}
    for name, inputs in (
        ("plain", (ids, mask, seeds, torch.zeros(5, dtype=torch.bool))),
        ("bucket", pad_batch(ids, mask, seeds, batch, width, tokenizer.pad_token_id)),
    ):
        decoder = StaticDecoder(model, inputs[0].shape[0], inputs[0].shape[1], 20, 1.0, stop, 0, torch.device("cpu"))
        with torch.no_grad():
            decoder.prefill(*inputs)
            tokens[name] = decode(decoder, 4)[0].clone()
    assert torch.equal(tokens["bucket"][:5], tokens["plain"])
    assert (tokens["bucket"][5:] == 0).all()  # filler rows are finished from the start: padding only


def test_bad_decoding_arguments_are_refused(tokenizer):
    model = tiny_llama(tokenizer)
    ids, mask = left_pad(PROMPTS[:1], tokenizer.pad_token_id)
    stop = torch.tensor([tokenizer.eos_token_id])
    with pytest.raises(ValueError, match="decoding='fast'"):
        sample_native(model, ids, mask, 1.0, 4, stop, 0, [1], decoding="fast")
    with pytest.raises(ValueError, match="stop_check_every=0"):
        sample_native(model, ids, mask, 1.0, 4, stop, 0, [1], decoding="static", stop_check_every=0)
    model.config._attn_implementation = "eager"
    assert not supports_static_decoding(model)
    with pytest.raises(ValueError, match="decoding='static'.*sdpa"):
        sample_native(model, ids, mask, 1.0, 4, stop, 0, [1], decoding="static")
