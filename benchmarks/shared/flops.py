"""FLOPs that one PPO iteration needs, and how close a measured iteration time comes to the machine's limit.

"Needed" means the passes the algorithm cannot do without, over non-padding tokens, for a Llama-shaped decoder
(both benchmark models are Llama): sampling (which also yields the old log-probabilities), one reference pass,
one value pass (not needed with one minibatch: the first epoch's forward, before any step, gives the old values),
one reward pass, and per PPO epoch a forward and backward pass (backward = 2 x forward) of the policy and, when
separate, of the critic. A trainer that pads, computes logits it throws away, or runs a pass
twice does more work than this; its utilisation figure counts only the needed part, so waste shows as a lower
figure. The limit is the matmul throughput measured on the same machine, in the same process, at the same thread
count (`matmul_gflops`); a figure near 100% means only fewer FLOPs or a faster number format can make it faster.

Standard library only at import time (the benchmark driver imports it); `matmul_gflops` imports torch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path


def llama_shape(config_json: Path) -> dict:
    """hidden, layers, ffn, kv_dim, vocab and non-embedding parameter count of a Llama config.json."""
    c = json.loads(Path(config_json).read_text())
    d, layers, ffn, vocab = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"], c["vocab_size"]
    heads = c["num_attention_heads"]
    kv_dim = d // heads * c.get("num_key_value_heads", heads)
    per_layer = d * d * 2 + 2 * d * kv_dim + 3 * d * ffn  # q, o; k, v; gate, up, down
    return dict(hidden=d, layers=layers, ffn=ffn, kv_dim=kv_dim, vocab=vocab, trunk_params=layers * per_layer)


def forward_flops(shape: dict, seq_len: float, logit_positions: float) -> float:
    """One forward pass over one sequence: 2 FLOPs per weight per token in the trunk, causal attention
    (q k^T and attention x v over the lower triangle: 2 * seq_len^2 * hidden per layer), and the LM head at
    `logit_positions` positions."""
    trunk = 2 * shape["trunk_params"] * seq_len
    attention = 2 * shape["layers"] * seq_len**2 * shape["hidden"]
    head = 2 * shape["hidden"] * shape["vocab"] * logit_positions
    return trunk + attention + head


def iteration_flops(
    shape: dict,
    batch: int,
    prompt_len: float,
    response_len: float,
    epochs: int,
    separate_critic: bool,
    minibatches: int = 1,
) -> dict:
    """FLOPs per PPO iteration, by phase (see the module docstring for what counts)."""
    S, T = prompt_len + response_len, response_len
    policy = forward_flops(shape, S, T)  # logits where response tokens are predicted
    trunk_only = forward_flops(shape, S, 0)  # value / reward: a scalar head, negligible
    parts = {
        "sampling": batch * policy,  # KV cache: every token goes through the network once
        "reference": batch * policy,
        "value": batch * trunk_only if minibatches > 1 else 0.0,  # one minibatch: the first epoch's forward
        "reward": batch * trunk_only,
        "update": epochs * batch * 3 * (policy + (trunk_only if separate_critic else 0.0)),
    }
    parts["total"] = sum(parts.values())
    return parts


def matmul_gflops(
    dtype_name: str, threads: int, m: int = 512, k: int = 512, n: int = 1536, seconds: float = 1.0
) -> float:
    """Measured throughput of an (m, k) x (k, n) matmul in `dtype_name` at `threads` threads: the limit the
    iteration's matmuls run against (they are of this size in the tiny benchmark configuration)."""
    import torch

    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    for _ in range(3):
        a @ b
    count, start = 0, time.process_time()  # CPU time: robust to other load, like the benchmark's eps_cpu
    while time.process_time() - start < seconds * threads:
        a @ b
        count += 1
    return 2 * m * k * n * count / ((time.process_time() - start) / threads) / 1e9
