"""Shared, deterministic inputs for the lmppo-vs-TRL speed benchmark.

Everything here is built in-process from text that ships with Python itself (the docstrings of the
standard library), with fixed seeds, and saved once to a cache folder so that every trainer, in
every subprocess and every virtual environment, loads byte-identical weights, tokenizer and prompts.

Cache layout (``benchmarks/.cache/tiny`` by default)::

    tokenizer/       PreTrainedTokenizerFast (byte-level BPE, vocabulary 2048, <pad>/<bos>/<eos>, left padding)
    policy/          LlamaForCausalLM, 6 layers, hidden 512, intermediate 1376, 8 heads (~21.1M params), random init
    critic/          LlamaForSequenceClassification(num_labels=1): policy backbone + seeded score head
    reward/          LlamaForSequenceClassification(num_labels=1): "vowel-word counter" (see build_reward_model)
    prompts.json     {"train": [[ids...]...] (1024 prompts), "eval": [[ids...]...] (128 held-out), "text": {...}}
    manifest.json    versions, sizes and a content hash of everything above

The reward model is a real ``LlamaForSequenceClassification`` whose weights were set by hand so the
reward is learnable in a few hundred episodes: layer 0 has one attention head with zero query/key
weights (so its attention is an exact average over the real tokens of the sequence) that reads a
"this token starts with a vowel" feature written into the token embeddings; the ``score`` head reads
that average at the last real token.  So the score is, up to small noise from the other (random)
layers, ``REWARD_SCALE * (fraction of tokens in prompt+response that start with a vowel - baseline)``,
where the baseline is the fraction for uniformly random responses (the untrained policy scores about 0).

The module itself imports only the standard library at import time so that the benchmark driver
can import it without torch; the heavy imports happen inside the functions.

CLI (run with an interpreter that has torch + transformers + tokenizers, e.g. the TRL venv)::

    python benchmarks/shared/common.py build [--cache DIR] [--force]
    python benchmarks/shared/common.py build-real --model-dir HF_FOLDER [--cache DIR] [--force]
    python benchmarks/shared/common.py eval --policy DIR --cache DIR [--seed 0] [--out result.json]
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import random
import re
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
DEFAULT_CACHE_ROOT = HERE / ".cache"
CACHE_FORMAT = 1

VOCAB_SIZE = 2048
SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>"]  # ids 0, 1, 2
TINY_ARCH = dict(
    hidden_size=512,
    intermediate_size=1376,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=8,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
N_TRAIN_PROMPTS = 1024
N_EVAL_PROMPTS = 128
PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS = 16, 32
SEED_TOKENIZER_TEXT = 1234
SEED_POLICY, SEED_CRITIC, SEED_REWARD = 1, 2, 3
REWARD_SCALE = 5.0
KNOB_DIMS, KNOB_CONST, KNOB_ALPHA = 16, 0.1, 120.0  # see add_vowel_knob

# Benchmark settings shared by both trainers (the driver copies these into each run's cfg).
BASE_SETTINGS = dict(
    batch_size=8,  # per_device_train_batch_size; grad accumulation 1
    num_mini_batches=1,
    ppo_epochs=4,
    response_length=32,
    learning_rate=3e-5,
    kl_coef=0.05,
    cliprange=0.2,
    cliprange_value=0.2,
    vf_coef=0.1,
    gamma=1.0,
    lam=0.95,
    temperature=1.0,  # sampling temperature during rollouts and evaluation
    stop_token="eos",  # responses are truncated after the first <eos>
    missing_eos_penalty=None,
    threads=1,
    dtype="float32",
    eval_samples_per_prompt=2,
    eval_prompts=128,  # held-out prompts scored after training (all of them for the tiny config)
)


# ----------------------------------------------------------------------------------------------
# Text corpus: docstrings of the Python standard library (ships with every Python).
# ----------------------------------------------------------------------------------------------


def stdlib_corpus() -> list[str]:
    """Paragraphs from docstrings of the top-level standard-library modules, in a fixed order.

    Deterministic for a given Python version (the cache stores the result, so both trainers always
    see the same tokenizer/prompts even if the cache was built under another version)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    paras: list[str] = []
    for path in sorted(stdlib.glob("*.py")):
        if path.name.startswith(("_", "test")):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        nodes = [tree] + [
            n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        ]
        for node in nodes:
            doc = ast.get_docstring(node, clean=True)
            if not doc:
                continue
            for para in re.split(r"\n\s*\n", doc):
                text = " ".join(para.split())
                if not text or not text.isascii() or len(text) < 20:
                    continue
                # skip code-ish paragraphs (doctests etc.)
                if text.startswith((">>>", "...", "$", "#")) or text.count("(") > 6:
                    continue
                paras.append(text)
    # de-duplicate, keep first occurrence
    seen: set[str] = set()
    out = []
    for p in paras:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def train_tokenizer(corpus: list[str]):
    """Byte-level BPE with VOCAB_SIZE entries, wrapped as PreTrainedTokenizerFast (left padding)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer, length=len(corpus))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        padding_side="left",
        truncation_side="left",
        model_max_length=TINY_ARCH["max_position_embeddings"],
    )
    assert (hf.pad_token_id, hf.bos_token_id, hf.eos_token_id) == (0, 1, 2)
    return hf


def make_prompts(paras: list[str], encode, n_total: int, seed: int = SEED_TOKENIZER_TEXT):
    """n_total prompts of 16-32 tokens (length drawn per prompt) from the given paragraphs.

    ``encode`` maps text -> list of token ids.  Returns (ids, texts)."""
    rng = random.Random(seed)
    order = list(range(len(paras)))
    rng.shuffle(order)
    ids_out, texts = [], []
    for i in order:
        ids = encode(paras[i])
        if len(ids) < PROMPT_MIN_TOKENS:
            continue
        n = rng.randint(PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS)
        ids = ids[: min(n, len(ids))]
        ids_out.append(ids)
        texts.append(paras[i])
        if len(ids_out) == n_total:
            break
    if len(ids_out) < n_total:
        raise RuntimeError(f"only {len(ids_out)} prompts of >= {PROMPT_MIN_TOKENS} tokens in the corpus")
    return ids_out, texts


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------


def tiny_config(tokenizer, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        **TINY_ARCH,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        rope_theta=10000.0,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        **extra,
    )


def vowel_token_mask(tokenizer) -> list[bool]:
    """Tokens whose text (leading space removed) starts with a vowel letter: the reward's targets."""
    mask = []
    for i in range(len(tokenizer)):
        s = tokenizer.decode([i]).lstrip()
        mask.append(i not in tokenizer.all_special_ids and s[:1].lower() in ("a", "e", "i", "o", "u"))
    return mask


