"""Which precision a run computes in. `precision: auto` takes bf16 autocast only where the machine runs it faster.

Design notes: docs/design.md, `lmppo.models.precision`."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Literal, Optional

import torch

from lmppo.models.assets import cache_dir
from lmppo.models.cache import fill_file

PRECISIONS = ("auto", "fp32", "bf16")
BF16_MUST_BE_FASTER = 0.8
"""The probe picks bf16 only when a bf16 layer takes at most this fraction of the fp32 layer's time."""
X86 = ("x86_64", "amd64", "i386", "i686")


@dataclass(frozen=True)
class CpuBf16Support:
    """What the machine says about bf16 on its CPU (read by `cpu_bf16_support`; tests build their own)."""

    machine: str  # platform.machine(), e.g. "x86_64", "aarch64"
    capability: str  # torch's CPU kernel level: torch.backends.cpu.get_cpu_capability(), e.g. "AVX512", "AVX2"
    avx512_bf16: bool  # the CPU has the AVX-512 BF16 instructions
    amx: bool  # the CPU has AMX tiles (bf16 matrix units)
    onednn_isa_limit: str  # ONEDNN_MAX_CPU_ISA, when set: oneDNN may use less than the CPU has


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Literal["fp32", "bf16"]  # what the run computes in
    reason: str  # one line for the console and the run's config.yaml
    bf16_slowdown: Optional[float] = None  # bf16 time / fp32 time of the probe layer, when the probe ran


def cpu_bf16_support() -> CpuBf16Support:
    """The detection boundary: everything `choose_precision` knows about the CPU comes from here."""
    return CpuBf16Support(
        machine=platform.machine().lower(),
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx=bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        onednn_isa_limit=os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip(),
    )


def native_cpu_bf16(cpu: CpuBf16Support) -> Optional[bool]:
    """True / False when the CPU's capabilities settle whether bf16 is native, None when only a probe can tell."""
    if cpu.onednn_isa_limit:
        return None  # oneDNN may be held below the instructions the CPU has
    if cpu.machine not in X86:
        return None  # ARM and others: bf16 support varies (SVE, NEON BF16); measure
    if cpu.capability.startswith("AVX512") and (cpu.avx512_bf16 or cpu.amx):
        return True
    if not cpu.capability.startswith("AVX512"):
        return False  # AVX2 or less: no bf16 instructions for oneDNN to use
    return None  # AVX-512 without BF16: oneDNN emulates bf16; measure


def choose_precision(
    requested: str,
    device_type: str,
    *,
    cuda_bf16: Optional[bool] = None,
    cpu: Optional[CpuBf16Support] = None,
    probe: Optional[Callable[[], float]] = None,
) -> PrecisionChoice:
    """The precision a run on `device_type` ("cpu" / "cuda") computes in, for `requested` in PRECISIONS.

    `cuda_bf16` / `cpu` default to reading the machine; `probe` (default `cached_bf16_slowdown`) returns the bf16 /
    fp32 time ratio of one layer and runs only when the capabilities do not settle the choice (or to measure the
    slowdown an explicit `bf16` costs on a CPU without native bf16)."""
    probe = probe or cached_bf16_slowdown
    if requested == "fp32":
        return PrecisionChoice("fp32", "precision fp32 as configured")
    if device_type == "cuda":
        supported = torch.cuda.is_bf16_supported() if cuda_bf16 is None else cuda_bf16
        if requested == "bf16":
            return PrecisionChoice("bf16", "precision bf16 as configured")
        return (
            PrecisionChoice("bf16", "auto: bf16 autocast, the CUDA GPU supports bf16")
            if supported
            else PrecisionChoice("fp32", "auto: fp32, the CUDA GPU has no bf16 support")
        )
    if device_type != "cpu":
        return PrecisionChoice(
            "fp32" if requested == "auto" else requested,
            f"{'auto: fp32' if requested == 'auto' else 'precision bf16 as configured'} (device {device_type})",
        )
    cpu = cpu or cpu_bf16_support()
    native = native_cpu_bf16(cpu)
    where = _describe(cpu)
    if requested == "bf16":
        if native:
            return PrecisionChoice("bf16", f"precision bf16 as configured ({where}, native bf16)")
        slowdown = probe()
        if slowdown > BF16_MUST_BE_FASTER:
            warnings.warn(
                f"precision bf16 on a CPU without native bf16 ({where}): a bf16-autocast layer ran "
                f"{slowdown:.1f}x as long as in fp32 on this machine, and whole training iterations lose "
                "more (the default job ran 16x slower on such a CPU, docs/performance.md); `precision: "
                "auto` (or fp32) picks the faster one",
                UserWarning,
                stacklevel=2,
            )
        return PrecisionChoice("bf16", f"precision bf16 as configured ({where})", slowdown)
    if native is True:
        return PrecisionChoice("bf16", f"auto: bf16 autocast, this CPU has native bf16 ({where})")
    if native is False:
        return PrecisionChoice("fp32", f"auto: fp32, this CPU has no native bf16 ({where})")
    slowdown = probe()
    if slowdown <= BF16_MUST_BE_FASTER:
        return PrecisionChoice(
            "bf16", f"auto: bf16 autocast, measured {1 / slowdown:.1f}x faster than fp32 here ({where})", slowdown
        )
    return PrecisionChoice(
        "fp32", f"auto: fp32, bf16 measured {slowdown:.1f}x as slow as fp32 here ({where})", slowdown
    )


