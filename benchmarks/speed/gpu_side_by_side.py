"""GPU side by side (issue 32): TRL 1.12's PPOTrainer and lmppo on random-initialised Llama models of real shapes.

The work of issue 32's table: SmolLM2's tokenizer (vocabulary 49,152), the policy in SmolLM2-360M's shape (or 1.7B's
with `--policy 1.7b`), critic and reward model in SmolLM2-135M's; 64-token prompts; batch 64, 4 minibatches, 4 PPO
epochs, 128 new tokens and no stop token; fp32 weights with bf16 autocast; 6 iterations, the first one warm-up.
Each side runs in its own process (`compare_trl.run_trl` / `run_lmppo` with the device and autocast switched on),
one after the other: TRL, lmppo with a critic (the default configuration), lmppo with a shared value head, lmppo with
`rollout.backend: hf`. Printed: episodes/s (whole loop and steady, iteration 1 dropped), seconds per iteration, the
rollout and update seconds of iterations 2.., GPU peak memory (torch.cuda.max_memory_allocated), whether AdamW was
fused, and decoding ms/step at the batch size (lmppo's native sampler, its eager static path, and HF `generate`).

On a bare GPU machine with no network (wheels from `benchmarks/tools/gpu_wheels.sh`, downloaded beforehand):

    bash benchmarks/tools/gpu_wheels.sh install && export PYTHONPATH=/tmp/lmppo-site:src
    python3 benchmarks/speed/gpu_side_by_side.py [--policy 1.7b] [--sides trl,critic,shared,hf]

`--tiny` runs the same code on tiny shapes (and the CPU when there is no GPU), for testing the script.
`--then-1.7b --budget 540`: after the 360M sides, TRL and lmppo (critic) with the 1.7B policy, each worker stopped
when the budget (seconds since the start) runs out; the summary says what did not finish. The summary lines give
issue 44's figures: lmppo / TRL episodes/s, GPU peak against TRL's, the update phase, decoding ms/step and the first
iteration's compile time (`time/compile`, `ppo.compile`).
Worker mode (used by the driver): `--worker build|trl|lmppo --cfg run.json --result out.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
import bench_path  # noqa: E402


def _shape(hidden: int, mlp: int, layers: int, heads: int, kv_heads: int) -> dict:
    return dict(
        hidden_size=hidden,
        intermediate_size=mlp,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
    )


SHAPES = {  # SmolLM2's configs (hidden, MLP, layers, heads, KV heads); all tie the embeddings
    "135m": _shape(576, 1536, 30, 9, 3),
    "360m": _shape(960, 2560, 32, 15, 5),
    "1.7b": _shape(2048, 8192, 24, 32, 32),
    "tiny": _shape(64, 128, 2, 4, 2),
}
SETTINGS = dict(  # issue 32's table; compare_trl's keys
    batch_size=64,
    num_mini_batches=4,
    ppo_epochs=4,
    response_length=128,
    prompt_length=64,
    iterations=6,
    learning_rate=3e-6,
    kl_coef=0.05,
    cliprange=0.2,
    cliprange_value=0.2,
    vf_coef=0.1,
    gamma=1.0,
    lam=0.95,
    temperature=1.0,
    stop_token=None,
    missing_eos_penalty=None,
    threads=8,
    dtype="float32",
    lr_schedule="constant",
)
TINY = dict(
    batch_size=8, num_mini_batches=2, ppo_epochs=2, response_length=16, prompt_length=16, iterations=3, threads=1
)
SIDES = {  # name -> (worker, lmppo overrides)
    "trl": ("trl", {}),
    "critic": ("lmppo", {}),
    "shared": ("lmppo", {"shared_value_head": True}),
    "hf": ("lmppo", {"backend": "hf"}),
}
LABELS = {
    "trl": "TRL 1.12 PPOTrainer",
    "critic": "lmppo, critic, native (default)",
    "shared": "lmppo, shared value head, native",
    "hf": "lmppo, critic, `rollout.backend: hf`",
}


def default_tokenizer() -> str:
    carried = bench_path.BENCHMARKS / ".wheels" / "tokenizer"
    return str(carried if carried.exists() else Path.home() / ".cache/lmppo/models/smollm2-135m-instruct")


# ------------------------------------------------------------------------------------------------------------------
# workers (each in its own process)
# ------------------------------------------------------------------------------------------------------------------


def build(cfg: dict) -> dict:
    """Random-initialised models of the configured shapes, SmolLM2's tokenizer and random 64-token prompts, saved in
    compare_trl's cache layout (tokenizer/, policy/, critic/, reward/, prompts.json)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    cache = Path(cfg["cache"])
    tok = AutoTokenizer.from_pretrained(cfg["tokenizer"])
    tok.pad_token = tok.pad_token or tok.eos_token
    tok.save_pretrained(cache / "tokenizer")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    sizes = {}
    for name, shape, head in (
        ("policy", cfg["policy_shape"], LlamaForCausalLM),
        ("critic", cfg["value_shape"], LlamaForSequenceClassification),
        ("reward", cfg["value_shape"], LlamaForSequenceClassification),
    ):
        config = LlamaConfig(
            vocab_size=len(tok), tie_word_embeddings=True, rope_theta=100000.0, max_position_embeddings=8192,
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            num_labels=1, **SHAPES[shape],
        )  # fmt: skip
        torch.manual_seed(cfg["seed"] + len(sizes))
        with torch.device(device):  # random init on the GPU: seconds instead of a minute for 1.7B
            model = head(config)
        model.to("cpu").save_pretrained(cache / name)
        tok.save_pretrained(cache / name)
        sizes[name] = sum(p.numel() for p in model.parameters())
        del model
    special = set(tok.all_special_ids)
    g = torch.Generator().manual_seed(cfg["seed"])
    ids = torch.randint(0, len(tok), (cfg["prompts"] + cfg["batch_size"], cfg["prompt_length"]), generator=g)
    rows = [[t if t not in special else 100 for t in row] for row in ids.tolist()]
    (cache / "prompts.json").write_text(json.dumps({"train": rows[: cfg["prompts"]], "eval": rows[cfg["prompts"] :]}))
    return {"parameters": sizes, "device": device}


