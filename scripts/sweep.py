"""Train variants of one config side by side and compare them on the validation set.

How the Multi30k recipe is tuned without touching the test set: each variant is `tmt train CONFIG`
with its own `--set` overrides, several at a time (on a GPU they share it; give each a few CPU
threads), and the table ranks them by their last and best validation BLEU. A CPU hour can be stood
in for by a number of updates (`--set train.max_steps=N --set train.max_minutes=0`): the cooldown
then follows the steps instead of the clock. Each variant's validation curve is read from its
tb/ events, and how far it trained from its last checkpoint.

    python -m scripts.sweep configs/multi30k_en_de_local.yaml --out runs/sweep \\
        --set train.max_steps=5000 --set train.max_minutes=0 \\
        --variant base --variant warm1k train.warmup=1000 train.lr_factor=1.79
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from scripts.benchlib import TMT, md_table, tb_scalars


def read_run(run_dir: Path) -> dict:
    """A finished run's validation curve (step, loss, BLEU) and its last and best BLEU, from its
    tb/ events, and how far it trained, from its last checkpoint."""
    import torch

    scalars = tb_scalars(run_dir)
    loss = {e.step: round(e.value, 4) for e in scalars.get("valid/loss", [])}
    bleu = {e.step: round(e.value, 2) for e in scalars.get("valid/bleu", [])}
    curve = [(step, loss[step], bleu.get(step)) for step in sorted(loss)]
    bleus = [b for _, _, b in curve if b is not None]
    last = run_dir / "checkpoints" / "last.pt"
    state = torch.load(last, weights_only=True)["train_state"] if last.exists() else {}
    return {
        "curve": curve,
        "last_bleu": bleus[-1] if bleus else None,
        "best_bleu": max(bleus) if bleus else None,
        "last_loss": curve[-1][1] if curve else None,
        "steps": state.get("step", 0),
        "epochs": state.get("epoch"),
    }


def table(results: dict[str, dict]) -> str:
    """Markdown, best last-BLEU first."""
    ranked = sorted(results.items(), key=lambda kv: -(kv[1]["last_bleu"] or -1))
    rows = [
        (name, " ".join(r["overrides"]) or "(none)", r["steps"], r["last_bleu"], r["best_bleu"])
        + (r["last_loss"], f"{r['minutes']:.1f}")
        for name, r in ranked
    ]
    head = ["variant", "overrides", "updates", "last valid BLEU", "best valid BLEU"]
    return md_table([*head, "last valid loss", "minutes"], rows) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.sweep",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
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
        "--set", action="append", default=[], metavar="KEY=VALUE", help="for every variant"
    )
    p.add_argument(
        "--out", type=Path, required=True, help="folder: one run per variant, results.json/.md"
    )
    p.add_argument("--parallel", type=int, default=1, help="variants trained at once (default 1)")
    p.add_argument(
        "--threads", type=int, default=2, help="CPU threads of each run (OMP_NUM_THREADS; 2)"
    )
    args = p.parse_args(argv)
    names = [v[0] for v in args.variant]
    if len(set(names)) != len(names):
        p.error(f"variant names must differ: {' '.join(names)}")
    return args


def start(args: argparse.Namespace, name: str, overrides: list[str]) -> subprocess.Popen:
    """`tmt train CONFIG` with the sweep's and the variant's overrides into OUT/NAME, its output
    into OUT/NAME/train.log (for reading, not parsing)."""
    run = args.out / name
    run.mkdir(exist_ok=True)
    sets = [f"output_dir={run}", *args.set, *overrides]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "TMT_CACHE": str(run / "cache"),
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [*TMT, "train", args.config, *(a for s in sets for a in ("--set", s))]
    with open(run / "train.log", "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    pending, running, results = list(args.variant), {}, {}
    while pending or running:
        while pending and len(running) < args.parallel:
            name, *overrides = pending.pop(0)
            running[name] = (start(args, name, overrides), overrides, time.perf_counter())
        time.sleep(1)
        for name, (proc, overrides, began) in list(running.items()):
            if proc.poll() is None:
                continue
            del running[name]
            results[name] = {
                **read_run(args.out / name),
                "overrides": overrides,
                "returncode": proc.returncode,
                "minutes": (time.perf_counter() - began) / 60,
            }
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
            (args.out / "results.md").write_text(table(results))
            r = results[name]
            print(
                f"{name}: {r['steps']} updates, valid BLEU last {r['last_bleu']} best "
                f"{r['best_bleu']} (exit {proc.returncode})",
                flush=True,
            )
    print(table(results))
    return 0 if all(r["returncode"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
