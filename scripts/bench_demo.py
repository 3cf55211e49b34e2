"""The README's first command, timed: `make demo` in a fresh clone of this repository's HEAD (a new
.venv, the pip cache as this machine has it), and what it printed: test BLEU and the five sample
translations.

A sample counts as complete when it has as many words as its reference in configs/demo_samples.de
(written by hand from the demo grammar): a dropped or an added word changes the count. With --avx2
the run is told to use AVX2 kernels only (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
MKL_ENABLE_INSTRUCTIONS), which approximates an AVX2-only CPU such as an AMD EPYC without AVX-512,
where bf16 is emulated. Writes bench_demo.json and its section of BENCHMARKS.md, and prints whether
the targets hold (BLEU >= 90, <= 5 minutes, 5 of 5 complete).

usage: python -m scripts.bench_demo [--avx2] [--json bench_demo.json] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.benchlib import (
    AVX2_ONLY,
    BENCHMARKS,
    ROOT,
    avx2_description,
    cpu_bf16,
    cpu_model,
    md_table,
    now,
    read_json,
    reported_flags,
    write_json,
    write_section,
)

TARGETS = {"bleu": 90.0, "seconds": 300.0, "complete": 5}


def run_demo(avx2: bool, command: str = "make demo") -> tuple[float, str, int]:
    """`make demo` (or another shell command) in a fresh clone of HEAD: wall-clock seconds,
    everything it printed, and its exit status."""
    env = {**os.environ, **(AVX2_ONLY if avx2 else {})}
    with tempfile.TemporaryDirectory(prefix="tmt-demo-") as tmp:
        clone = Path(tmp) / "transformer-mt"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        start = time.perf_counter()
        proc = subprocess.run(
            ["bash", "-c", command], cwd=clone, env=env, capture_output=True, text=True
        )
        return time.perf_counter() - start, proc.stdout + proc.stderr, proc.returncode


def parse_output(text: str) -> dict:
    """sacreBLEU and its signature, the samples (the lines `make demo` prints after "  -> "), the
    precision the run trained in and the updates it made."""
    bleu = re.search(r"^BLEU\|(\S+) = ([\d.]+)", text, re.M)
    trained = re.search(r"trained (\d+) steps in ([\d.]+) min", text)
    precision = re.search(r"precision auto: .*?training in (\S+)", text)
    return {
        "bleu": float(bleu.group(2)) if bleu else None,
        "signature": f"BLEU|{bleu.group(1)}" if bleu else None,
        "samples": [line[len("  -> ") :] for line in text.splitlines() if line.startswith("  -> ")],
        "updates": int(trained.group(1)) if trained else None,
        "train_minutes": float(trained.group(2)) if trained else None,
        "precision_line": precision.group(0) if precision else None,
    }


def judge_samples(samples: list[str], references: list[str]) -> list[dict]:
    """Each sample beside its reference: complete (as many words) and exact."""
    return [
        {
            "output": out,
            "reference": ref,
            "complete": len(out.split()) == len(ref.split()),
            "exact": out == ref,
        }
        for out, ref in zip(samples, references)
    ]


def verdict(res: dict) -> dict[str, bool]:
    complete = sum(s["complete"] for s in res["samples"])
    return {
        f"test BLEU >= {TARGETS['bleu']:g}": res["bleu"] is not None
        and res["bleu"] >= TARGETS["bleu"],
        f"make demo <= {TARGETS['seconds'] / 60:g} minutes": res["seconds"] <= TARGETS["seconds"],
        f"{TARGETS['complete']} of 5 samples complete": complete >= TARGETS["complete"]
        and len(res["samples"]) == 5,
    }


def write_report(res: dict, path: Path) -> str:
    """The `demo` (or `demo-avx2`) section, from the JSON alone."""
    rows = [
        (x["output"], x["reference"], "yes" if x["complete"] else "**no**")
        + ("yes" if x["exact"] else "no",)
        for x in res["samples"]
    ]
    met = "; ".join(
        f"{t}: {'met' if ok else '**not met**'}" for t, ok in res["targets_met"].items()
    )
    kernels = avx2_description() if res["avx2"] else "the CPU's own kernels"
    command = res.get("command", "make demo")
    venv = "; a new .venv from the pip cache" if command == "make demo" else ""
    return write_section(
        path,
        "demo-avx2" if res["avx2"] else "demo",
        "## `make demo` from a fresh clone (`scripts/bench_demo.py`)",
        f"{res['date']}, {res['cpu']} (flags: {', '.join(res['cpu_flags'])}; bf16 in hardware: "
        f"{res['cpu_bf16']}), with {kernels}{venv}. `{command}` took **{res['seconds']:.0f} s** "
        f"(exit status {res['exit_status']}); training made {res['updates']} updates in "
        f"{res['train_minutes']} min. {res['precision_line'] or ''}",
        f"Test BLEU **{res['bleu']}** (`{res['signature']}`).",
        md_table(["sample translation", "reference", "complete", "exact"], rows),
        f"Targets: {met}.",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench_demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--avx2", action="store_true", help="AVX2 kernels only: approximate an AVX2-only CPU"
    )
    parser.add_argument(
        "--command",
        default="make demo",
        help="the shell command to time in the clone (default: make demo)",
    )
    parser.add_argument(
        "--json", default=None, help="default: bench_demo.json (bench_demo_avx2.json with --avx2)"
    )
    parser.add_argument("--out", default=str(BENCHMARKS))
    parser.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    args = parser.parse_args(argv)
    json_path = Path(args.json or ROOT / f"bench_demo{'_avx2' if args.avx2 else ''}.json")
    if args.report_only:
        write_report(read_json(json_path), Path(args.out))
        return 0
    seconds, text, status = run_demo(args.avx2, args.command)
    references = (ROOT / "configs" / "demo_samples.de").read_text(encoding="utf-8").splitlines()
    parsed = parse_output(text)
    res = {
        "date": now(),
        "cpu": cpu_model(),
        "cpu_flags": reported_flags(),
        "cpu_bf16": cpu_bf16(),
        "avx2": args.avx2,
        "command": args.command,
        "seconds": round(seconds, 1),
        "exit_status": status,
        **parsed,
        "samples": judge_samples(parsed["samples"], references),
    }
    res["targets_met"] = verdict(res)
    write_json(json_path, res)
    write_report(res, Path(args.out))
    if status != 0:
        print(text[-3000:], file=sys.stderr)
    for target, ok in res["targets_met"].items():
        print(f"[bench_demo] {target}: {'met' if ok else 'NOT met'}")
    return 0 if status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
