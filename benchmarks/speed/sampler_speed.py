"""Sampler speed, alternating rounds: lmppo's native loop on the policy itself ("unfolded": with LoRA, the base
weights plus the adapters at every step), on its sampling copy ("folded": `lmppo.sampling.native.SamplingWeights`, LoRA
folded into plain linear layers and weights pre-cast under bf16 autocast, the fold's cost counted in every call),
and transformers' `generate`; same model, prompts and lengths.

    python benchmarks/speed/sampler_speed.py [--model smollm2] [--batch 32] [--new 24] [--rounds 8] [--threads 1]
        [--lora] [--bf16] [--samplers unfolded,folded,hf] [--profile]

Defaults follow the built-in default job (SmolLM2-135M, 32 prompts, 24 new tokens; add --lora --bf16 for its
LoRA r 16 / all-linear and bf16 autocast). Every round runs each sampler once, in turn; the figures are per-call
process CPU time (robust to other load when single-threaded) and wall time: min, p10, median, and the per-round
ratio against the first sampler with its spread. Stop tokens are off, so every row has exactly `--new` tokens.
`--profile`: cProfile of one folded call, the top functions by own time.
"""

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

from lmppo.config import ModelConfig
from lmppo.models.loading import load_tokenizer, prepare_policy, resolve_model_path
from lmppo.sampling.hf import left_pad, pure_sampling_config, sample_responses
from lmppo.sampling.native import SamplingWeights, response_seed, sample_native

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402, F401  (every benchmark folder on the path)
from common import percentile  # noqa: E402


def bench_policy(args):
    """The benchmark's policy (LoRA r 16 all-linear with random nonzero B if `args.lora`: trained adapters are not
    zero), its tokenizer, and a batch of `args.batch` prompts with one random stream per response: shared by
    sampler_speed.py and sampling_anchors.py. Returns (tokenizer, model, ids, mask, no_stop, seeds, gen_config)."""
    from transformers import AutoModelForCausalLM

    mc = ModelConfig()
    if args.lora:
        mc.lora.enabled, mc.lora.r, mc.lora.alpha, mc.lora.target_modules = True, 16, 32, ["all-linear"]
    path = resolve_model_path(args.model)
    tok = load_tokenizer(path, ModelConfig())
    model = prepare_policy(AutoModelForCausalLM.from_pretrained(path), mc)
    if args.lora:  # PEFT starts B at zero; trained adapters are not
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0.0, 0.01, generator=torch.Generator().manual_seed(0))
    texts = [f"The movie number {i} was" + " really" * (i % 5) for i in range(args.batch)]
    ids, mask = left_pad([tok(t)["input_ids"] for t in texts], tok.pad_token_id)
    no_stop = torch.tensor([], dtype=torch.long)
    seeds = [response_seed(0, 0, i) for i in range(args.batch)]
    gen_config = pure_sampling_config(model, 1.0, args.new, [], tok.pad_token_id)
    return tok, model, ids, mask, no_stop, seeds, gen_config


def add_policy_args(ap: argparse.ArgumentParser) -> None:
    """The options of `bench_policy` and the timing loop, shared by the sampling benchmarks."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lora", action="store_true", help="LoRA r 16, alpha 32, all-linear (the default job's)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast for every sampler")


def main() -> None:
    ap = argparse.ArgumentParser()
    add_policy_args(ap)
    ap.add_argument("--samplers", default="unfolded,folded,hf")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok, model, ids, mask, no_stop, seeds, gen_config = bench_policy(args)
    weights = SamplingWeights()

    def autocast():
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def unfolded():
        with autocast():
            return sample_native(model, ids, mask, 1.0, args.new, no_stop, tok.pad_token_id, seeds)

    def folded():
        with autocast():
            return sample_native(weights.model_for(model), ids, mask, 1.0, args.new, no_stop, tok.pad_token_id, seeds)

    def hf():
        with autocast():
            return sample_responses(model, ids, mask, gen_config, no_stop, args.new)

    samplers = {"unfolded": unfolded, "folded": folded, "hf": hf}
    names = [s for s in args.samplers.split(",") if s]
    for name in names:  # warm-up (the folded copy is built here)
        samplers[name]()
    cpu = {n: [] for n in names}
    wall = {n: [] for n in names}
    load = [os.getloadavg()]
    for _ in range(args.rounds):
        for name in names:
            c0, w0 = time.process_time(), time.perf_counter()
            out = samplers[name]()
            cpu[name].append(time.process_time() - c0)
            wall[name].append(time.perf_counter() - w0)
            assert out[0].shape == (args.batch, args.new), out[0].shape
    load.append(os.getloadavg())
    tokens = args.batch * args.new
    print(
        f"model {args.model}, batch {args.batch} x {args.new} new tokens, {args.threads} thread(s), LoRA "
        f"{'r 16 all-linear' if args.lora else 'off'}, bf16 autocast {args.bf16}, {args.rounds} alternating rounds; "
        f"torch {torch.__version__}, capability {torch.backends.cpu.get_cpu_capability()}, AVX-512 BF16 "
        f"{torch.cpu._is_avx512_bf16_supported()}; load average {load[0][0]:.2f} at the start, {load[1][0]:.2f} at "
        f"the end"
    )
    print(
        f"{'sampler':9} {'cpu min':>8} {'cpu p10':>8} {'cpu p50':>8} {'wall p10':>8} {'tok/s cpu p10':>13}  "
        f"speed vs {names[0]} per round (cpu): median [min, max]"
    )
    for name in names:
        ratios = [a / b for a, b in zip(cpu[names[0]], cpu[name])]
        print(
            f"{name:9} {min(cpu[name]):8.3f} {percentile(cpu[name], 10):8.3f} {percentile(cpu[name], 50):8.3f} "
            f"{percentile(wall[name], 10):8.3f} {tokens / percentile(cpu[name], 10):13.1f}  "
            f"x{statistics.median(ratios):.2f} [{min(ratios):.2f}, {max(ratios):.2f}]"
        )
    if args.profile:
        prof = cProfile.Profile()
        prof.enable()
        folded()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(15)
        print(s.getvalue())


if __name__ == "__main__":
    main()
