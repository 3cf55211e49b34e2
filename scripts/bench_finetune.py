"""Domain adaptation, measured: a trained run (by default the Multi30k recipe's,
runs/multi30k_en_de) fine-tuned with `tmt train CONFIG --init-from PARENT` on another corpus (by
default the built-in demo grammar, generated into the work folder), scored with sacreBLEU (`tmt
evaluate --json`) before and after, on the new corpus's test set and on the parent's own (what the
new domain costs the old one). The share of <unk> pieces in the new corpus under the parent's
vocabulary is read from the training log.

The fine-tuning config is the parent's own config.yaml with data.* pointed at the new corpus,
output_dir in the work folder, the budget (--minutes, --steps), a short warm-up (--warmup) to a
lower peak learning rate (--lr), and validation every --valid-every updates on the new corpus's
valid split; --set adds overrides after these. Writes bench_finetune.json and the `finetune`
section of BENCHMARKS.md.

usage: python -m scripts.bench_finetune [--parent runs/multi30k_en_de] [--corpus DIR]
       [--minutes 10] [--steps N] [--json bench_finetune.json] [--out BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    TMT,
    cpu_model,
    logger,
    md_table,
    now,
    read_json,
    reported_flags,
    src_ref_files,
    write_json,
    write_section,
)

log = logger("bench_finetune")
DEMO_SIZES = (24000, 500, 1000)  # demo_corpus's own defaults: train, valid, test pairs
UNK = re.compile(
    r"<unk> pieces in the training corpus .*?: ([\d.]+)% of source, ([\d.]+)% of target"
)
TRAINED = re.compile(
    r"trained (\d+) steps in ([\d.]+) min; best validation ([\d.-]+) at step (\d+)"
)


def parent_config(parent: Path):
    from transformer_mt.config import load_config

    return load_config(parent / "config.yaml")


def languages(run: Path) -> tuple[str, str]:
    data = parent_config(run).data
    return data.src_lang, data.tgt_lang


def parent_test(parent: Path) -> Path:
    """The prefix of the parent's own test split (data.test in its config.yaml; relative paths start
    at the repository root, where it was trained)."""
    data = parent_config(parent).data
    if data.format != "text":
        raise SystemExit(f"{parent}: data.format {data.format!r}; give --parent-test PREFIX")
    return ROOT / data.test


def demo_corpus(out: Path, sizes: list[int]) -> Path:
    """The demo grammar's corpus, written by its own command into `out`."""
    counts = [a for flag, n in zip(("--train", "--valid", "--test"), sizes) for a in (flag, str(n))]
    cmd = [sys.executable, "-m", "transformer_mt.demo_corpus", str(out), *counts]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return out


def overrides(args: argparse.Namespace, corpus: Path, run: Path) -> list[str]:
    """The --set overrides that turn the parent's config into the fine-tuning one. The Noam
    schedule's peak learning rate is lr_factor / sqrt(d_model * warmup): lr_factor is set for
    --lr."""
    d_model = parent_config(args.parent).model.d_model
    factor = args.lr * math.sqrt(d_model * args.warmup)
    sets = [f"data.{s}={corpus / s}" for s in ("train", "valid", "test")]
    sets += ["data.format=text", f"output_dir={run}", f"train.max_minutes={args.minutes:g}"]
    sets += [f"train.warmup={args.warmup}", f"train.lr_factor={factor:.6g}"]
    sets += [f"train.valid_every={args.valid_every}"]
    if args.steps:
        sets.append(f"train.max_steps={args.steps}")
    return sets + args.set


