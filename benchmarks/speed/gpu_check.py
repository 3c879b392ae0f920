"""What the CPU tests cannot check, run on a CUDA machine (issue 32): the native sampler's noise is bit-identical on
CPU and GPU, the CUDA-graph decoding gives the eager static and the dynamic loop's tokens, CPU and GPU sample the
same tokens from one fp32 model, blockwise bf16 logprobs match the fp32 formula, AdamW is fused; the compiled update
(issue 44, CUDA graphs) computes the eager one's update, and a non-finite step is skipped on the device. Prints one JSON
line per check and `ALL OK` or the failed checks; exit status 1 if one failed.

    PYTHONPATH=src python3 benchmarks/speed/gpu_check.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
import bench_path  # noqa: E402

bench_path.put_first(bench_path.SRC)

import torch  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

from lmppo.core.logprobs import entropy_from_logits, selective_log_softmax  # noqa: E402
from lmppo.models.optim import is_fused, make_adamw  # noqa: E402
from lmppo.sampling.cuda_graphs import DecodeGraphs  # noqa: E402
from lmppo.sampling.native import response_seed, sample_native  # noqa: E402
from lmppo.sampling.noise import gumbel_noise, seed_tensor, uniform_words  # noqa: E402

FAILED: list[str] = []


def report(name: str, ok: bool, **facts) -> None:
    print(json.dumps({"check": name, "ok": bool(ok), **facts}), flush=True)
    if not ok:
        FAILED.append(name)


def noise() -> None:
    seeds = [response_seed(0, it, p) for it in (0, 7) for p in range(32)]
    cpu, gpu = seed_tensor(seeds, "cpu"), seed_tensor(seeds, "cuda")
    for step in (0, 1, 127):
        words = torch.equal(uniform_words(cpu, step, 49152), uniform_words(gpu, step, 49152).cpu())
        a, b = gumbel_noise(cpu, step, 49152), gumbel_noise(gpu, torch.tensor(step, device="cuda"), 49152).cpu()
        report(f"noise_step{step}", words and torch.equal(a, b), words_equal=words, gumbel_differ=int((a != b).sum()))


def tiny_model(device: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, eos_token_id=2, pad_token_id=0)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[2] += 2 * model.lm_head.weight.std()  # rows stop at different steps
    return model.to(device)


def decoding() -> None:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 20, (37,), generator=g)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in lengths]
    ids = torch.zeros(len(prompts), 20, dtype=torch.long)
    mask = torch.zeros(len(prompts), 20, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, 20 - len(p) :], mask[i, 20 - len(p) :] = torch.tensor(p), True
    seeds = [response_seed(3, 1, i) for i in range(len(prompts))]
    stop = torch.tensor([2])
    cpu_model, gpu_model = tiny_model("cpu"), tiny_model("cuda")
    graphs = DecodeGraphs()
    for bf16 in (False, True):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
            runs = {
                "graphs": sample_native(gpu_model, ids.cuda(), mask.cuda(), 1.0, 40, stop, 0, seeds, graphs=graphs),
                "graphs_again": sample_native(
                    gpu_model, ids.cuda(), mask.cuda(), 1.0, 40, stop, 0, seeds, graphs=graphs
                ),
                "static": sample_native(gpu_model, ids.cuda(), mask.cuda(), 1.0, 40, stop, 0, seeds, "static"),
                "dynamic": sample_native(gpu_model, ids.cuda(), mask.cuda(), 1.0, 40, stop, 0, seeds, "dynamic"),
            }
        want = runs["graphs"][0].cpu()
        same = {k: torch.equal(v[0].cpu(), want) for k, v in runs.items()}
        rows = {k: int((v[0].cpu() == want).all(1).sum()) if v[0].shape == want.shape else -1 for k, v in runs.items()}
        report(f"graphs_vs_eager_bf16={bf16}", same["graphs_again"] and same["static"], same=same, rows_equal=rows,
               captures=graphs.captures, rows=len(prompts), terminated=int(runs["graphs"][2].sum()))  # fmt: skip
        if not bf16:
            cpu = sample_native(cpu_model, ids, mask, 1.0, 40, stop, 0, seeds, "dynamic")[0]
            rows_cpu = int((cpu == want).all(1).sum()) if cpu.shape == want.shape else -1
            report(
                "cpu_vs_gpu_fp32_tokens", True, rows_equal=rows_cpu, rows=len(prompts), note="logits differ in float"
            )
            report("graphs_vs_dynamic_fp32", same["dynamic"], rows_equal=rows["dynamic"])


def logprobs() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(16, 192, 49152, device="cuda", generator=g)).bfloat16().requires_grad_()
    index = torch.randint(0, 49152, (16, 192), device="cuda", generator=g)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    lp = selective_log_softmax(logits, index)
    (lp.sum() + entropy_from_logits(logits).sum()).backward()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ref = torch.log_softmax(logits.detach().float(), -1).gather(-1, index[..., None]).squeeze(-1)
    err = float((lp.detach() - ref).abs().max())
    report("blockwise_logprobs_bf16", err < 1e-4, max_abs_error=err, extra_peak_gib=round(peak, 3),
           logits_gib=round(logits.numel() * 2 / 2**30, 3))  # fmt: skip


def adamw() -> None:
    opt = make_adamw([torch.zeros(10, device="cuda", requires_grad=True)], 1e-3, 1e-8, 0.0)
    report("adamw_fused_on_cuda", is_fused(opt))


def compiled_update(device: str = "cuda") -> None:
    """Issue 44: one PPO update of a tiny Llama on CUDA, `ppo.compile` on (reduce-overhead: CUDA graphs) against off,
    from the same rollout: the statistics and the weights agree; a non-finite step is skipped in the fused kernel."""
    import tempfile

    bench_path.put_first(bench_path.TESTS)
    from conftest import PROMPTS, small_config, tiny_llama
    from helpers_tokenizers import make_bpe_tokenizer
    from lmppo.training.metrics import MetricsAccumulator
    from lmppo.training.trainer import PPOTrainer
    from lmppo.training.update import NonfiniteGuard, UpdateBatch

    tok, folder = make_bpe_tokenizer(), Path(tempfile.mkdtemp())
    reward = [lambda prompts, completions: [len(c) / 20.0 for c in completions]]
    trainers = {
        mode: PPOTrainer(small_config(folder / mode, 1, 8, device=device, ppo__compile=mode), policy=tiny_llama(tok),
                         tokenizer=tok, prompts=PROMPTS, reward_functions=reward)
        for mode in ("off", "on")
    }  # fmt: skip
    source = trainers["off"]
    rollout = source.collect_rollout()
    rewards = source.token_rewards(rollout, source.score(rollout))
    advantages, returns = source.advantages(rollout, rewards)
    means = {}
    for mode, trainer in trainers.items():
        stats = MetricsAccumulator()
        trainer.updater.update(UpdateBatch(rollout, advantages, returns, rewards.train_mask), stats)
        means[mode] = stats.means()
    stat_err = max(abs(means["on"][k] - v) for k, v in means["off"].items())
    weights = [dict(t.actor.named_parameters()) for t in trainers.values()]
    weight_err = max(float((weights[1][k] - w).abs().max()) for k, w in weights[0].items())
    compiled = trainers["on"].updater.compiled
    report("compiled_update_cuda_graphs", stat_err < 1e-4 and weight_err < 1e-4 and compiled.compiled_calls == 4,
           stat_max_abs_error=stat_err, weight_max_abs_error=weight_err, failure=compiled.failure,
           compiled_calls=compiled.compiled_calls, compile_seconds=round(compiled.take_seconds(), 1))  # fmt: skip
    weight = torch.nn.Parameter(torch.ones(4, device=device))
    guard = NonfiniteGuard(make_adamw([weight], 0.1, 1e-8, 0.0), 0, 3, torch.device(device))
    weight.grad = torch.full((4,), float("nan"), device=device)
    guard.step(lambda: torch.linalg.vector_norm(weight.grad), torch.tensor(1.0, device=device), MetricsAccumulator())
    report("nonfinite_step_skipped_on_device", guard.on_device and bool((weight == 1).all()) and guard.check() == 1)


def main() -> int:
    if not torch.cuda.is_available():
        print("error: no CUDA device: this script checks the GPU paths")
        return 2
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "cuda": torch.version.cuda}))
    for check in (noise, decoding, logprobs, adamw, compiled_update):
        try:
            check()
        except Exception as err:  # one broken check must not hide the others' results
            report(check.__name__, False, error=f"{type(err).__name__}: {err}"[:2000])
    print("ALL OK" if not FAILED else f"FAILED: {', '.join(FAILED)}")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
