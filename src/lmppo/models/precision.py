"""Which precision a run computes in. `precision: auto` takes bf16 autocast only where the CPU (or GPU) has native bf16.

The choice is a function of what the machine says it supports (`cpu_bf16_support`), never of a timing: the same
machine gives the same choice whatever else runs on it. A run stores the choice in its config.yaml, and a resume
computes in it (`lmppo.training.resume`). Design notes: docs/design.md, `lmppo.models.precision`."""

from __future__ import annotations

import os
import platform
import warnings
from dataclasses import dataclass
from typing import Literal, Optional

import torch

PRECISIONS = ("auto", "fp32", "bf16")
X86 = ("x86_64", "amd64", "i386", "i686")
ONEDNN_BF16_ISAS = ("AVX512_CORE_BF16", "AVX10_1_512", "AVX512_CORE_AMX", "AVX2_VNNI_2")
"""ONEDNN_MAX_CPU_ISA values (and above) at which oneDNN uses bf16 instructions; `ALL`/`DEFAULT` set no limit."""


@dataclass(frozen=True)
class CpuBf16Support:
    """What the machine says about bf16 on its CPU (read by `cpu_bf16_support`; tests build their own)."""

    machine: str  # platform.machine(), e.g. "x86_64", "aarch64"
    capability: str  # torch's CPU kernel level: torch.backends.cpu.get_cpu_capability(), e.g. "AVX512", "AVX2"
    avx512_bf16: bool  # the CPU has the AVX-512 BF16 instructions
    amx: bool  # the CPU has AMX tiles (bf16 matrix units)
    onednn_isa_limit: str  # ONEDNN_MAX_CPU_ISA, when set: oneDNN may use less than the CPU has
    arm_bf16: bool = False  # an Arm CPU with the BF16 extension (`bf16` among /proc/cpuinfo's Features)


@dataclass(frozen=True)
class PrecisionChoice:
    precision: Literal["fp32", "bf16"]  # what the run computes in
    reason: str  # one line for the console and the run's config.yaml


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith(("flags", "features")):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_bf16_support() -> CpuBf16Support:
    """The detection boundary: everything `choose_precision` knows about the CPU comes from here."""
    machine = platform.machine().lower()
    return CpuBf16Support(
        machine=machine,
        capability=torch.backends.cpu.get_cpu_capability(),
        avx512_bf16=bool(torch.cpu._is_avx512_bf16_supported()),
        amx=bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()),
        onednn_isa_limit=os.environ.get("ONEDNN_MAX_CPU_ISA", "").strip(),
        arm_bf16=machine not in X86 and "bf16" in _cpu_flags(),
    )


def _limit_allows_bf16(limit: str) -> bool:
    limit = limit.upper()
    return limit in ("", "ALL", "DEFAULT") or any(limit.startswith(isa) for isa in ONEDNN_BF16_ISAS)


def native_cpu_bf16(cpu: CpuBf16Support) -> bool:
    """Whether the CPU computes bf16 natively: x86 with AVX-512 BF16 or AMX (and oneDNN not held below them by
    ONEDNN_MAX_CPU_ISA), or Arm with its BF16 extension. Without them oneDNN emulates bf16, many times slower."""
    if not _limit_allows_bf16(cpu.onednn_isa_limit):
        return False
    if cpu.machine not in X86:
        return cpu.arm_bf16
    return cpu.capability.startswith("AVX512") and (cpu.avx512_bf16 or cpu.amx)


def choose_precision(
    requested: str, device_type: str, *, cuda_bf16: Optional[bool] = None, cpu: Optional[CpuBf16Support] = None
) -> PrecisionChoice:
    """The precision a run on `device_type` ("cpu" / "cuda") computes in, for `requested` in PRECISIONS: `auto` is
    bf16 autocast where the device has native bf16, else fp32. `cuda_bf16` / `cpu` default to reading the machine."""
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
            "fp32" if requested == "auto" else "bf16",
            f"{'auto: fp32' if requested == 'auto' else 'precision bf16 as configured'} (device {device_type})",
        )
    cpu = cpu or cpu_bf16_support()
    native = native_cpu_bf16(cpu)
    where = _describe(cpu)
    if requested == "bf16":
        if not native:
            warnings.warn(
                f"precision bf16 on a CPU without native bf16 ({where}): oneDNN emulates it, and the default job "
                "ran 16x slower on such a CPU (docs/performance.md); `precision: auto` (or fp32) picks fp32 here",
                UserWarning,
                stacklevel=2,
            )
        return PrecisionChoice("bf16", f"precision bf16 as configured ({where}{', native bf16' if native else ''})")
    if native:
        return PrecisionChoice("bf16", f"auto: bf16 autocast, this CPU has native bf16 ({where})")
    return PrecisionChoice("fp32", f"auto: fp32, this CPU has no native bf16 ({where})")


def _describe(cpu: CpuBf16Support) -> str:
    on = (("AVX-512 BF16", cpu.avx512_bf16), ("AMX", cpu.amx), ("Arm BF16", cpu.arm_bf16))
    extras = [name for name, flag in on if flag]
    text = f"{cpu.machine} CPU, {cpu.capability} kernels" + (f", {' and '.join(extras)}" if extras else "")
    return text + (f", ONEDNN_MAX_CPU_ISA={cpu.onednn_isa_limit}" if cpu.onednn_isa_limit else "")
