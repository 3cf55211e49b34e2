"""Shared by the bench scripts: BENCHMARKS.md is assembled from sections that each script owns."""

from __future__ import annotations

import platform
import re
import subprocess
from pathlib import Path

from transformer_mt.runtime import cpu_flags

HEADER = "# Benchmarks\n\nEvery figure here is written by `make bench` / `make bench-quality` from a run; none is typed by hand.\n"


def replace_section(path: Path, name: str, text: str) -> None:
    """Put `text` between <!-- name:start --> and <!-- name:end --> in `path`, keeping other
    sections."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text.strip()}\n{end}\n"
    doc = path.read_text(encoding="utf-8") if path.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    doc = (
        pattern.sub(lambda _: block, doc) if pattern.search(doc) else doc.rstrip() + "\n\n" + block
    )
    path.write_text(doc, encoding="utf-8")


# The flags a report names: what decides which kernels run (AVX2, AVX-512, bf16 in hardware).
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def reported_flags() -> list[str]:
    """This CPU's flags among REPORTED_FLAGS, from /proc/cpuinfo (runtime.cpu_flags)."""
    flags = cpu_flags()
    return [f for f in REPORTED_FLAGS if f in flags]


def cpu_bf16() -> str:
    """What runs bf16 matrix products on this CPU, from /proc/cpuinfo's flags: "AMX", "AVX512-BF16"
    or "none"."""
    flags = cpu_flags()
    return "AMX" if "amx_bf16" in flags else "AVX512-BF16" if "avx512_bf16" in flags else "none"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except (OSError, StopIteration):
        return platform.processor() or "unknown CPU"
