"""`precision: auto` against a forced precision: the default job (`lmppo train`, built-in recipe) side by side.

On a CPU without native bf16, `auto` must run as fast as the job forced to fp32; on a CPU with it, as fast as the
job forced to bf16. Each round runs both commands, one after the other, in alternating order, each in its own
process with a fresh output folder; the figure per side is the best round (the machine is shared and noisy), with
the spread over rounds.

    python benchmarks/speed/precision_auto.py [--cpu native|avx2] [--rounds 3] [--episodes 64]
        [--python .venv/bin/python]

`--cpu avx2` runs every process as a CPU without native bf16 would: torch's kernels held at AVX2
(ATEN_CPU_CAPABILITY=avx2) and oneDNN held at AVX2 (ONEDNN_MAX_CPU_ISA=AVX2). On an AVX-512 BF16 machine this
reproduces the slow bf16 of an AVX2-only CPU (a bf16 matmul at about 2 GFLOP/s), so both kinds can be measured on
one machine; it is an emulation, and the note says so.

Printed: the CPU capabilities and the matmul rates (fp32, bf16) measured in the same environment, then per side the
precision the run chose, training episodes/s (episodes / the sum of the phase times of every iteration), the
command's wall time, and the ratio auto / forced.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}

MACHINE_PROBE = r"""
import json, time, torch
torch.set_num_threads(2)
from lmppo.models.precision import cpu_bf16_support, native_cpu_bf16
def rate(dtype, n=512, reps=5):
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = min((lambda t: (a @ b, time.perf_counter() - t)[1])(time.perf_counter()) for _ in range(reps))
    return 2 * n ** 3 / best / 1e9
cpu = cpu_bf16_support()
print(json.dumps({"cpu": cpu.__dict__, "native_bf16": native_cpu_bf16(cpu), "fp32_gflops": rate(torch.float32),
                  "bf16_gflops": rate(torch.bfloat16)}))
"""


def run_job(python: str, env: dict, episodes: int, precision: str | None, workdir: Path) -> dict:
    out = workdir / f"run-{precision or 'auto'}-{time.monotonic_ns()}"
    cmd = [python, "-m", "lmppo.apps.cli", "train", "--total_episodes", str(episodes), "--output_dir", str(out)]
    if precision:
        cmd += ["--precision", precision]
    start = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    seconds = sum(v for row in rows for k, v in row.items() if k.startswith("time/"))
    chosen = next(line for line in proc.stdout.splitlines() if line.startswith("precision "))
    shutil.rmtree(out, ignore_errors=True)
    return {
        "eps": rows[-1]["episode"] / seconds,
        "wall": wall,
        "chosen": chosen,
        "phases": {k: sum(r[k] for r in rows) for k in rows[0] if k.startswith("time/")},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--cpu",
        choices=("native", "avx2"),
        default="native",
        help="native: this machine as it is; avx2: emulate a CPU without native bf16 (see above)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument(
        "--forced",
        choices=("fp32", "bf16"),
        default=None,
        help="the forced side (default: fp32 without native bf16, bf16 with it)",
    )
    args = ap.parse_args(argv)

    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if args.cpu == "avx2":
        env.update(AVX2_ENV)
    probe = subprocess.run([args.python, "-c", MACHINE_PROBE], env=env, capture_output=True, text=True, check=True)
    machine = json.loads(probe.stdout.strip().splitlines()[-1])
    print(f"cpu ({args.cpu}): {machine['cpu']}; native bf16: {machine['native_bf16']}")
    print(f"matmul 512x512: fp32 {machine['fp32_gflops']:.1f} GFLOP/s, bf16 {machine['bf16_gflops']:.1f} GFLOP/s")
    forced = args.forced or ("bf16" if machine["native_bf16"] else "fp32")

    results: dict[str, list[dict]] = {"auto": [], forced: []}
    with tempfile.TemporaryDirectory(prefix="lmppo-precision-") as tmp:
        for r in range(args.rounds):
            order = [None, forced] if r % 2 == 0 else [forced, None]
            for precision in order:
                res = run_job(args.python, env, args.episodes, precision, Path(tmp))
                results[precision or "auto"].append(res)
                print(
                    f"round {r + 1} {precision or 'auto':>5}: {res['eps']:.3f} eps (training), "
                    f"{res['wall']:.1f} s wall  [{res['chosen']}]",
                    flush=True,
                )

    print(f"\n{'side':>6} {'best eps':>9} {'spread%':>8} {'best wall s':>12}")
    best = {}
    for name in ("auto", forced):
        eps = [x["eps"] for x in results[name]]
        wall = [x["wall"] for x in results[name]]
        best[name] = (max(eps), min(wall))
        print(f"{name:>6} {max(eps):9.3f} {(max(eps) - min(eps)) / max(eps) * 100:8.1f} {min(wall):12.1f}")
    print(
        f"auto / {forced}: training eps x{best['auto'][0] / best[forced][0]:.3f}, "
        f"wall time x{best['auto'][1] / best[forced][1]:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
