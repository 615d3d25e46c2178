"""Benchmarks and profiles behind the `dspark` subcommands; each writes a JSON under results/."""

from __future__ import annotations

import platform
from pathlib import Path

from dspark.runtime.linear import cpu_flags

# the instruction sets that decide what a bf16 / fp32 CPU matmul costs (each kind of CPU gets
# its own SPS table, `linear.cpu_kind`: README, "The SPS table the scheduler uses")
MATMUL_FLAGS = ("amx_bf16", "avx512_bf16", "avx512f", "avx2")


def cpu_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU a measurement ran on, e.g. 'AMD EPYC (x86_64: avx512_bf16 avx512f avx2)': the
    model name and the matmul instruction sets present, read from /proc/cpuinfo where there is
    one (`platform.processor()` says only 'x86_64' on Linux), else the machine type. Step costs
    measured on one CPU kind do not carry over to another, so every result records it."""
    machine = platform.machine() or "unknown"
    try:
        text = cpuinfo.read_text()
    except OSError:
        return platform.processor() or machine
    pairs = (line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in pairs}
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    flags = cpu_flags(cpuinfo)
    present = " ".join(f for f in MATMUL_FLAGS if f in flags)
    return f"{name} ({machine}: {present})" if present else f"{name} ({machine})"