def add_vowel_knob(policy, tokenizer) -> dict:
    """Give the random policy one shared, initially switched-off "say vowel-initial tokens" direction.

    A randomly initialised policy has no structure shared by the ~600 target tokens, so PPO would have to
    raise 600 unrelated logits one by one and learns nothing measurable in a few hundred episodes.  Here
    KNOB_DIMS residual dimensions carry a constant (written by the embeddings, never by a layer), the
    final RMSNorm weight of those dimensions starts at 0 (so the untrained policy is unchanged: its
    logits do not depend on them), and the lm_head rows of the target tokens read them with weight
    KNOB_ALPHA.  Growing those few norm weights raises all target logits together; with Adam each
    consistent step moves them by ~lr, so the reward is learnable in tens of updates at lr 3e-5."""
    import torch

    target = torch.tensor(vowel_token_mask(tokenizer))
    dims = list(range(KNOB_DIMS))
    with torch.no_grad():
        policy.model.embed_tokens.weight[:, dims] = KNOB_CONST
        for layer in policy.model.layers:
            layer.self_attn.o_proj.weight[dims, :] = 0.0
            layer.mlp.down_proj.weight[dims, :] = 0.0
        policy.model.norm.weight[dims] = 0.0
        policy.lm_head.weight[:, dims] = 0.0
        policy.lm_head.weight[target.nonzero().flatten()[:, None], torch.tensor(dims)[None]] = KNOB_ALPHA
    return dict(dims=KNOB_DIMS, const=KNOB_CONST, alpha=KNOB_ALPHA, target_tokens=int(target.sum()))


