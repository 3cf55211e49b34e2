"""Train variants of one config side by side and compare them on the validation set.

How the Multi30k recipe is tuned without touching the test set: each variant is `tmt train CONFIG`
with its own `--set` overrides, several at a time (on a GPU they share it; give each a few CPU
threads), and the table ranks them by their last and best validation BLEU. A CPU hour can be stood
in for by a number of updates (`--set train.max_steps=N --set train.max_minutes=0`): the cooldown
then follows the steps instead of the clock.

    python scripts/sweep.py configs/multi30k_en_de_local.yaml --out runs/sweep \\
        --set train.max_steps=5000 --set train.max_minutes=0 \\
        --variant base --variant warm1k train.warmup=1000 train.lr_factor=1.79
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

VALID = re.compile(r"step (\d+): valid loss ([\d.]+) ppl [\d.]+ bleu ([\d.]+)")
STOPPED = re.compile(r"tmt: stopped: (.*)")


def parse_log(text: str) -> dict:
    """The validation curve, its last and best BLEU and why the run stopped, from a `tmt train`
    log."""
    curve = [(int(s), float(loss), float(bleu)) for s, loss, bleu in VALID.findall(text)]
    stopped = STOPPED.findall(text)
    return {
        "curve": curve,
        "last_bleu": curve[-1][2] if curve else None,
        "best_bleu": max(b for _, _, b in curve) if curve else None,
        "last_loss": curve[-1][1] if curve else None,
        "steps": curve[-1][0] if curve else 0,
        "stopped": stopped[-1] if stopped else None,
    }


def table(results: dict[str, dict]) -> str:
    """Markdown, best last-BLEU first."""
    rows = [
        "| variant | overrides | updates | last valid BLEU | best valid BLEU | last valid loss | "
        "minutes |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in sorted(results.items(), key=lambda kv: -(kv[1]["last_bleu"] or -1)):
        rows.append(
            f"| {name} | {' '.join(r['overrides']) or '(none)'} | {r['steps']} | {r['last_bleu']} "
            "| "
            f"{r['best_bleu']} | {r['last_loss']} | {r['minutes']:.1f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="the YAML config every variant starts from")
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        required=True,
        metavar=("NAME", "KEY=VALUE"),
        help="a variant: its name, then its overrides (repeatable)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an override for every variant",
    )
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="folder: one run per variant, results.json, results.md",
    )
    p.add_argument("--parallel", type=int, default=1, help="variants trained at once (default 1)")
    p.add_argument(
        "--threads",
        type=int,
        default=2,
        help="CPU threads of each run (OMP_NUM_THREADS; default 2)",
    )
    args = p.parse_args(argv)
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ: {' '.join(names)}")
    args.out.mkdir(parents=True, exist_ok=True)
    pending, running, results = list(args.variant), {}, {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name, *overrides = pending.pop(0)
            run = args.out / name
            run.mkdir(exist_ok=True)
            sets = [f"output_dir={run}", *args.set, *overrides]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": str(args.threads),
                "TMT_CACHE": str(run / "cache"),
                "PYTHONUNBUFFERED": "1",
            }
            log = open(run / "train.log", "w")
            cmd = [
                sys.executable,
                "-m",
                "transformer_mt",
                "train",
                args.config,
                *(a for s in sets for a in ("--set", s)),
            ]
            running[name] = (
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env),
                log,
                overrides,
                time.perf_counter(),
            )
        time.sleep(5)
        for name, (proc, log, overrides, start) in list(running.items()):
            if proc.poll() is None:
                continue
            log.close()
            del running[name]
            results[name] = {
                **parse_log((args.out / name / "train.log").read_text()),
                "overrides": overrides,
                "returncode": proc.returncode,
                "minutes": (time.perf_counter() - start) / 60,
            }
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
            (args.out / "results.md").write_text(table(results))
            print(
                f"{name}: {results[name]['steps']} updates, valid BLEU last "
                f"{results[name]['last_bleu']} "
                f"best {results[name]['best_bleu']} (exit {proc.returncode})",
                flush=True,
            )
    print(table(results))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
