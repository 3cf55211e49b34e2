"""`make bench`: what malloc keeping freed memory (runtime.keep_freed_memory) is worth to CPU
training.

The Multi30k recipe's model trains 80 updates in fp32 with glibc's malloc as it comes and with
the setting, in fresh processes (`--child`), alternating, `--rounds` times: minor page faults per
second, the kernel's share of the CPU time, and target tokens per second (medians). Writes the
`allocator` section of BENCHMARKS.md and bench_allocator.json. Needs the recipe's data and a trained
recipe run (for its spm.model: no SentencePiece training in the timed processes).

usage: python -m scripts.bench_allocator [--rounds 2] [--steps 80] [--config CONFIG --run RUN]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    cpu_model,
    json_of,
    logger,
    md_table,
    medians,
    now,
    read_json,
    write_json,
    write_section,
)

log = logger("bench-allocator")
MODES = {"default": "glibc default", "keep": "keep_freed_memory()"}


def child(mode: str, config: Path, run: Path, steps: int, overrides: list[str]) -> dict:
    """`steps` fp32 updates of the config's model on its first batches, with malloc as it comes
    ("default") or keeping freed memory ("keep"); batches are collated inside the timing, as the
    training loop does."""
    from scripts.benchlib.training import BenchData, training_step
    from transformer_mt.config import load_config
    from transformer_mt.data import collate, make_batches
    from transformer_mt.runtime import keep_freed_memory, minor_faults, set_threads
    from transformer_mt.tokenizer import Tokenizer

    if mode == "keep" and not keep_freed_memory():
        raise SystemExit("bench_allocator: keep_freed_memory() is not available here")
    cfg = load_config(config, overrides)
    set_threads(cfg.train.threads or 2)
    bench = BenchData.load(cfg, Tokenizer.load(run))
    idx, train = bench.data.train_idx, bench.data.train
    order = make_batches(
        train.src_lens[idx], train.tgt_lens[idx], cfg.train.max_tokens, seed=cfg.train.seed, epoch=1
    )[:steps]
    step = training_step(bench.model(cfg, cfg.train.seed), cfg.train, "fp32")
    f0, t0, r0 = minor_faults(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    tokens = 0
    for b in order:
        batch = collate(train, idx[b])
        step(batch)
        tokens += batch.n_tgt_tokens
    f1, t1, r1 = minor_faults(), time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    sys_s, user_s = r1.ru_stime - r0.ru_stime, r1.ru_utime - r0.ru_utime
    return {
        "faults_per_s": (f1 - f0) / (t1 - t0),
        "kernel_share": sys_s / (sys_s + user_s),
        "tok_s": tokens / (t1 - t0),
    }


def measure(args: argparse.Namespace) -> dict:
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    cmd = [sys.executable, "-m", "scripts.bench_allocator", "--steps", str(args.steps)]
    cmd += ["--config", str(args.config), "--run", str(args.run)]
    cmd += [a for o in args.set for a in ("--set", o)]
    for r in range(args.rounds):
        for mode in runs:
            log(f"round {r + 1}/{args.rounds}: {mode}")
            runs[mode].append(json_of([*cmd, "--child", mode]))
    return {
        "date": now(),
        "cpu": cpu_model(),
        "steps": args.steps,
        "runs": runs,
        "median": {m: medians(v) for m, v in runs.items()},
    }


def write_report(res: dict, path: Path) -> str:
    """The `allocator` section, from the JSON alone."""
    med = res["median"]
    speedup = med["keep"]["tok_s"] / med["default"]["tok_s"]
    rows = [
        (
            label,
            f"{m['faults_per_s']:,.0f}",
            f"{100 * m['kernel_share']:.1f}%",
            f"{m['tok_s']:,.0f}",
        )
        for m, label in ((med[k], label) for k, label in MODES.items())
    ]
    head = ["malloc", "minor page faults/s", "kernel share of CPU time", "target tok/s"]
    return write_section(
        path,
        "allocator",
        "### malloc keeping freed memory (CPU training)",
        f"`scripts/bench_allocator.py` on {res['date']}, {res['cpu']}: the recipe's model, "
        f"{res['steps']} fp32 updates per run, fresh processes, alternating, median of "
        f"{len(res['runs']['keep'])}.",
        md_table(head, rows, "lrrr"),
        f"Keeping freed memory trains {speedup:.2f}× as many target tokens per second "
        f"({'faster' if speedup > 1.02 else 'no faster'}).",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_allocator",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "multi30k_en_de_local.yaml")
    ap.add_argument("--run", type=Path, default=ROOT / "runs" / "multi30k_en_de", help="spm.model")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the config")
    ap.add_argument("--json", default=str(ROOT / "bench_allocator.json"))
    ap.add_argument("--out", default=str(BENCHMARKS))
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    ap.add_argument("--child", choices=list(MODES), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.config, args.run, args.steps, args.set)))
        return 0
    if args.report_only:
        write_report(read_json(args.json), Path(args.out))
        return 0
    if not (args.run / "spm.model").exists():
        log(f"skipped: train the recipe first ({args.run} has no spm.model)")
        return 0
    res = measure(args)
    write_json(args.json, res)
    write_report(res, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