def build_reward_model(tokenizer, prompts_train: list[list[int]], response_length: int = 32):
    """LlamaForSequenceClassification (num_labels=1) that counts vowel-initial tokens (see module doc)."""
    import torch
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(SEED_REWARD)
    cfg = tiny_config(tokenizer, num_labels=1)
    rm = LlamaForSequenceClassification(cfg).eval()
    target = torch.tensor(vowel_token_mask(tokenizer))
    H = cfg.hidden_size
    head_dim = H // cfg.num_attention_heads
    FEAT, COUNT, CONST = 0, 1, 2  # residual-stream dimensions we take over
    A, C = 0.5, 0.3
    with torch.no_grad():
        emb = rm.model.embed_tokens.weight
        emb[:, FEAT] = torch.where(target, torch.tensor(A), torch.tensor(-A))  # +-A: same norm for all tokens
        emb[:, COUNT] = 0.0
        emb[:, CONST] = C
        attn = rm.model.layers[0].self_attn
        h0 = slice(0, head_dim)  # head 0 of layer 0: uniform attention over the real tokens
        attn.q_proj.weight[h0] = 0.0
        attn.k_proj.weight[h0] = 0.0
        attn.v_proj.weight[h0] = 0.0
        attn.v_proj.weight[0, FEAT] = 1.0
        attn.o_proj.weight[:, h0] = 0.0
        for layer in rm.model.layers:  # nothing writes to FEAT / COUNT / CONST ...
            for lin in (layer.self_attn.o_proj, layer.mlp.down_proj):
                lin.weight[[FEAT, COUNT, CONST], :] = 0.0
        attn.o_proj.weight[COUNT, 0] = 0.05  # ... except head 0 of layer 0, into COUNT
        rm.score.weight.zero_()

    # Calibrate: fit score = a * COUNT_readout + b * CONST_readout so that
    # score = REWARD_SCALE * (vowel fraction - baseline fraction of uniformly random responses).
    g = torch.Generator().manual_seed(SEED_REWARD)
    prompts = prompts_train[:64]
    tgt_ids = torch.nonzero(target).flatten()
    oth_ids = torch.nonzero(~target & (torch.arange(len(target)) > 2)).flatten()
    seqs, fracs = [], []
    for k, p in enumerate(prompts):
        for q in (0.0, 0.25, 0.5, 0.75, 1.0):
            is_t = torch.rand(response_length, generator=g) < q
            r = torch.where(
                is_t,
                tgt_ids[torch.randint(len(tgt_ids), (response_length,), generator=g)],
                oth_ids[torch.randint(len(oth_ids), (response_length,), generator=g)],
            )
            s = torch.tensor(p + r.tolist())
            seqs.append(s)
            fracs.append(target[s].float().mean().item())
    feats = []
    with torch.no_grad():
        for s in seqs:
            h = rm.model(input_ids=s[None]).last_hidden_state[0, -1]
            feats.append([h[COUNT].item(), h[CONST].item()])
    X = torch.tensor(feats, dtype=torch.float64)
    f = torch.tensor(fracs, dtype=torch.float64)
    # baseline: prompt tokens + uniformly random response tokens (the untrained policy's behaviour)
    p_rand = target[3:].float().mean().item()
    base = sum(
        (target[torch.tensor(p)].float().sum().item() + response_length * p_rand) / (len(p) + response_length)
        for p in prompts_train
    ) / len(prompts_train)
    y = REWARD_SCALE * (f - base)
    coef = torch.linalg.lstsq(X, y[:, None]).solution.flatten()
    with torch.no_grad():
        rm.score.weight[0, COUNT] = float(coef[0])
        rm.score.weight[0, CONST] = float(coef[1])
    pred = X @ coef
    corr = torch.corrcoef(torch.stack([pred, y]))[0, 1].item()
    info = dict(
        target_tokens=int(target.sum()),
        target_vocab_fraction=p_rand,
        baseline_fraction=base,
        calibration_corr=corr,
        calibration_rmse=float((pred - y).pow(2).mean().sqrt()),
    )
    return rm, info


