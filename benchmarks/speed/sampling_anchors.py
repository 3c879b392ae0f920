"""Sampling anchors and this machine's roofline: lmppo's native sampler, transformers' `generate` and llama.cpp's
batched decoding in tokens/s on the same model, prompts and batch, against what the machine's measured matmul and
memory rates allow.

    python benchmarks/speed/sampling_anchors.py [--model smollm2] [--batch 32] [--new 24] [--rounds 8] [--threads 1]
        [--bf16] [--lora] [--llama gguf,f32,bf16] [--llama-python .venv-llama/bin/python]

Every round runs each sampler once, in turn (alternating rounds: a busy machine slows some calls, never speeds one
up); the figures are per-call process CPU time: tokens/s at the minimum and at the 10th percentile, the spread
p50/p10 (a WARNING above 1.15), and each round's speed against lmppo's sampler (median [min, max]).

llama.cpp (`--llama`, only for the packaged `smollm2`) runs in a worker process in the virtual environment that has
`llama-cpp-python` (`make bench-llama-venv`; never a dependency of lmppo), on the packaged GGUF file (`gguf`: its
own weight types, Q4_1 with a Q8_0 embedding) or on that file converted by llama.cpp's quantizer to `f32`, `bf16`
or `f16` (the weights lmppo computes with); see benchmarks/speed/llama_anchor.py for how it decodes. Without
`llama_cpp` the anchor is skipped with one line.

Roofline of one decoding step (batch B, context length L, Llama shape from the model's config):
  FLOPs = B * (2 * trunk weights + 2 * hidden * vocab + 4 * layers * L * hidden)   (projections, LM head at the
          last position only, attention scores and weighted values)
  bytes = every weight once (trunk + LM head, in the compute dtype; for llama.cpp the bytes of its GGUF tensors)
          + the KV cache read (2 * layers * L * kv_dim per row, in the compute dtype; llama.cpp's cache is f16)
The floor of a step is max(FLOPs / matmul rate, bytes / memory rate), with the matmul rate measured at the
step's own shape ((B, hidden) x (hidden, ffn)) and the memory rate by summing a 256 MB tensor, both in this
process at `--threads`. A sampler's "% of roofline" is that floor over its measured time per step (CPU time,
from the minima: (whole call - prefill + 1 token) / (new - 1)). llama.cpp's quantized kernels (Q4_1 x Q8_0) have
no torch counterpart to measure their rate, so for `gguf` only the bytes floor and the achieved GFLOP/s are given;
its f32 / bf16 conversions are held against torch's fp32 / bf16 rates. Sampling a whole batch also pays a prefill
(not in the floor; its share is printed).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from lmppo.models.loading import resolve_model_path
from lmppo.sampling.hf import sample_responses
from lmppo.sampling.native import SamplingWeights, sample_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)
import flops  # noqa: E402
import llama_anchor  # noqa: E402  (stdlib only at import time)
from common import DEFAULT_CACHE_ROOT, percentile  # noqa: E402
from compare_trl import NOISY_ITERATIONS  # noqa: E402
from sampler_speed import add_policy_args, bench_policy  # noqa: E402

HERE = Path(__file__).resolve().parent

LLAMA_VENV_PYTHON = bench_path.ROOT / ".venv-llama" / "bin" / "python"
KV_BYTES = {1: 2, 30: 2, 0: 4}  # llama.cpp's cache type_k (GGML_TYPE_F16 / BF16 / F32) -> bytes per element


def memory_gbps(threads: int, megabytes: int = 256, seconds: float = 1.0) -> float:
    """Read bandwidth: sums of a `megabytes` float32 tensor, CPU time."""
    torch.set_num_threads(threads)
    x = torch.ones(megabytes * 2**20 // 4)
    x.sum()
    count, start = 0, time.process_time()
    while time.process_time() - start < seconds * threads:
        x.sum()
        count += 1
    return x.numel() * 4 * count / ((time.process_time() - start) / threads) / 1e9


def timed(fn):
    """fn as a sampler: one call, returning (process CPU seconds, wall seconds)."""

    def call():
        c0, w0 = time.process_time(), time.perf_counter()
        fn()
        return time.process_time() - c0, time.perf_counter() - w0

    return call


class LlamaWorker:
    """A llama_anchor.py process (in the llama.cpp venv) holding one model; `run(new)` -> (CPU s, wall s)."""

    def __init__(self, python: str, setup: dict):
        self.proc = subprocess.Popen(
            [python, str(HERE / "llama_anchor.py")], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )
        self.batch = len(setup["prompts"])
        self.answer = self._ask(setup)

    def _ask(self, obj: dict) -> dict:
        self.proc.stdin.write(json.dumps(obj) + "\n")
        while True:
            line = self.proc.stdout.readline()
            if not line:
                return {"ok": False, "error": f"the worker exited (code {self.proc.wait()})"}
            if line.startswith("{"):  # anything else is a native library writing to stdout
                return json.loads(line)

    def run(self, new: int):
        out = self._ask({"new": new})
        if "tokens" not in out:
            raise RuntimeError(f"llama.cpp worker: {out.get('error')}")
        assert out["tokens"] == [new] * self.batch, out["tokens"]
        return out["cpu"], out["wall"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("\n")
            self.proc.stdin.close()
            self.proc.wait()


def gguf_weights(path: str) -> tuple[int, str]:
    """(bytes of weights one decoding step reads, "TYPE MB (n tensors), ...") of a GGUF file."""
    from gguf import GGUFReader

    tensors = GGUFReader(path).tensors
    by_type: dict[str, list[int]] = {}
    for t in tensors:
        entry = by_type.setdefault(t.tensor_type.name, [0, 0])
        entry[0] += int(t.n_bytes)
        entry[1] += 1
    embd = next(t.tensor_type.name for t in tensors if t.name == "token_embd.weight")
    tied = not any(t.name == "output.weight" for t in tensors)
    summary = ", ".join(
        f"{k} {v[0] / 1e6:.1f} MB ({v[1]} tensors)" for k, v in sorted(by_type.items(), key=lambda kv: -kv[1][0])
    )
    summary += f"; token embedding {embd}{' (tied: the LM head)' if tied else ''}"
    return llama_anchor.step_weight_bytes([(t.name, int(t.n_bytes)) for t in tensors]), summary


def start_llama(args, ids, mask, seeds) -> dict:
    """The llama.cpp workers of `--llama`, by label; one line per variant that cannot run, saying why."""
    variants = [v for v in args.llama.split(",") if v and v != "none"]
    if not variants:
        return {}
    if args.model != "smollm2":
        print("llama.cpp anchor skipped: it runs on the packaged GGUF file of --model smollm2 only")
        return {}
    python = args.llama_python or (str(LLAMA_VENV_PYTHON) if LLAMA_VENV_PYTHON.exists() else sys.executable)
    from lmppo.models.assets import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    prompts = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    workers = {}
    for v in variants:
        if v != "gguf" and v not in llama_anchor.FTYPES:
            raise SystemExit(f"--llama: unknown variant {v!r}; use gguf or one of {sorted(llama_anchor.FTYPES)}")
        converted = DEFAULT_CACHE_ROOT / "llama" / f"{gguf.stem}.{v}.gguf"
        w = LlamaWorker(
            python,
            dict(
                gguf=str(gguf),
                convert=None if v == "gguf" else v,
                converted=str(converted),
                threads=args.threads,
                prompts=prompts,
                seeds=[int(s) for s in seeds],
                max_new=args.new,
            ),
        )
        if not w.answer.get("ok"):
            print(f"llama.cpp anchor skipped ({v}): {w.answer.get('error')}")
            w.close()
            if "not importable" in str(w.answer.get("error")):
                break  # the same for every variant: one line is enough
            continue
        workers[v] = w
    return workers


def main() -> None:
    ap = argparse.ArgumentParser()
    add_policy_args(ap)
    ap.add_argument(
        "--llama",
        default="gguf",
        help="llama.cpp variants, comma-separated: gguf (the packaged file "
        "as it is), f32, bf16, f16 (converted by llama.cpp's quantizer); 'none' to skip",
    )
    ap.add_argument(
        "--llama-python",
        default=None,
        help="the interpreter with llama_cpp (default: .venv-llama's if it exists, else this one)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model, ids, mask, no_stop, seeds, gen_config = bench_policy(args)
    path = resolve_model_path(args.model)
    weights = SamplingWeights()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def native(new=args.new):
        with autocast():
            return sample_native(weights.model_for(model), ids, mask, 1.0, new, no_stop, tok.pad_token_id, seeds)

    def hf():
        with autocast():
            return sample_responses(model, ids, mask, gen_config, no_stop, args.new)

    # name -> one call returning (CPU s, wall s); "X prefill+1" times the prefill and the first token of X
    samplers = {"lmppo native": timed(native), "HF generate": timed(hf), "lmppo prefill+1": timed(lambda: native(1))}
    llama = start_llama(args, ids, mask, seeds)
    for v, w in llama.items():
        samplers[f"llama.cpp {v}"] = lambda w=w: w.run(args.new)
        samplers[f"llama.cpp {v} prefill+1"] = lambda w=w: w.run(1)
    for fn in samplers.values():
        fn()
    cpu = {n: [] for n in samplers}
    load0 = os.getloadavg()
    for _ in range(args.rounds):
        for name, fn in samplers.items():
            cpu[name].append(fn()[0])
    load1 = os.getloadavg()
    for w in llama.values():
        w.close()

    shape = flops.llama_shape(Path(path) / "config.json")
    config = json.loads((Path(path) / "config.json").read_text())
    B, P = args.batch, ids.shape[1]
    L = P + args.new / 2  # mean context over the decoding steps
    step_flops = B * (
        2 * shape["trunk_params"] + 2 * shape["hidden"] * shape["vocab"] + 4 * shape["layers"] * L * shape["hidden"]
    )
    kv_elements = B * 2 * shape["layers"] * L * shape["kv_dim"]
    dtype_name = "bfloat16" if args.bf16 else "float32"
    rates = {}
    for v in [dtype_name] + [{"f32": "float32", "bf16": "bfloat16"}.get(v) for v in llama]:
        if v and v not in rates:
            rates[v] = flops.matmul_gflops(v, args.threads, m=B, k=shape["hidden"], n=shape["ffn"], seconds=0.5)
    bandwidth = memory_gbps(args.threads)

    def floor_line(label, step_bytes, rate_dtype):
        """(floor seconds or None, the roofline line) of one weight format."""
        mem = step_bytes / (bandwidth * 1e9)
        text = f"{step_bytes / 1e6:.0f} MB at {bandwidth:.1f} GB/s = {1e3 * mem:.1f} ms"
        if rate_dtype is None:
            return None, f"{label}: {text} (its quantized matmul rate is not measured here: bytes floor only)"
        comp = step_flops / (rates[rate_dtype] * 1e9)
        floor = max(comp, mem)
        return floor, (
            f"{label}: {step_flops / 1e9:.2f} GFLOP at {rates[rate_dtype]:.0f} GFLOP/s ({B}x"
            f"{shape['hidden']}x{shape['ffn']} {rate_dtype} matmul) = {1e3 * comp:.1f} ms; {text} -> floor "
            f"{1e3 * floor:.1f} ms ({B / floor:.0f} tokens/s)"
        )

    dtype_bytes = 2 if args.bf16 else 4
    lmppo_bytes = (shape["trunk_params"] + shape["hidden"] * shape["vocab"]) * dtype_bytes + kv_elements * dtype_bytes
    floors, lines = {}, []
    f, text = floor_line(f"lmppo / HF ({dtype_name})", lmppo_bytes, dtype_name)
    floors["lmppo native"] = floors["HF generate"] = f
    lines.append(text)
    gguf_files = {v: w.answer["info"]["path"] for v, w in llama.items()}
    if args.model == "smollm2" and "gguf" not in gguf_files:  # what the packaged file allows, measured or not
        from lmppo.models.assets import smollm2_gguf_path

        gguf_files["gguf (not run)"] = str(smollm2_gguf_path())
    for v, file in gguf_files.items():
        weight_bytes, summary = gguf_weights(file)
        kv = kv_elements * KV_BYTES.get(llama[v].answer["info"]["type_k"] if v in llama else 1, 2)  # default f16
        f, text = floor_line(
            f"llama.cpp {v} ({summary})", weight_bytes + kv, {"f32": "float32", "bf16": "bfloat16"}.get(v)
        )
        floors[f"llama.cpp {v}"] = f
        lines.append(text)

    print(
        f"model {args.model} ({config.get('model_type')}, {shape['trunk_params'] / 1e6:.0f}M trunk weights, vocab "
        f"{shape['vocab']}), batch {B} x {args.new} new tokens after {P}-token prompts, {args.threads} thread(s), "
        f"{dtype_name}{', LoRA r 16' if args.lora else ''}, {args.rounds} alternating rounds; torch "
        f"{torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, AVX-512 BF16 "
        f"{torch.cpu._is_avx512_bf16_supported()}; load average {load0[0]:.2f} -> {load1[0]:.2f}"
    )
    for v, w in llama.items():
        info = w.answer["info"]
        print(
            f"llama.cpp {v}: {info['desc']}, llama-cpp-python {info['llama_cpp_python']}, n_ctx {info['n_ctx']}, "
            f"n_batch {info['n_batch']}, flash_attn_type {info['flash_attn_type']}, KV type {info['type_k']}"
        )
    if llama:
        print(f"llama.cpp system info: {next(iter(llama.values())).answer['info']['system']}")
    print("roofline per decoding step:")
    for text in lines:
        print(f"  {text}")
    print(
        f"{'sampler':15} {'tok/s min':>9} {'tok/s p10':>9} {'p50/p10':>7} {'vs lmppo per round':>22} "
        f"{'ms/step':>7} {'GFLOP/s':>7} {'roofline':>8} {'prefill':>7}"
    )
    warnings = []
    for name in [n for n in samplers if "prefill" not in n]:
        xs = cpu[name]
        pre_name = "lmppo prefill+1" if name in ("lmppo native", "HF generate") else f"{name} prefill+1"
        pre = min(cpu[pre_name])
        per_step = (min(xs) - pre) / (args.new - 1)
        ratios = [a / b for a, b in zip(cpu["lmppo native"], xs)]
        floor = floors.get(name)
        spread = percentile(xs, 50) / percentile(xs, 10)
        print(
            f"{name:15} {B * args.new / min(xs):9.1f} {B * args.new / percentile(xs, 10):9.1f} {spread:7.2f} "
            f"{f'x{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]':>22} "
            f"{1e3 * per_step:7.1f} {step_flops / per_step / 1e9:7.1f} "
            f"{f'{100 * floor / per_step:.0f}%' if floor else '-':>8} {f'{100 * pre / min(xs):.0f}%':>7}"
        )
        if spread > NOISY_ITERATIONS:
            warnings.append(
                f"WARNING {name}: call times spread {spread:.2f}x (p50/p10 > {NOISY_ITERATIONS}): the "
                "machine was busy; its figure cannot be trusted to 10%"
            )
    print(
        "tok/s = batch x new tokens / CPU seconds of one call; vs lmppo = that round's lmppo native time / this "
        "sampler's (> 1: faster than lmppo); ms/step and GFLOP/s = one decoding step from the minima; roofline = "
        "the floor / ms/step; prefill = the prefill + 1 token call's share of the whole call"
    )
    print("\n".join(warnings) or "no noise warning: every p50/p10 is within its limit")


if __name__ == "__main__":
    main()
