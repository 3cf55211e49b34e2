"""What the benchmarks share: where things are, logging, subprocesses, the CPU's description, peak
memory, and the one report helper (`md_table` + `write_section`) that every bench writes its
section of BENCHMARKS.md with. Free of torch at import: a decoding contender imports it and then
measures its own peak memory."""

from __future__ import annotations

import json
import platform
import re
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SHARED = ROOT.parent / "shared"
MULTI30K = SHARED / "data" / "multi30k"
TEST_PREFIX = MULTI30K / "test_2016_flickr"  # + .en.gz / .de.gz
PEERS_KIT = SHARED / "peers"
PEERS_DIR = ROOT / ".peers"
BENCHMARKS = ROOT / "BENCHMARKS.md"
TMT = [sys.executable, "-m", "transformer_mt"]


def logger(name: str) -> Callable[[str], None]:
    """A `log(msg)` that prints "[name] msg" to stderr at once."""

    def log(msg: str) -> None:
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)

    return log


def now() -> str:
    return time.strftime("%Y-%m-%d %H:%M")


def write_json(path: str | Path, obj: Any) -> None:
    Path(path).write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def read_json(path: str | Path) -> Any:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def medians(runs: Sequence[dict]) -> dict[str, float]:
    """The median of each numeric field over runs of the same measurement."""
    keys = [
        k for k, v in runs[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    ]
    return {k: statistics.median(r[k] for r in runs) for k in keys}


def ratio(a: float | None, b: float | None) -> str:
    """a / b as "1.23×", or "–" when either is missing."""
    return f"{a / b:.2f}×" if a and b else "–"


# --------------------------------------------------------------------------- the report helper

HEADER = (
    "# Benchmarks\n\nEvery figure here is written by `make bench` / `make bench-quality` from a "
    "run; none is typed by hand.\n"
)


def md_table(head: Sequence[str], rows: Iterable[Sequence[object]], align: str = "") -> str:
    """A markdown table; `align` has an "l" or "r" per column (left when missing)."""
    marks = [("---:" if a == "r" else "---") for a in align.ljust(len(head), "l")]
    lines = [head, marks, *([str(c) for c in row] for row in rows)]
    return "\n".join("|" + "|".join(f" {c} " if c else " " for c in cells) + "|" for cells in lines)


def write_section(path: str | Path, name: str, *blocks: str | None) -> str:
    """Put the blocks (paragraphs, tables; empty ones left out), a blank line apart, between
    <!-- name:start --> and <!-- name:end --> in `path`, keeping every other section; returns the
    section's text."""
    text = "\n\n".join(b.strip() for b in blocks if b and b.strip())
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{text}\n{end}\n"
    path = Path(path)
    doc = path.read_text(encoding="utf-8") if path.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end) + r"\n?", re.S)
    if pattern.search(doc):
        doc = pattern.sub(lambda _: block, doc)
    else:
        doc = doc.rstrip() + "\n\n" + block
    path.write_text(doc, encoding="utf-8")
    return text


# --------------------------------------------------------------------------- the machine

# What approximates an AVX2-only CPU (an AMD EPYC without AVX-512) on a bigger one: torch's own
# kernels, oneDNN's and MKL's capped at AVX2.
AVX2_ONLY = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}


def avx2_description() -> str:
    """How a report names the approximation."""
    return "AVX2 kernels only (" + ", ".join(f"{k}={v}" for k, v in AVX2_ONLY.items()) + ")"


# The flags a report names: what decides which kernels run (AVX2, AVX-512, bf16 in hardware).
REPORTED_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16")


def reported_flags() -> list[str]:
    """This CPU's flags among REPORTED_FLAGS (runtime.cpu_flags reads /proc/cpuinfo)."""
    from transformer_mt.runtime import cpu_flags

    flags = cpu_flags()
    return [f for f in REPORTED_FLAGS if f in flags]


def cpu_bf16() -> str:
    """What runs bf16 matrix products on this CPU: "AMX", "AVX512-BF16" or "none"."""
    from transformer_mt.runtime import cpu_flags

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


def peak_rss_mb() -> float:
    """This process's own peak resident set, MiB: VmHWM of /proc/self/status. Not ru_maxrss: Linux
    carries the peak of the process that forked this one across exec into it, so every child of a
    10 GB bench reported 10 GB. Elsewhere ru_maxrss is the best there is."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB elsewhere


# --------------------------------------------------------------------------- subprocesses


def json_of(cmd: Sequence[str], **kwargs: Any) -> dict:
    """Run a command that prints a JSON object as its last line (from the repository root); that
    object. Raises CalledProcessError, with the stderr, when it fails."""
    out = subprocess.run(list(cmd), cwd=ROOT, check=True, capture_output=True, text=True, **kwargs)
    return json.loads(out.stdout.strip().splitlines()[-1])


def src_ref_files(
    prefix: str | Path, src_lang: str = "en", tgt_lang: str = "de"
) -> tuple[Path, Path]:
    """The source and reference files of a test set: PREFIX.LANG or PREFIX.LANG.gz."""
    from transformer_mt.data import text_file

    return text_file(str(prefix), src_lang), text_file(str(prefix), tgt_lang)


def run_test_source(run_dir: Path) -> Path:
    """The source side of a run's test split (data.test in its config.yaml; relative paths start at
    the repository root, where `tmt train` ran)."""
    from transformer_mt.config import load_config
    from transformer_mt.data import text_file

    data = load_config(Path(run_dir) / "config.yaml").data
    return text_file(str(ROOT / data.test), data.src_lang)


def evaluate_checkpoint(
    checkpoint: Path | list[Path], *flags: str, test: str | Path = TEST_PREFIX
) -> dict:
    """`tmt evaluate --json` of a checkpoint (or run directory; a list of them: an ensemble) on a
    test set (test_2016_flickr unless `test` names another prefix), with extra flags."""
    src, ref = src_ref_files(test)
    paths = checkpoint if isinstance(checkpoint, list) else [checkpoint]
    cmd = [*TMT, "evaluate", *(a for p in paths for a in ("--checkpoint", str(p)))]
    cmd += ["--src", str(src), "--ref", str(ref)]
    out = subprocess.run(
        [*cmd, "--json", *flags], cwd=ROOT, check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


def run_peer(script: str, *args: str, timeout: int = 1800) -> dict[str, str] | None:
    """Run one of the peers kit's scripts from the project root; its RESULT line as a dict (None,
    with a message, when it fails)."""
    log = logger("peers")
    cmd = ["bash", str(PEERS_KIT / script), *args]
    log(" ".join(cmd))
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{script} timed out")
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        log(f"{script} failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
        return None
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def peers_ready() -> bool:
    """The peers kit is here and set up (`bash ../shared/peers/setup.sh`)."""
    return PEERS_KIT.is_dir() and (PEERS_DIR / "data" / ".prepared").exists()


# --------------------------------------------------------------------------- a run's event log


def tb_scalars(run_dir: str | Path) -> dict[str, list[Any]]:
    """Every TensorBoard scalar a run logged in its tb/, by tag: events (step, wall_time, value),
    oldest first; {} without an event log."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = Path(run_dir) / "tb"
    if not tb.is_dir():
        return {}
    acc = EventAccumulator(str(tb))
    acc.Reload()
    return {tag: list(acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