def fine_tune(args: argparse.Namespace, corpus: Path, run: Path) -> dict:
    """`tmt train PARENT/config.yaml --init-from PARENT --set ...` in a subprocess (its output kept
    in the work folder as train.log); what it reported."""
    shutil.rmtree(run, ignore_errors=True)  # --init-from starts a new run: the folder must be free
    sets = overrides(args, corpus, run)
    cmd = [*TMT, "train", str(args.parent / "config.yaml"), "--init-from", str(args.parent)]
    cmd += [a for s in sets for a in ("--set", s)]
    log(" ".join(cmd))
    proc = subprocess.run(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    (args.workdir / "train.log").write_text(proc.stdout, encoding="utf-8")
    if proc.returncode != 0:
        raise SystemExit(f"tmt train failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}")
    trained, unk = TRAINED.search(proc.stdout), UNK.search(proc.stdout)
    parent = json.loads((run / "parent.json").read_text(encoding="utf-8"))
    return {
        "overrides": sets,
        "steps": int(trained.group(1)) if trained else None,
        "minutes": float(trained.group(2)) if trained else None,
        "best_valid": float(trained.group(3)) if trained else None,
        "valid_bleu": parent_config(run).train.valid_bleu,
        "best_step": int(trained.group(4)) if trained else None,
        "unk_src_percent": float(unk.group(1)) if unk else None,
        "unk_tgt_percent": float(unk.group(2)) if unk else None,
        "parent_step": parent.get("step"),
    }


def score(model: Path, test: Path, beam: int | None, hyp: Path) -> dict:
    """sacreBLEU of a run (or checkpoint) on a test set (PREFIX.SRC, PREFIX.TGT in the model's
    languages), by `tmt evaluate --json`; the hypotheses go to `hyp` (the parent's run folder is
    left as it is)."""
    src, ref = src_ref_files(test, *languages(model))
    cmd = [*TMT, "evaluate", "--checkpoint", str(model), "--src", str(src), "--ref", str(ref)]
    cmd += ["--output", str(hyp), "--json", *(["--beam", str(beam)] if beam else [])]
    log(" ".join(cmd))
    out = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    res = json.loads(out.stdout)
    keys = ("bleu", "chrf", "signature", "sentences", "beam", "step", "checkpoint")
    return {k: res.get(k) for k in keys}


def score_both(model: Path, name: str, args: argparse.Namespace, new_test: Path) -> dict:
    """One model on the new domain's test set and on the parent's."""
    hyp = args.workdir / f"{name}.{{}}.hyp"
    return {
        "model": name,
        "checkpoint": str(model),
        "new": score(model, new_test, args.beam, Path(str(hyp).format("new"))),
        "old": score(model, args.parent_test, args.beam, Path(str(hyp).format("old"))),
    }


def shown(path: Path) -> str:
    """A path as the report shows it: from the repository root when it is under it or beside it
    (../shared), else in full."""
    rel = os.path.relpath(path.resolve(), ROOT)
    return str(path.resolve()) if rel.startswith(f"..{os.sep}..") else rel


def signed(x: float) -> str:
    return f"{x:+.2f}"


def conclusions(res: dict) -> list[str]:
    """What the figures say, computed from them."""
    parent, tuned = res["rows"]
    new, old = res["labels"]["new"], res["labels"]["old"]
    gain = tuned["new"]["bleu"] - parent["new"]["bleu"]
    cost = tuned["old"]["bleu"] - parent["old"]["bleu"]
    t = res["train"]
    lines = [
        f"{t['steps']} fine-tuning updates in {t['minutes']} min took BLEU on {new} from "
        f"{parent['new']['bleu']} to {tuned['new']['bleu']} ({signed(gain)})."
    ]
    if cost:
        lines.append(
            f"On {old}'s test set BLEU {'fell' if cost < 0 else 'rose'} from "
            f"{parent['old']['bleu']} to {tuned['old']['bleu']} ({signed(cost)})"
            + (": what the new domain cost the old one (forgetting)." if cost < 0 else ".")
        )
    else:
        lines.append(f"On {old}'s test set BLEU stayed at {parent['old']['bleu']}.")
    if t["unk_src_percent"] is not None:
        lines.append(
            f"Under the parent's vocabulary, <unk> pieces make {t['unk_src_percent']:.2f}% of the "
            f"new training corpus's source tokens and {t['unk_tgt_percent']:.2f}% of its target "
            "tokens."
        )
    return lines


def write_report(res: dict, path: Path) -> str:
    """The `finetune` section, from the JSON alone."""
    new, old = res["labels"]["new"], res["labels"]["old"]
    rows = [
        (
            r["model"],
            r["new"]["bleu"],
            r["old"]["bleu"],
            f"`{r['new']['signature']}`",
        )
        for r in res["rows"]
    ]
    t, beam = res["train"], res["rows"][0]["new"]["beam"]
    limits = [f"{res['minutes']:g} minutes" if res["minutes"] else ""]
    limits += [f"{res['steps']} updates" if res["steps"] else ""]
    budget = " or ".join(x for x in limits if x) or "the config's max_steps"
    sets = " ".join(f"`--set {s}`" for s in t["overrides"]).replace(f"{ROOT}/", "")
    valid = "BLEU" if t.get("valid_bleu", True) else "score (minus the loss)"
    return write_section(
        path,
        "finetune",
        f"## Fine-tuning the {res['labels']['parent']} model on {new} "
        "(`scripts/bench_finetune.py`)",
        f"{res['date']}, {res['cpu']} (flags: {', '.join(res['cpu_flags'])}). Parent: "
        f"`{res['parent']}` (step {t['parent_step']}); new corpus: `{res['corpus']}` "
        f"({res['corpus_pairs']}). `tmt train {res['parent']}/config.yaml --init-from "
        f"{res['parent']}` with {sets}: a budget of {budget}; best validation {valid} "
        f"{t['best_valid']} at update {t['best_step']}. "
        f"`tmt evaluate` with beam {beam}; {old}'s test set is `{res['parent_test']}`.",
        md_table(
            ["model", f"{new} BLEU", f"{old} BLEU", "signature"],
            rows,
            "lrrl",
        ),
        "\n".join(f"- {line}" for line in conclusions(res)),
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_finetune",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--parent", type=Path, default=ROOT / "runs" / "multi30k_en_de")
    ap.add_argument("--parent-label", default="Multi30k", help="the parent's name in the report")
    ap.add_argument(
        "--parent-test", type=Path, help="the parent's test set PREFIX (default: its data.test)"
    )
    ap.add_argument(
        "--corpus",
        type=Path,
        help="the new corpus: DIR/{train,valid,test}.{src,tgt} (default: "
        "the demo grammar, generated into --workdir/data)",
    )
    ap.add_argument("--corpus-label", help="its name in the report (default: the demo grammar)")
    ap.add_argument(
        "--demo-sizes",
        type=int,
        nargs=3,
        default=list(DEMO_SIZES),
        metavar=("TRAIN", "VALID", "TEST"),
        help="pairs of the generated demo corpus",
    )
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench_finetune")
    ap.add_argument("--minutes", type=float, default=10, help="training budget (0: none)")
    ap.add_argument("--steps", type=int, default=0, help="at most this many updates (0: config's)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    ap.add_argument("--valid-every", type=int, default=250)
    ap.add_argument("--beam", type=int, help="evaluation beam (default: each run's decode.beam)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_finetune.json")
    ap.add_argument("--out", type=Path, default=BENCHMARKS)
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    return ap.parse_args(argv)


def measure(args: argparse.Namespace) -> dict:
    args.parent = args.parent.resolve()
    args.parent_test = args.parent_test or parent_test(args.parent)
    args.workdir.mkdir(parents=True, exist_ok=True)
    corpus = (args.corpus or demo_corpus(args.workdir / "data", args.demo_sizes)).resolve()
    new_test = corpus / "test"
    run = (args.workdir / "run").resolve()
    before = score_both(args.parent, "parent", args, new_test)
    train = fine_tune(args, corpus, run)
    after = score_both(run, "fine-tuned", args, new_test)
    with open(corpus / f"train.{languages(args.parent)[0]}", encoding="utf-8") as f:
        pairs = sum(1 for _ in f)
    return {
        "date": now(),
        "cpu": cpu_model(),
        "cpu_flags": reported_flags(),
        "parent": shown(args.parent),
        "parent_test": shown(args.parent_test),
        "corpus": shown(corpus),
        "corpus_pairs": f"{pairs:,} training pairs",
        "labels": {
            "parent": args.parent_label,
            "old": args.parent_label,
            "new": args.corpus_label
            or ("the demo grammar" if args.corpus is None else corpus.name),
        },
        "minutes": args.minutes,
        "steps": args.steps,
        "train": train,
        "rows": [before, after],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_report(read_json(args.json), args.out)
        return 0
    res = measure(args)
    write_json(args.json, res)
    print(write_report(res, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
