"""`make bench`: what malloc keeping freed memory (runtime.keep_freed_memory) is worth to CPU
training.

The Multi30k recipe's model trains 80 updates in fp32 with glibc's default malloc and with the
setting, in fresh processes, alternating, `--rounds` times: minor page faults per second, the
kernel's share of the CPU time, and target tokens per second (medians). Writes the `allocator`
section of BENCHMARKS.md and bench_allocator.json. Needs ../shared/data/multi30k and a trained
recipe run (for its spm.model).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import cpu_model, replace_section  # noqa: E402

RECIPE, RUN = "configs/multi30k_en_de_local.yaml", ROOT / "runs" / "multi30k_en_de"


def child(mode: str, steps: int) -> dict:
    import transformer_mt.train as T
    from transformer_mt.config import load_config
    from transformer_mt.runtime import minor_faults

    if mode == "default":
        T.keep_freed_memory = lambda: False  # glibc as it comes
    out = Path(tempfile.mkdtemp(prefix=f"alloc_{mode}_"))
    # the same tokenizer: no SentencePiece training
    shutil.copy(RUN / "spm.model", out / "spm.model")
    cfg = load_config(
        ROOT / RECIPE,
        [
            f"output_dir={out}",
            f"train.max_steps={steps}",
            "train.valid_every=100000",
            "train.save_every=0",
            "train.average_last=0",
            "train.precision=fp32",
            "train.valid_bleu=false",
            "train.max_minutes=0",
        ],
    )
    trainer = T.Trainer(cfg)
    f0, t0, r0 = minor_faults(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    trainer.train()
    f1, t1, r1 = minor_faults(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    shutil.rmtree(out, ignore_errors=True)
    sys_s, user_s = r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime
    return {
        "faults_per_s": (f1 - f0) / (t1 - t0),
        "kernel_share": sys_s / (sys_s + user_s),
        "tok_s": trainer.state.target_tokens / (t1 - t0),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--child", choices=["default", "keep"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.steps)))
        return 0
    if not (RUN / "spm.model").exists():
        print(
            f"[bench-allocator] skipped: train the recipe first ({RUN} has no spm.model)",
            file=sys.stderr,
        )
        return 0
    runs: dict[str, list[dict]] = {"default": [], "keep": []}
    for r in range(args.rounds):
        for mode in runs:
            print(
                f"[bench-allocator] round {r + 1}/{args.rounds}: {mode}",
                file=sys.stderr,
                flush=True,
            )
            out = subprocess.run(
                [sys.executable, __file__, "--child", mode, "--steps", str(args.steps)],
                cwd=ROOT,
                check=True,
                capture_output=True,
                text=True,
            )
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    med = {m: {k: statistics.median(x[k] for x in v) for k in v[0]} for m, v in runs.items()}
    res = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),
        "steps": args.steps,
        "runs": runs,
        "median": med,
    }
    (ROOT / "bench_allocator.json").write_text(json.dumps(res, indent=2), encoding="utf-8")
    speedup = med["keep"]["tok_s"] / med["default"]["tok_s"]
    lines = [
        "### malloc keeping freed memory (CPU training)",
        "",
        f"`scripts/bench_allocator.py` on {res['date']}, {res['cpu']}: the recipe's model, "
        f"{args.steps} fp32 "
        f"updates per run, fresh processes, alternating, median of {args.rounds}.",
        "",
        "| malloc | minor page faults/s | kernel share of CPU time | target tok/s |",
        "| --- | ---: | ---: | ---: |",
    ]
    for mode, label in (("default", "glibc default"), ("keep", "keep_freed_memory()")):
        m = med[mode]
        lines.append(
            f"| {label} | {m['faults_per_s']:,.0f} | {100 * m['kernel_share']:.1f}% | "
            f"{m['tok_s']:,.0f} |"
        )
    lines += [
        "",
        f"Keeping freed memory trains {speedup:.2f}× as many target tokens per second "
        f"({'faster' if speedup > 1.02 else 'no faster'}).",
        "",
    ]
    replace_section(ROOT / "BENCHMARKS.md", "allocator", "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