def _switch_to_device(compare_trl, cfg: dict) -> None:
    """Make compare_trl's CPU settings run on `cfg["device"]` with bf16 autocast on both sides."""
    import dataclasses

    trl_args, lmppo_config = compare_trl.trl_args, compare_trl.lmppo_config
    cpu = cfg["device"] == "cpu"

    def gpu_trl_args(c, output_dir, config_cls=None, **extra):
        args = trl_args(c, output_dir, config_cls, **extra)
        return dataclasses.replace(args, use_cpu=cpu, bf16=cfg["bf16"], dataloader_pin_memory=not cpu)

    def gpu_lmppo_config(c, output_dir):
        config = lmppo_config(c, output_dir)
        config.device = cfg["device"]
        config.precision = "bf16" if cfg["bf16"] else "fp32"
        config.rollout.backend = cfg.get("backend", "native")
        return config

    compare_trl.trl_args, compare_trl.lmppo_config = gpu_trl_args, gpu_lmppo_config
    compare_trl._matmul_limits = lambda threads: {}  # a CPU matmul probe: not what this benchmark reports


def _decode_timings(cfg: dict) -> dict:
    """ms per decoding step at the batch size, 128 new tokens and no stop: lmppo's native sampler (CUDA graphs on
    CUDA), its static path without graphs, and HF `generate`; each after one warm-up call."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from lmppo.sampling.cuda_graphs import DecodeGraphs
    from lmppo.sampling.native import response_seed, sample_native

    device = torch.device(cfg["device"])
    cache = Path(cfg["cache"])
    model = AutoModelForCausalLM.from_pretrained(cache / "policy", dtype=torch.float32).to(device).eval()
    prompts = json.loads((cache / "prompts.json").read_text())["train"][: cfg["batch_size"]]
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids, dtype=torch.bool)
    new, none = cfg["response_length"], torch.tensor([], dtype=torch.long)
    seeds = [response_seed(0, 0, i) for i in range(len(prompts))]
    graphs = DecodeGraphs()
    gen = GenerationConfig(do_sample=True, max_new_tokens=new, min_new_tokens=new, top_k=0, top_p=1.0, pad_token_id=0)
    runs = {
        "native": lambda: sample_native(model, ids, mask, 1.0, new, none, 0, seeds, graphs=graphs),
        "native_static_eager": lambda: sample_native(model, ids, mask, 1.0, new, none, 0, seeds, decoding="static"),
        "native_dynamic": lambda: sample_native(model, ids, mask, 1.0, new, none, 0, seeds, decoding="dynamic"),
        "hf_generate": lambda: model.generate(input_ids=ids, attention_mask=mask.long(), generation_config=gen),
    }
    out = {}
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg["bf16"])
    for name, run in runs.items():
        with torch.no_grad(), autocast:
            run()  # warm-up (and graph capture)
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            result = run()
            if device.type == "cuda":
                torch.cuda.synchronize()
            out[name + "_ms_per_step"] = (time.perf_counter() - t) * 1e3 / new
        out[name + "_tokens"] = (
            int(result[0].shape[1]) if isinstance(result, tuple) else int(result.shape[1] - ids.shape[1])
        )
    out["graph_captures"] = graphs.captures
    return out


def worker(kind: str, cfg: dict) -> dict:
    if kind == "build":
        return build(cfg)
    import compare_trl
    import torch

    bench_path.put_first(bench_path.SRC)
    _switch_to_device(compare_trl, cfg)
    fused = []
    if kind == "lmppo":
        import lmppo.training.assembly as assembly
        from lmppo.models.optim import is_fused

        make = assembly.make_adamw

        def recording_make_adamw(*a, **k):
            opt = make(*a, **k)
            fused.append(is_fused(opt))
            return opt

        assembly.make_adamw = recording_make_adamw
    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    res = compare_trl.run_trl(cfg) if kind == "trl" else compare_trl.run_lmppo(cfg)
    res["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    res["adamw_fused"] = fused[0] if fused else str(res.get("optim")).split(".")[-1]
    res["gpu"] = torch.cuda.get_device_name() if cuda else None
    res["torch_cuda"] = torch.version.cuda
    if kind == "lmppo" and cfg.get("decode_timings"):
        import gc

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        res["decode"] = _decode_timings(cfg)
    return res


# ------------------------------------------------------------------------------------------------------------------
# driver
# ------------------------------------------------------------------------------------------------------------------


def spawn(kind: str, cfg: dict, work: Path, timeout: float) -> dict:
    name = cfg.get("side", kind)
    cfg_path, result, log = work / f"{name}.json", work / f"{name}.result.json", work / f"{name}.log"
    cfg_path.write_text(json.dumps(cfg))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRL_EXPERIMENTAL_SILENCE="1", HF_HUB_OFFLINE="1")
    cmd = [sys.executable, __file__, "--worker", kind, "--cfg", str(cfg_path), "--result", str(result)]
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0 or not result.exists():
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"error: the {name} worker failed (exit {proc.returncode}); its log ends:\n{tail}")
    out = json.loads(result.read_text())
    out["process_seconds"] = time.perf_counter() - t
    return out


def _range(xs: list) -> str:
    return f"{min(xs):.1f}-{max(xs):.1f}" if xs else "-"


def table(results: dict) -> str:
    lines = [
        "| side | episodes/s | steady | s per iteration | rollout s | update s | GPU peak | AdamW fused |",
        "|---|---|---|---|---|---|---|---|",
    ]
    trl_eps = results.get("trl", {}).get("eps")
    for side, r in results.items():
        its = r["iterations"][1:]
        walls = [i["wall"] for i in its]
        eps = f"{r['eps']:.2f}" + (f" (x{r['eps'] / trl_eps:.2f})" if trl_eps and side != "trl" else "")
        peak = f"{r['gpu_peak_gib']:.1f} GiB" if r.get("gpu_peak_gib") is not None else "-"
        steady = f"{r['eps_steady']:.2f}" if r.get("eps_steady") else "-"
        per_it = f"{sum(walls) / len(walls):.1f}" if walls else "-"
        rollout, update = _range([i["rollout"] for i in its]), _range([i["update"] for i in its])
        lines.append(
            f"| {LABELS[side]} | {eps} | {steady} | {per_it} | {rollout} | {update} | {peak} | {r['adamw_fused']} |"
        )
    for side, r in results.items():
        if "decode" in r:
            d = r["decode"]
            steps = ", ".join(
                f"{k[: -len('_ms_per_step')]} {v:.2f}" for k, v in d.items() if k.endswith("_ms_per_step")
            )
            lines.append(f"decoding ms/step at batch {r.get('batch_size', '?')} ({side}): {steps}")
    return "\n".join(lines)


def must_show(results: dict) -> list[str]:
    """Issue 44's figures from one set of sides: ratios to TRL, memory, update phase, decoding, compile time."""
    trl, lines = results.get("trl"), []
    for side, asked in (("critic", 3.5), ("shared", 5.0)):
        r = results.get(side)
        if r is None:
            continue
        if trl:
            lines.append(f"{side}: episodes/s {r['eps'] / trl['eps']:.2f}x TRL's (issue 44 asks >= {asked}x)")
        if trl and r.get("gpu_peak_gib") is not None and trl.get("gpu_peak_gib") is not None:
            lines.append(f"{side}: GPU peak {r['gpu_peak_gib']:.1f} GiB, TRL {trl['gpu_peak_gib']:.1f} GiB (asks <=)")
        steady = r["iterations"][1:]
        if steady:
            update = [i["update"] for i in steady]
            lines.append(f"{side}: update phase {sum(update) / len(update):.2f} s ({_range(update)}; asks <= 1.5 s)")
        first = r["iterations"][0] if r["iterations"] else {}
        lines.append(f"{side}: compile time in the first iteration {first.get('compile', 0.0):.1f} s (time/compile)")
        if "decode" in r:
            lines.append(f"{side}: decoding {r['decode']['native_ms_per_step']:.2f} ms/step (asks <= 3 ms)")
    return lines