def build_tiny_cache(cache: Path, force: bool = False) -> dict:
    """Build (or reuse) the tiny benchmark assets.  Returns the manifest."""
    manifest_path = cache / "manifest.json"
    if manifest_path.exists() and not force:
        m = json.loads(manifest_path.read_text())
        if m.get("format") == CACHE_FORMAT:
            return m
    import torch
    import transformers
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    t0 = time.time()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    paras = stdlib_corpus()
    tokenizer = train_tokenizer(paras)
    # held-out split: eval prompts come from paragraphs not used for training prompts
    encode = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]
    ids, texts = make_prompts(paras, encode, N_TRAIN_PROMPTS + N_EVAL_PROMPTS)
    train_ids, eval_ids = ids[:N_TRAIN_PROMPTS], ids[N_TRAIN_PROMPTS:]

    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache / "tokenizer")

    torch.manual_seed(SEED_POLICY)
    policy = LlamaForCausalLM(tiny_config(tokenizer))
    knob_info = add_vowel_knob(policy, tokenizer)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.generation_config.eos_token_id = tokenizer.eos_token_id
    policy.generation_config.bos_token_id = tokenizer.bos_token_id
    policy.save_pretrained(cache / "policy")
    tokenizer.save_pretrained(cache / "policy")

    torch.manual_seed(SEED_CRITIC)
    critic = LlamaForSequenceClassification(tiny_config(tokenizer, num_labels=1))
    critic.model.load_state_dict(policy.model.state_dict())
    critic.save_pretrained(cache / "critic")

    reward, rinfo = build_reward_model(tokenizer, train_ids, BASE_SETTINGS["response_length"])
    reward.save_pretrained(cache / "reward")
    tokenizer.save_pretrained(cache / "reward")

    (cache / "prompts.json").write_text(
        json.dumps(
            {
                "train": train_ids,
                "eval": eval_ids,
                "text": {"train": texts[:N_TRAIN_PROMPTS], "eval": texts[N_TRAIN_PROMPTS:]},
            }
        )
    )
    n_params = sum(p.numel() for p in policy.parameters())
    manifest = dict(
        format=CACHE_FORMAT,
        kind="tiny",
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        corpus_paragraphs=len(paras),
        vocab_size=VOCAB_SIZE,
        policy_params=n_params,
        arch=TINY_ARCH,
        policy_knob=knob_info,
        n_train_prompts=len(train_ids),
        n_eval_prompts=len(eval_ids),
        prompt_tokens=[PROMPT_MIN_TOKENS, PROMPT_MAX_TOKENS],
        reward=rinfo,
        reward_scale=REWARD_SCALE,
        build_seconds=round(time.time() - t0, 1),
    )
    manifest["content_sha256"] = cache_digest(cache)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def build_real_cache(model_dir: Path, cache: Path, force: bool = False) -> dict:
    """Assets for the opt-in --real config (SmolLM2-135M): same-backbone critic and reward model.

    The reward head reads a fixed direction: (mean lm_head row of positive words) - (mean of negative
    words), i.e. the score is the model's next-token logit preference for positive vs negative words
    after the response -- a learnable, deterministic "sentiment-ish" reward.  The critic's head is seeded."""
    manifest_path = cache / "manifest.json"
    if manifest_path.exists() and not force:
        m = json.loads(manifest_path.read_text())
        if m.get("format") == CACHE_FORMAT and m.get("model_dir") == str(model_dir):
            return m
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    t0 = time.time()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        # TRL needs pad != eos (it finds sequence ends by the first pad); add a dedicated pad token only if
        # the vocabulary has a spare special token, else use an existing rarely used one.
        cands = [t for t in tokenizer.all_special_tokens if t not in (tokenizer.eos_token, tokenizer.bos_token)]
        tokenizer.pad_token = cands[0] if cands else tokenizer.unk_token
    tokenizer.padding_side = "left"
    paras = stdlib_corpus()
    encode = lambda t: tokenizer(t, add_special_tokens=False)["input_ids"]
    ids, texts = make_prompts(paras, encode, N_TRAIN_PROMPTS + N_EVAL_PROMPTS)
    cache.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(cache / "tokenizer")

    policy = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy.generation_config.pad_token_id = tokenizer.pad_token_id
    policy.save_pretrained(cache / "policy")
    tokenizer.save_pretrained(cache / "policy")
    lm_head = policy.get_output_embeddings().weight.detach()

    def word_ids(words):
        out = []
        for w in words:
            t = tokenizer(" " + w, add_special_tokens=False)["input_ids"]
            if len(t) == 1:
                out.append(t[0])
        return out

    pos = word_ids(["good", "great", "happy", "love", "wonderful", "excellent", "nice", "best", "beautiful", "fun"])
    neg = word_ids(["bad", "terrible", "sad", "hate", "awful", "worst", "poor", "ugly", "boring", "wrong"])
    direction = lm_head[pos].mean(0) - lm_head[neg].mean(0)
    for name, seed in (("reward", SEED_REWARD), ("critic", SEED_CRITIC)):
        torch.manual_seed(seed)
        m = AutoModelForSequenceClassification.from_pretrained(model_dir, num_labels=1, dtype=torch.float32)
        m.config.pad_token_id = tokenizer.pad_token_id
        with torch.no_grad():
            if name == "reward":
                m.score.weight.copy_(direction[None])
            else:
                m.score.weight.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(seed))
        m.save_pretrained(cache / name)
        tokenizer.save_pretrained(cache / name)  # a reward model folder holds its tokenizer (lmppo reads it)
    del policy
    (cache / "prompts.json").write_text(
        json.dumps(
            {
                "train": ids[:N_TRAIN_PROMPTS],
                "eval": ids[N_TRAIN_PROMPTS:],
                "text": {"train": texts[:N_TRAIN_PROMPTS], "eval": texts[N_TRAIN_PROMPTS:]},
            }
        )
    )
    manifest = dict(
        format=CACHE_FORMAT,
        kind="real",
        model_dir=str(model_dir),
        python=sys.version.split()[0],
        torch=torch.__version__,
        transformers=transformers.__version__,
        pad_token=tokenizer.pad_token,
        positive_words=len(pos),
        negative_words=len(neg),
        build_seconds=round(time.time() - t0, 1),
    )
    manifest["content_sha256"] = cache_digest(cache)
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def cache_digest(cache: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(cache.rglob("*")):
        if p.is_file() and p.name != "manifest.json":
            h.update(str(p.relative_to(cache)).encode())
            h.update(p.read_bytes())
    return h.hexdigest()


def load_prompts(cache: Path) -> dict:
    return json.loads((Path(cache) / "prompts.json").read_text())


# ----------------------------------------------------------------------------------------------
# Evaluation (identical for both trainers: the driver runs it in its own subprocess on the saved policy)
# ----------------------------------------------------------------------------------------------


def truncate_after_eos(responses, eos_id: int, pad_id: int):
    """Keep everything up to and including the first eos; pad the rest (what TRL does with stop_token='eos')."""
    import torch

    is_eos = responses == eos_id
    first = torch.where(
        is_eos.any(1), is_eos.float().argmax(1), torch.full_like(is_eos[:, 0], responses.shape[1], dtype=torch.long)
    )
    idx = torch.arange(responses.shape[1])[None]
    return responses.masked_fill(idx > first[:, None], pad_id)


def reward_scores(reward_model, query_responses, pad_id: int, context_length: int):
    """Score read at the last real token of the response (TRL's ``get_reward`` convention: the sequence
    ends just before the first pad of the response part; left-padded queries)."""
    import torch

    mask = query_responses != pad_id
    pos = mask.cumsum(1) - mask.long()
    ids = query_responses.masked_fill(~mask, 0)
    backbone = getattr(reward_model, reward_model.base_model_prefix)
    h = backbone(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
    logits = reward_model.score(h).squeeze(-1)
    resp_pad = query_responses[:, context_length:] == pad_id
    first_pad = torch.where(
        resp_pad.any(1),
        resp_pad.float().argmax(1),
        torch.full((resp_pad.shape[0],), resp_pad.shape[1], dtype=torch.long),
    )
    last = first_pad - 1 + context_length
    return logits[torch.arange(logits.shape[0]), last]


def evaluate_policy(
    policy,
    tokenizer,
    reward_model,
    prompts: list[list[int]],
    seed: int = 0,
    response_length: int = 32,
    temperature: float = 1.0,
    samples_per_prompt: int = 2,
    batch_size: int = 32,
    stop_at_eos: bool = True,
) -> dict:
    """Mean reward-model score of sampled (temperature ``temperature``, no top-k/top-p) responses.

    Prompts are left-padded in batches of ``batch_size``; each prompt is sampled ``samples_per_prompt``
    times; responses are truncated after the first eos; the reward is read at the last real token."""
    import torch
    from transformers import GenerationConfig

    policy.eval()
    reward_model.eval()
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    gen_cfg = GenerationConfig(
        max_new_tokens=response_length,
        min_new_tokens=response_length if not stop_at_eos else 0,
        do_sample=True,
        temperature=temperature,
        top_k=0,
        top_p=1.0,
        pad_token_id=pad,
        eos_token_id=eos if stop_at_eos else None,
        bos_token_id=tokenizer.bos_token_id,
    )
    torch.manual_seed(seed)
    scores, lengths, eos_count = [], [], 0
    items = [p for p in prompts for _ in range(samples_per_prompt)]
    with torch.no_grad():
        for i in range(0, len(items), batch_size):
            chunk = items[i : i + batch_size]
            L = max(len(p) for p in chunk)
            q = torch.full((len(chunk), L), pad, dtype=torch.long)
            for j, p in enumerate(chunk):
                q[j, L - len(p) :] = torch.tensor(p)
            attn = q != pad
            out = policy.generate(input_ids=q.masked_fill(~attn, 0), attention_mask=attn, generation_config=gen_cfg)
            resp = out[:, L:]
            if resp.shape[1] < response_length:
                resp = torch.nn.functional.pad(resp, (0, response_length - resp.shape[1]), value=pad)
            if stop_at_eos:
                resp = truncate_after_eos(resp, eos, pad)
                eos_count += int((resp == eos).any(1).sum())
            s = reward_scores(reward_model, torch.cat([q, resp], 1), pad, L)
            scores.extend(s.tolist())
            lengths.extend((resp != pad).sum(1).tolist())
    n = len(scores)
    mean = sum(scores) / n
    std = (sum((x - mean) ** 2 for x in scores) / max(1, n - 1)) ** 0.5
    return dict(
        score_mean=mean,
        score_std=std,
        score_sem=std / n**0.5,
        n=n,
        mean_response_tokens=sum(lengths) / n,
        eos_fraction=eos_count / n,
        seed=seed,
    )


def evaluate_saved_policy(
    policy_dir,
    cache,
    seed=0,
    response_length=32,
    temperature=1.0,
    samples_per_prompt=2,
    threads=None,
    dtype="float32",
    n_prompts=None,
) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    if threads:
        torch.set_num_threads(threads)
    cache = Path(cache)
    dt = getattr(torch, dtype)
    tok = AutoTokenizer.from_pretrained(cache / "tokenizer")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=dt)
    rm = AutoModelForSequenceClassification.from_pretrained(cache / "reward", dtype=dt)
    prompts = load_prompts(cache)["eval"][:n_prompts]
    t0 = time.time()
    res = evaluate_policy(
        policy,
        tok,
        rm,
        prompts,
        seed=seed,
        response_length=response_length,
        temperature=temperature,
        samples_per_prompt=samples_per_prompt,
    )
    res["eval_seconds"] = round(time.time() - t0, 2)
    res["policy_dir"] = str(policy_dir)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build the tiny cache")
    b.add_argument("--cache", type=Path, default=DEFAULT_CACHE_ROOT / "tiny")
    b.add_argument("--force", action="store_true")
    r = sub.add_parser("build-real", help="build the SmolLM2 cache from an HF folder")
    r.add_argument("--model-dir", type=Path, required=True)
    r.add_argument("--cache", type=Path, default=DEFAULT_CACHE_ROOT / "smollm2")
    r.add_argument("--force", action="store_true")
    e = sub.add_parser("eval", help="score a saved policy on the held-out prompts")
    e.add_argument("--policy", type=Path, required=True)
    e.add_argument("--cache", type=Path, default=DEFAULT_CACHE_ROOT / "tiny")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--response-length", type=int, default=BASE_SETTINGS["response_length"])
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--samples-per-prompt", type=int, default=BASE_SETTINGS["eval_samples_per_prompt"])
    e.add_argument("--threads", type=int, default=None)
    e.add_argument("--n-prompts", type=int, default=None, help="score only the first N held-out prompts")
    e.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.cmd == "build":
        res = build_tiny_cache(a.cache, a.force)
    elif a.cmd == "build-real":
        res = build_real_cache(a.model_dir.resolve(), a.cache, a.force)
    else:
        res = evaluate_saved_policy(
            a.policy,
            a.cache,
            a.seed,
            a.response_length,
            a.temperature,
            a.samples_per_prompt,
            a.threads,
            n_prompts=a.n_prompts,
        )
    text = json.dumps(res, indent=1)
    if getattr(a, "out", None):
        a.out.write_text(text)
    print(text)


def percentile(xs, q):
    """The q-th percentile of xs, linear between the two nearest values."""
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def time_sampling(trainer, spent: dict) -> None:
    """Count the CPU time of each call of an lmppo trainer's sampling engine in `spent["sampling"]` (trainers from
    before sampling engines existed are left alone)."""
    if not hasattr(trainer, "sampling_engine"):
        return
    engine = trainer.sampling_engine()
    sample = engine.sample

    def timed(policy, prompts):
        start = time.process_time()
        try:
            return sample(policy, prompts)
        finally:
            spent["sampling"] = time.process_time() - start

    engine.sample = timed


def timed_iteration(trainer, spent: dict) -> None:
    """One iteration of `PPOTrainer.train`'s loop (without its logging and checkpoint); the CPU seconds of the
    rollout, the PPO update and the whole iteration go into `spent`."""
    from lmppo.training.metrics import MetricsAccumulator
    from lmppo.training.update import UpdateBatch

    start = time.process_time()
    rollout = trainer.collect_rollout()
    spent["rollout"] = time.process_time() - start
    scored = trainer.score(rollout)
    rewards = trainer.token_rewards(rollout, scored)
    advantages, returns = trainer.advantages(rollout, rewards)
    mark = time.process_time()
    trainer.updater.update(UpdateBatch(rollout, advantages, returns, rewards.train_mask), MetricsAccumulator())
    spent["update"] = time.process_time() - mark
    spent["iteration"] = time.process_time() - start


if __name__ == "__main__":
    main()
