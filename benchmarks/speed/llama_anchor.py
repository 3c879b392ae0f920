"""llama.cpp's batched decoding as a sampling anchor for sampling_anchors.py: a worker that runs in the virtual
environment holding `llama-cpp-python` (`make bench-llama-venv` makes one, `.venv-llama`), driven over a pipe, so
llama.cpp is never a dependency of lmppo's own environment.

Decoding is llama.cpp's own batched example (examples/batched) with one prompt per sequence, on the low-level API:
one `llama_batch` holding every prompt's tokens, each prompt under its own sequence id with positions from 0 and
logits only at its last token (`prefill_layout`); then per step one `llama_decode` of one token per sequence
(`step_layout`), each sequence sampled by its own seeded `dist` sampler (pure sampling at temperature 1, as the
other anchors sample). The KV cache is cleared between calls. `llama_decode` splits nothing: the batch and the
micro-batch hold the whole prefill.

Protocol, one JSON object per line. The driver sends the set-up
    {"gguf": path, "convert": null | "f32" | "bf16" | "f16", "converted": path, "threads": n,
     "prompts": [[token ids] ...], "seeds": [int ...], "max_new": n}
the worker answers {"ok": true, "info": {...}} or {"ok": false, "error": "..."} (llama_cpp missing, a failed load);
then for each request {"new": n} it samples n tokens for every prompt and answers
{"cpu": process CPU seconds, "wall": seconds, "tokens": tokens sampled per sequence}. An empty line ends it.
"convert" first writes `converted` (once) with llama.cpp's own quantizer: the packaged Q4_1 weights dequantised
and stored in that type (`allow_requantize`), the weights lmppo computes with after its own GGUF conversion.

Standard library only at import time: the driver and the tests import the layout functions without llama_cpp.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

FTYPES = {"f32": 0, "f16": 1, "bf16": 32}  # LLAMA_FTYPE_ALL_F32, LLAMA_FTYPE_MOSTLY_F16, LLAMA_FTYPE_MOSTLY_BF16


def prefill_layout(prompts: list[list[int]]) -> tuple[list[tuple[int, int, int, bool]], list[int]]:
    """One batch for every prompt: rows (token, position, sequence id, wants logits), prompt i as sequence i at
    positions 0..len-1 with logits at its last token only; and, per sequence, the row of its logits."""
    rows, logit_rows = [], []
    for seq, ids in enumerate(prompts):
        rows += [(tok, pos, seq, pos == len(ids) - 1) for pos, tok in enumerate(ids)]
        logit_rows.append(len(rows) - 1)
    return rows, logit_rows


def step_layout(prompts: list[list[int]], tokens: list[int], step: int) -> list[tuple[int, int, int, bool]]:
    """The batch of decoding step `step` (1 = the first token after the prefill): sequence i's last sampled token
    `tokens[i]` at position len(prompt i) + step - 1, with logits; row i is sequence i."""
    return [(tok, len(ids) + step - 1, seq, True) for seq, (ids, tok) in enumerate(zip(prompts, tokens))]


def step_weight_bytes(tensors: list[tuple[str, int]]) -> int:
    """Bytes of weights one decoding step reads, from a GGUF file's (name, bytes) list: every tensor once, except
    the token embedding when a separate `output.weight` is the LM head (then a step reads only B of its rows). With
    tied embeddings (no `output.weight`) the token embedding is the LM head and is read whole."""
    untied = any(name == "output.weight" for name, _ in tensors)
    return sum(n for name, n in tensors if not (untied and name == "token_embd.weight"))


class Decoder:
    """A llama.cpp model and context sized for len(prompts) sequences of up to `max_new` new tokens."""

    def __init__(self, model_path: str, prompts: list[list[int]], seeds: list[int], threads: int, max_new: int):
        import llama_cpp as ll

        self.ll, self.prompts = ll, prompts
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(model_path.encode(), ll.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        n_seq = len(prompts)
        per_seq = max(len(p) for p in prompts) + max_new
        self.n_prefill = sum(len(p) for p in prompts)
        cp = ll.llama_context_default_params()
        cp.n_ctx = n_seq * per_seq
        cp.n_batch = cp.n_ubatch = max(self.n_prefill, n_seq)
        cp.n_seq_max = n_seq
        cp.kv_unified = False  # one KV stream per sequence: a token attends to its own sequence's cells only
        cp.n_threads = cp.n_threads_batch = threads
        self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.batch = ll.llama_batch_init(cp.n_batch, 0, 1)
        chain = ll.llama_sampler_chain_default_params()
        self.samplers = []
        for seed in seeds:
            s = ll.llama_sampler_chain_init(chain)
            ll.llama_sampler_chain_add(s, ll.llama_sampler_init_dist(seed % 2**32))
            self.samplers.append(s)
        desc = ctypes_buffer(ll, lambda buf, n: ll.llama_model_desc(self.model, buf, n))
        self.info = dict(
            desc=desc,
            model_bytes=int(ll.llama_model_size(self.model)),
            n_ctx=int(ll.llama_n_ctx(self.ctx)),
            n_batch=int(cp.n_batch),
            flash_attn_type=int(cp.flash_attn_type),
            type_k=int(cp.type_k),
            system=ll.llama_print_system_info().decode().strip(),
            llama_cpp_python=getattr(ll, "__version__", "?"),
        )

    def _decode(self, rows) -> None:
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0], b.logits[i] = tok, pos, 1, seq, logits
        b.n_tokens = len(rows)
        rc = self.ll.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def sample(self, new: int) -> list[list[int]]:
        """`new` tokens for every prompt (no stop token), the KV cache cleared first."""
        ll = self.ll
        ll.llama_memory_clear(ll.llama_get_memory(self.ctx), True)
        rows, logit_rows = prefill_layout(self.prompts)
        self._decode(rows)
        out = [[ll.llama_sampler_sample(s, self.ctx, r)] for s, r in zip(self.samplers, logit_rows)]
        for step in range(1, new):
            self._decode(step_layout(self.prompts, [t[-1] for t in out], step))
            for i, s in enumerate(self.samplers):
                out[i].append(ll.llama_sampler_sample(s, self.ctx, i))
        return out


def ctypes_buffer(ll, fill, size: int = 256) -> str:
    import ctypes

    buf = ctypes.create_string_buffer(size)
    fill(buf, size)
    return buf.value.decode(errors="replace")


def convert(ll, src: str, dst: str, ftype: str, threads: int) -> None:
    """`src` requantised to `ftype` into `dst` by llama.cpp's quantizer (dequantise, then store in that type)."""
    params = ll.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = FTYPES[ftype], True, threads
    tmp = Path(dst).with_suffix(".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    rc = ll.llama_model_quantize(src.encode(), str(tmp).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize to {ftype} returned {rc}")
    tmp.rename(dst)


def reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> None:
    setup = json.loads(sys.stdin.readline())
    try:
        import llama_cpp as ll
    except ImportError as e:
        reply({"ok": False, "error": f"llama_cpp is not importable in {sys.executable} ({e})"})
        return
    quiet = ll.llama_log_callback(lambda level, text, data: None)  # a name keeps it alive: llama.cpp calls it
    ll.llama_log_set(quiet, None)
    try:
        path = setup["gguf"]
        if setup.get("convert"):
            path = setup["converted"]
            if not Path(path).exists():
                convert(ll, setup["gguf"], path, setup["convert"], setup["threads"])
        dec = Decoder(path, setup["prompts"], setup["seeds"], setup["threads"], setup["max_new"])
        dec.sample(2)  # warm-up: first-call allocations
    except Exception as e:  # noqa: BLE001  (reported to the driver, which skips this anchor)
        reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
        return
    reply({"ok": True, "info": dict(dec.info, path=path)})
    for line in sys.stdin:
        if not line.strip():
            break
        new = json.loads(line)["new"]
        c0, w0 = time.process_time(), time.perf_counter()
        out = dec.sample(new)
        reply({"cpu": time.process_time() - c0, "wall": time.perf_counter() - w0, "tokens": [len(t) for t in out]})


if __name__ == "__main__":
    main()