def run_sides(sides: list[str], settings: dict, work: Path, timeout: float, deadline: float, decode: bool) -> dict:
    """Each side in its own worker, in order; a side past `deadline` (time.perf_counter) is left out, said so."""
    results: dict = {}
    for side in sides:
        left = min(timeout, deadline - time.perf_counter())
        if left < 30:
            print(f"{side}: not run, the budget is spent", flush=True)
            continue
        kind, over = SIDES[side]
        cfg = dict(settings, **over, side=side, out_dir=str(work / side), decode_timings=side == "critic" and decode)
        try:
            results[side] = spawn(kind, cfg, work, left)
        except subprocess.TimeoutExpired:
            print(f"{side}: stopped after {left:.0f} s (budget or --timeout), no figures", flush=True)
            continue
        results[side]["batch_size"] = settings["batch_size"]
        r = results[side]
        print(f"{side}: {r['eps']:.2f} episodes/s, process {r['process_seconds']:.0f} s", flush=True)
        (work / "results.json").write_text(json.dumps(results, indent=1))  # kept if a later side fails
    return results


def _one_policy(settings: dict, sides: list[str], args, deadline: float, subfolder: str = "") -> dict:
    """Build the models of `settings`, run `sides`, print the table and the summary; returns the results."""
    work = args.work / subfolder if subfolder else args.work
    work.mkdir(parents=True, exist_ok=True)
    cache = args.work / f"models-{settings['policy_shape']}"
    settings = dict(settings, cache=str(cache))
    left = min(args.timeout, deadline - time.perf_counter())
    try:
        built = spawn("build", dict(settings, side="build"), work, left)
    except subprocess.TimeoutExpired:
        print(f"{settings['policy_shape']}: the models were not built within the budget", flush=True)
        return {}
    print(f"models: {built['parameters']} built on {built['device']} in {built['process_seconds']:.0f} s", flush=True)
    results = run_sides(sides, settings, work, args.timeout, deadline, not args.no_decode)
    first = next(iter(results.values()), {})
    torch_version, cuda = first.get("versions", {}).get("torch"), first.get("torch_cuda")
    print(f"\ndevice: {first.get('gpu') or settings['device']}; torch {torch_version} (CUDA {cuda})")
    print(f"versions: {json.dumps({s: r.get('versions') for s, r in results.items()})}")
    print(
        f"policy {settings['policy_shape']}, critic/reward {settings['value_shape']}; batch {settings['batch_size']}, "
        f"{settings['num_mini_batches']} minibatches, {settings['ppo_epochs']} epochs, "
        f"{settings['response_length']} new tokens, no stop token, {settings['iterations']} iterations "
        "(the first dropped from steady, rollout, update)"
    )
    print(table(results))
    for line in must_show(results):
        print(f"{settings['policy_shape']} {line}")
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--policy", choices=["360m", "1.7b"], default="360m", help="the policy's shape (critic/reward: 135m)"
    )
    ap.add_argument("--sides", default="trl,critic,shared,hf", help=f"comma-separated, of {', '.join(SIDES)}")
    ap.add_argument("--iterations", type=int, default=None, help="PPO iterations per side (default 6; --tiny 3)")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes and batch, for testing the script (CPU if no GPU)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    ap.add_argument(
        "--tokenizer", default=None, help="SmolLM2 tokenizer folder (default: benchmarks/.wheels/tokenizer)"
    )
    ap.add_argument("--work", type=Path, default=bench_path.BENCHMARKS / ".cache" / "gpu_side_by_side")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per worker process")
    ap.add_argument("--no-decode", action="store_true", help="skip the decoding ms/step measurement")
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole run; later sides are skipped")
    ap.add_argument("--then-1.7b", dest="then_17b", action="store_true", help="then TRL and critic with 1.7B")
    ap.add_argument("--worker", choices=["build", "trl", "lmppo"], help=argparse.SUPPRESS)
    ap.add_argument("--cfg", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        bench_path.put_first(bench_path.SRC)
        args.result.write_text(json.dumps(worker(args.worker, json.loads(args.cfg.read_text()))))
        return 0
    sides = [s for s in args.sides.split(",") if s]
    bad = [s for s in sides if s not in SIDES]
    if bad:
        raise SystemExit(f"error: --sides {','.join(bad)}: not a side; allowed: {', '.join(SIDES)}")
    import torch  # the driver needs it only to pick the device

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    settings = dict(SETTINGS, **(TINY if args.tiny else {}))
    if args.iterations:
        settings["iterations"] = args.iterations
    settings.update(
        seed=0, device=device, bf16=device == "cuda", episodes=settings["iterations"] * settings["batch_size"],
        prompts=settings["iterations"] * settings["batch_size"], tokenizer=args.tokenizer or default_tokenizer(),
        policy_shape="tiny" if args.tiny else args.policy, value_shape="tiny" if args.tiny else "135m",
    )  # fmt: skip
    args.work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    deadline = t0 + (args.budget or float("inf"))
    results = _one_policy(settings, sides, args, deadline)
    if args.then_17b:  # (--tiny: the same code path on the tiny shape)
        big = dict(settings, policy_shape="tiny" if args.tiny else "1.7b")
        _one_policy(big, [s for s in ("trl", "critic") if s in sides], args, deadline, subfolder="1.7b")
    print(f"total {time.perf_counter() - t0:.0f} s")
    (args.work / "results.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
