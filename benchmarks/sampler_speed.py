"""Native sampling loop vs transformers `generate`, same model, prompts and lengths, alternating runs.

    python benchmarks/sampler_speed.py [--model smollm2] [--batch 8] [--new 24] [--repeats 3] [--threads 1]

Prints seconds per batch of each (median of repeats), their ratio, and tokens/s. Both sample purely at the
temperature; stop tokens are disabled so both produce exactly `--new` tokens per row.
"""

import argparse
import statistics
import time

import torch

from lmppo.models import load_tokenizer, prepare_policy, resolve_model_path
from lmppo.config import ModelConfig
from lmppo.rollout import left_pad, pure_sampling_config, sample_responses
from lmppo.sampling import response_seed, sample_native


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bf16", action="store_true", help="autocast both samplers to bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(args.model)
    tok = load_tokenizer(path, ModelConfig())
    model = prepare_policy(AutoModelForCausalLM.from_pretrained(path), ModelConfig())
    texts = [f"The movie number {i} was" + " really" * (i % 5) for i in range(args.batch)]
    ids, mask = left_pad([tok(t)["input_ids"] for t in texts], tok.pad_token_id)
    no_stop = torch.tensor([], dtype=torch.long)
    gen_config = pure_sampling_config(model, 1.0, args.new, [], tok.pad_token_id)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16)

    def native():
        with autocast:
            return sample_native(model, ids, mask, 1.0, args.new, no_stop, tok.pad_token_id,
                                 [response_seed(0, 0, i) for i in range(args.batch)])

    def hf():
        with autocast:
            return sample_responses(model, ids, mask, gen_config, no_stop, args.new)

    times = {"native": [], "hf": []}
    native(), hf()  # warm-up
    for _ in range(args.repeats):
        for name, fn in (("hf", hf), ("native", native)):
            start = time.perf_counter()
            out = fn()
            times[name].append(time.perf_counter() - start)
            assert out[0].shape == (args.batch, args.new), out[0].shape
    med = {k: statistics.median(v) for k, v in times.items()}
    tokens = args.batch * args.new
    print(f"model {args.model}, batch {args.batch} x {args.new} new tokens, {args.threads} thread(s), "
          f"bf16 autocast {args.bf16}")
    for name in ("hf", "native"):
        print(f"  {name:7s} {med[name]:.3f} s per batch  {tokens / med[name]:.1f} tokens/s  (runs: "
              + ", ".join(f"{t:.3f}" for t in times[name]) + ")")
    print(f"  native speed-up over hf generate: {med['hf'] / med['native']:.2f}x")


if __name__ == "__main__":
    main()
