"""The native sampler: exact sampling from softmax(logits / T), and responses that depend only on their seed."""

import torch

from conftest import tiny_gpt2, tiny_llama
from lmppo.sampling.hf import left_pad
from lmppo.sampling.native import response_seed, sample_native


def test_samples_follow_softmax_at_the_temperature(tokenizer):
    """One step from a fixed prompt, N draws: the total-variation distance between the empirical frequencies
    and softmax(logits / T) must be no larger than what exact sampling (torch.multinomial) gives with the
    same N, up to 25% (an exact sampler's TV at this N is pure sampling noise)."""
    model = tiny_llama(tokenizer)
    with torch.no_grad():  # a peaked distribution, so the temperature matters
        model.lm_head.weight.mul_(40.0)
    N, T = 4000, 0.5
    ids = torch.tensor([[5, 6, 7]]).repeat(N, 1)
    mask = torch.ones_like(ids, dtype=torch.bool)
    r, *_ = sample_native(
        model,
        ids,
        mask,
        T,
        1,
        torch.tensor([], dtype=torch.long),
        tokenizer.pad_token_id,
        [response_seed(1, 0, i) for i in range(N)],
    )
    with torch.no_grad():
        p = torch.softmax(model(ids[:1]).logits[0, -1] / T, -1)
    tv = 0.5 * (torch.bincount(r[:, 0], minlength=p.numel()).float() / N - p).abs().sum().item()
    g = torch.Generator().manual_seed(0)
    exact = [
        0.5
        * (torch.bincount(torch.multinomial(p, N, replacement=True, generator=g), minlength=p.numel()).float() / N - p)
        .abs()
        .sum()
        .item()
        for _ in range(20)
    ]
    assert tv <= 1.25 * max(exact), (tv, exact)
    # and a wrong temperature would be detected: T = 1 draws are far from softmax(logits / 0.5)
    r1, *_ = sample_native(
        model,
        ids,
        mask,
        1.0,
        1,
        torch.tensor([], dtype=torch.long),
        tokenizer.pad_token_id,
        [response_seed(1, 0, i) for i in range(N)],
    )
    tv1 = 0.5 * (torch.bincount(r1[:, 0], minlength=p.numel()).float() / N - p).abs().sum().item()
    assert tv1 > 2 * max(exact)


def test_a_response_depends_only_on_its_seed_and_prompt(tokenizer):
    for build in (tiny_llama, tiny_gpt2):
        model = build(tokenizer)
        prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13], [20, 21]]
        seeds = [response_seed(0, 3, i) for i in range(3)]
        ids, mask = left_pad(prompts, tokenizer.pad_token_id)
        stop = torch.tensor([tokenizer.eos_token_id])
        together, *_ = sample_native(model, ids, mask, 1.0, 8, stop, tokenizer.pad_token_id, seeds)
        for i, prompt in enumerate(prompts):  # alone: no padding at all
            alone, *_ = sample_native(
                model,
                torch.tensor([prompt]),
                torch.ones(1, len(prompt), dtype=torch.bool),
                1.0,
                8,
                stop,
                tokenizer.pad_token_id,
                seeds[i : i + 1],
            )
            n = alone.shape[1]
            assert together[i, :n].tolist() == alone[0].tolist()


def test_stop_token_ends_a_response_and_padding_follows(tokenizer):
    model = tiny_llama(tokenizer)
    with torch.no_grad():  # make the stop token overwhelmingly likely after the first step
        model.lm_head.weight[tokenizer.eos_token_id] = model.lm_head.weight[tokenizer.eos_token_id] * 0 + 0.0
        model.lm_head.bias = None
    ids, mask = left_pad([[5, 6, 7]] * 4, tokenizer.pad_token_id)
    stop = torch.tensor([tokenizer.eos_token_id])
    r, rm, term, trunc = sample_native(
        model, ids, mask, 1e-3, 5, stop, tokenizer.pad_token_id, [response_seed(0, 0, i) for i in range(4)]
    )
    for row, m, t, tr in zip(r, rm, term, trunc):
        n = int(m.sum())
        assert bool(t) == (row[n - 1].item() == tokenizer.eos_token_id)
        assert bool(tr) == (not t and n == 5)
        assert (row[n:] == tokenizer.pad_token_id).all()


def test_response_seeds_differ():
    seeds = {response_seed(s, it, p) for s in range(3) for it in range(20) for p in range(64)}
    assert len(seeds) == 3 * 20 * 64
    assert all(0 <= s < 2**63 for s in seeds)
