"""The native sampler's counter-based noise (lmppo.sampling.noise): Philox4x32-10 known answers, the layout of words
over the vocabulary, the Gumbel transform by hand, moments on 1e6 draws, and independence from the batch."""

import math

import pytest
import torch

from lmppo.sampling.noise import (
    CPU_CHUNK,
    gumbel_argmax,
    gumbel_from_words,
    gumbel_noise,
    mix64,
    seed_tensor,
    splitmix64,
    uniform_words,
)

# SplitMix64 seeded with 1234567, outputs 1-5 (Vigna's splitmix64.c; Rosetta Code "Pseudo-random numbers/Splitmix64")
SPLITMIX_1234567 = [
    6457827717110365317,
    3203168211198807973,
    9817491932198370423,
    4593380528125082431,
    16408922859458223821,
]
U64 = (1 << 64) - 1


def test_splitmix64_matches_the_reference_outputs_one_by_one_and_batched():
    state = torch.tensor(1234567)
    assert [int(splitmix64(state, n)) & U64 for n in range(1, 6)] == SPLITMIX_1234567
    batched = splitmix64(torch.tensor([1234567]), torch.arange(1, 6))
    assert [int(x) & U64 for x in batched] == SPLITMIX_1234567
    # the mix of 0 is 0; of 0x9E3779B97F4A7C15 (seed 0, output 1) 0xE220A8397B1DCDAF, the reference's first output
    assert int(mix64(torch.tensor(0))) == 0
    assert int(splitmix64(torch.tensor(0), 1)) & U64 == 0xE220A8397B1DCDAF


def test_word_layout_over_the_vocabulary():
    # word v of (seed, step) = half v % 2 of output v // 2 + 1 of the stream seeded base = splitmix64(seed, step + 1)
    words = uniform_words(torch.tensor([1234567]), 0, 5)[0].tolist()
    base = splitmix64(torch.tensor(1234567), 1)  # step 0: the stream's first output, 6457827717110365317
    assert int(base) & U64 == SPLITMIX_1234567[0]
    z1, z2, z3 = (int(splitmix64(base, n)) & U64 for n in (1, 2, 3))
    assert words == [z1 & 0xFFFFFFFF, z1 >> 32, z2 & 0xFFFFFFFF, z2 >> 32, z3 & 0xFFFFFFFF]
    # step 2 starts from the stream's third output
    base2 = int(splitmix64(torch.tensor(1234567), 3)) & U64
    assert base2 == SPLITMIX_1234567[2]
    z1 = int(splitmix64(torch.tensor(base2 - (1 << 64)), 1)) & U64
    assert uniform_words(torch.tensor([1234567]), 2, 2)[0].tolist() == [z1 & 0xFFFFFFFF, z1 >> 32]


def test_gumbel_of_a_word_by_hand():
    # u = (w + 0.5) / 2^32; G = -log(-log(u))
    words = torch.tensor([[0, 0x80000000, 0xFFFFFFFF]])
    want = [-math.log(-math.log((w + 0.5) / 2**32)) for w in (0, 0x80000000, 0xFFFFFFFF)]
    assert want[0] == pytest.approx(-math.log(33 * math.log(2)), abs=1e-9)  # u = 2^-33: G = -3.1299
    assert want[1] == pytest.approx(-math.log(math.log(2)), abs=1e-9)  # u ~ 1/2: G = 0.3665
    assert want[2] == pytest.approx(22.87, abs=0.01)  # u = 1 - 2^-33: the largest value
    assert gumbel_from_words(words)[0].tolist() == pytest.approx(want, rel=1e-7)
    assert gumbel_from_words(words).dtype == torch.float32


def test_a_million_draws_are_uniform_and_gumbel():
    seeds = seed_tensor(range(100, 116), "cpu")
    words = uniform_words(seeds, 3, 62_500)  # 16 x 62,500 = 1e6
    u = (words.double() + 0.5) / 2**32
    n = u.numel()
    assert u.mean().item() == pytest.approx(0.5, abs=4 * math.sqrt(1 / 12 / n))
    assert u.var().item() == pytest.approx(1 / 12, rel=0.01)
    counts = torch.bincount((words >> 28).flatten(), minlength=16).double()  # top 4 bits: 16 equiprobable bins
    chi2 = ((counts - n / 16) ** 2 / (n / 16)).sum().item()
    assert chi2 < 37.7  # chi-square, 15 degrees of freedom, p = 0.001
    g = gumbel_noise(seeds, 3, 62_500).double()
    assert g.mean().item() == pytest.approx(0.5772156649, abs=4 * math.sqrt(math.pi**2 / 6 / n))  # Euler's gamma
    assert g.var().item() == pytest.approx(math.pi**2 / 6, rel=0.01)
    # neighbouring words, steps and seeds are uncorrelated
    assert abs(torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1].item()) < 0.005
    other = (uniform_words(seeds, 4, 62_500).double() + 0.5) / 2**32
    assert abs(torch.corrcoef(torch.stack([u.flatten(), other.flatten()]))[0, 1].item()) < 0.005


def test_a_rows_noise_depends_only_on_its_seed_and_step_not_on_the_batch():
    seeds = seed_tensor([3, 2**62 + 11, 5, 99], "cpu")
    vocab = 3 * CPU_CHUNK  # wide enough that the CPU goes a row at a time
    whole = gumbel_noise(seeds, 9, vocab)
    assert torch.equal(whole, gumbel_from_words(uniform_words(seeds, 9, vocab)))  # chunked == in one pass
    for split in ([0, 1, 2, 3], [0, 3], [1, 4]):
        pieces = [gumbel_noise(seeds[a:b], 9, vocab) for a, b in zip(split, split[1:] + [4])]
        assert torch.equal(torch.cat(pieces), whole[split[0] :])
    assert torch.equal(gumbel_noise(seeds.flip(0), 9, vocab), whole.flip(0))
    assert torch.equal(gumbel_noise(seeds, torch.tensor(9), vocab), whole)  # a device step counter
    assert not torch.equal(gumbel_noise(seeds, 10, vocab), whole)
    assert torch.equal(gumbel_noise(seeds, 9, 7), whole[:, :7])  # a wider vocabulary only appends


def test_gumbel_argmax_is_the_argmax_of_scaled_logits_plus_the_noise():
    seeds = seed_tensor([1, 2, 3], "cpu")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = (logits.float() / 0.7 + gumbel_noise(seeds, 4, 50)).argmax(-1)
    assert torch.equal(gumbel_argmax(logits, 0.7, seeds, 4), want)