def _describe(cpu: CpuBf16Support) -> str:
    extras = [name for name, on in (("AVX-512 BF16", cpu.avx512_bf16), ("AMX", cpu.amx)) if on]
    text = f"{cpu.machine} CPU, {cpu.capability} kernels" + (f", {' and '.join(extras)}" if extras else "")
    return text + (f", ONEDNN_MAX_CPU_ISA={cpu.onednn_isa_limit}" if cpu.onednn_isa_limit else "")


# ----------------------------------------------------------------------------- the probe


def measure_bf16_slowdown(rows: int = 64, width: int = 576, hidden: int = 1536, repeats: int = 7) -> float:
    """bf16-autocast time / fp32 time of one MLP block (the shape of SmolLM2-135M's), best of `repeats` each,
    alternating; about 0.1 s on a CPU with native bf16, well under a second without it."""
    layer = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.SiLU(), torch.nn.Linear(hidden, width))
    x = torch.randn(rows, width)
    best = {False: float("inf"), True: float("inf")}
    with torch.inference_mode():
        for i in range(2 * repeats + 2):
            bf16 = bool(i % 2)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                start = time.perf_counter()
                layer(x)
                elapsed = time.perf_counter() - start
            if i >= 2:  # the first call of each kind warms up (oneDNN builds its kernels)
                best[bf16] = min(best[bf16], elapsed)
    return best[True] / max(best[False], 1e-9)


def _probe_key() -> str:
    parts = [
        platform.machine(),
        platform.processor(),
        torch.__version__,
        str(torch.get_num_threads()),
        os.environ.get("ONEDNN_MAX_CPU_ISA", ""),
        os.environ.get("ATEN_CPU_CAPABILITY", ""),
    ]
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            parts += sorted({line.strip() for line in fh if line.startswith(("model name", "flags"))})
    except OSError:
        pass
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def cached_bf16_slowdown() -> float:
    """`measure_bf16_slowdown`, cached per machine, torch version, thread count and ISA limits. One process probes
    while others wait (`lmppo.models.cache`: two probes at once would time each other); the global torch RNG is
    left as it was (the probe's random layer and input would otherwise shift a seeded run's numbers)."""
    path, key = cache_dir() / "bf16-probe.json", _probe_key()

    def cached(p: Path) -> Optional[float]:
        try:
            got = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        ok = isinstance(got, dict) and got.get("key") == key and isinstance(got.get("slowdown"), (int, float))
        return float(got["slowdown"]) if ok else None

    measured: list[float] = []

    def build(tmp: Path) -> None:
        measured.append(_probe_keeping_rng())
        tmp.write_text(json.dumps({"key": key, "slowdown": measured[0]}), encoding="utf-8")

    try:
        fill_file(path, build, lambda p: cached(p) is not None, "the bf16 speed probe")
    except OSError:  # a cache that cannot be written only costs the probe next time
        pass
    if measured:
        return measured[0]
    got = cached(path)
    return got if got is not None else _probe_keeping_rng()


def _probe_keeping_rng() -> float:
    with torch.random.fork_rng(devices=[]):
        return measure_bf16_slowdown()


def choice_record(choice: PrecisionChoice) -> dict:
    """The choice as stored in the run's config.yaml."""
    return {k: v for k, v in asdict(choice).items() if v is not None}
