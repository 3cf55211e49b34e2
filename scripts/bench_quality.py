"""`make bench-quality`: the Multi30k recipe end to end, and an equal-budget comparison with
fairseq.

  recipe  tmt train configs/multi30k_en_de_local.yaml into a clean run directory, then tmt evaluate
  on
          test_2016_flickr (the recipe's beam): BLEU, chrF, TER with signatures, minutes, steps,
          tok/s.
  budget  (--budget M) ours and ../shared/peers/budget.sh fairseq M with the peers' model,
  regularisation,
          schedule and precision (BUDGET_SETTINGS): BLEU of the last and own-best checkpoints,
          beam-4 speed.
  precision  (--fp32-steps N) when the recipe trained in bf16, the recipe in fp32 for N steps:
  validation
          BLEU against the recipe run's at the same steps.

Writes the `quality` section of BENCHMARKS.md and bench_quality.json.
usage: python scripts/bench_quality.py [--recipe CONFIG] [--budget MINUTES] [--fp32-steps N]
[--skip-recipe]
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench import MULTI30K, PEERS_DIR, evaluate_test, peers_ready, run_peer  # noqa: E402
from benchlib import cpu_model, replace_section  # noqa: E402

from transformer_mt.checkpoint import step_checkpoints  # noqa: E402
from transformer_mt.fileio import atomic_write  # noqa: E402

TMT = [sys.executable, "-m", "transformer_mt"]


def log(msg: str) -> None:
    print(f"[bench-quality] {msg}", file=sys.stderr, flush=True)


# The peers' model and training (../shared/peers/common.sh), key for key: 3+3 layers, d 256, FFN
# 1024, pre-norm, all embeddings tied, dropout 0.1 on residuals, attention and activations; inverse
# sqrt to a 1e-3 peak after 200 warm-up updates, no cooldown, no clipping, 4,096-token batches, seed
# 42; fp32 (fairseq trains in fp32 on a CPU); no checkpoint averaging (fairseq has none inside the
# budget).
BUDGET_SETTINGS = [
    "model.d_model=256",
    "model.heads=4",
    "model.encoder_layers=3",
    "model.decoder_layers=3",
    "model.d_ff=1024",
    "model.norm=pre",
    "model.tie_embeddings=true",
    "model.dropout=0.1",
    "model.attention_dropout=0.1",
    "model.activation_dropout=0.1",
    "train.warmup=200",
    f"train.lr_factor={1e-3 * (256 * 200) ** 0.5}",
    "train.cooldown=0",
    "train.clip_norm=0",
    "train.max_tokens=4096",
    "train.label_smoothing=0.1",
    "train.seed=42",
    "train.precision=fp32",
    "train.average_last=0",
    "train.max_steps=100000",
]


def train_clean(
    config: str, run_dir: Path, overrides: list[str], marks: tuple[float, ...] = ()
) -> float:
    """`tmt train CONFIG` into a fresh run directory with --set overrides; returns the wall-clock
    minutes. With `marks`, the newest step checkpoint is copied as each mark (minutes from launch)
    passes (Snapshots)."""
    shutil.rmtree(ROOT / run_dir, ignore_errors=True)
    sets = [a for o in [f"output_dir={run_dir}", *overrides] for a in ("--set", o)]
    log(f"training {config} into {run_dir}")
    t0 = time.perf_counter()
    with Snapshots(ROOT / run_dir, marks):
        subprocess.run([*TMT, "-q", "train", config, *sets], cwd=ROOT, check=True)
    return round((time.perf_counter() - t0) / 60, 1)


class Snapshots:
    """While a run trains, copy its newest step checkpoint to checkpoints/at_{M}min.pt as each mark
    M (minutes from launch, set-up included, as the run's time budget counts) passes: the run keeps
    only its last few step checkpoints, and the test BLEU reached by 20 and 40 minutes is scored
    from these copies afterwards."""

    def __init__(self, run_dir: Path, marks: tuple[float, ...], poll_seconds: float = 2.0):
        self.run_dir, self.marks, self.poll = run_dir, sorted(marks), poll_seconds
        self.taken: dict[float, Path] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> "Snapshots":
        self.started = time.perf_counter()
        if self.marks:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            self.take((time.perf_counter() - self.started) / 60)

    def take(self, minutes: float) -> None:
        """Copy the newest step checkpoint for every mark passed by `minutes` and not yet taken."""
        due = [m for m in self.marks if m <= minutes and m not in self.taken]
        steps = step_checkpoints(self.run_dir) if due else []
        for mark in due if steps else ():  # nothing saved yet: try again at the next poll
            dest = self.run_dir / "checkpoints" / f"at_{mark:g}min.pt"
            with open(steps[-1], "rb") as src:
                atomic_write(dest, lambda f: shutil.copyfileobj(src, f))
            self.taken[mark] = dest


def train_and_evaluate(
    config: str, run_dir: Path, overrides: list[str], beam: int | None = None, train: bool = True
) -> dict:
    """Train from a clean run directory, then evaluate the run's best checkpoint on test_2016_flickr
    (with the run's own beam unless `beam` is given)."""
    minutes = train_clean(config, run_dir, overrides, marks=TEST_MARKS) if train else None
    flags = ["--beam", str(beam)] if beam else []
    result = evaluate_test(ROOT / run_dir, *flags)
    last = torch.load(ROOT / run_dir / "checkpoints" / "last.pt", weights_only=True)
    state = last["train_state"]
    result.update(
        train_minutes=minutes or round(state["seconds"] / 60, 1),
        steps=state["step"],
        epochs=state["epoch"],
        tgt_tok_per_s=round(state["target_tokens"] / max(state["seconds"], 1e-9)),
        evaluated=Path(result["checkpoint"]).name,
        trained_precision=state.get("precision") or "?",
        valid_bleu_by_minute=valid_bleu_by_minute(ROOT / run_dir),
        test_bleu_by_minute=test_bleu_by_minute(ROOT / run_dir, flags),
    )
    return result


# Minutes from launch at which the recipe's newest step checkpoint is kept and scored on test (the
# end is the third).
TEST_MARKS = (20.0, 40.0)


def test_bleu_by_minute(run_dir: Path, flags: list[str]) -> dict[str, dict]:
    """Test BLEU (and tokenized BLEU where the evaluation gives it) of the snapshot taken at each
    mark (the newest step checkpoint then, unaveraged), keyed by minute; the end is the run's own
    result."""
    out = {}
    for mark in TEST_MARKS:
        path = run_dir / "checkpoints" / f"at_{mark:g}min.pt"
        if path.exists():
            r = evaluate_test(path, *flags)
            out[f"{mark:g}"] = {k: r[k] for k in ("step", "bleu", "tokenized_bleu") if k in r}
    return out


def both_bleus(r: dict) -> str:
    """ "sacreBLEU / tokenized BLEU", or sacreBLEU alone when the evaluation gave no tokenized
    BLEU."""
    return f"{r['bleu']:.2f}" + (f" / {r['tokenized_bleu']:.2f}" if "tokenized_bleu" in r else "")


def valid_bleu_by_minute(run_dir: Path, marks: tuple[int, ...] = (20, 40, 60)) -> dict[str, float]:
    """The validation BLEU of the last validation at or before 20, 40 and 60 minutes of the run
    (event times from the first event, so set-up before it is not counted)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    if "valid/bleu" not in acc.Tags()["scalars"]:
        return {}
    events = acc.Scalars("valid/bleu")
    start = min(e.wall_time for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))
    out = {}
    for m in marks:
        before = [e for e in events if e.wall_time - start <= m * 60]
        if before:
            out[str(m)] = round(before[-1].value, 2)
    return out


def report(res: dict) -> str:
    lines = ["## Quality (Multi30k En→De, test_2016_flickr, 1,000 sentences)", ""]
    if "recipe" in res:
        r = res["recipe"]
        lines += [
            f"`tmt train {res['recipe_config']}` from a clean run directory on {res['date']} on "
            f"**{res.get('cpu', 'an unrecorded CPU')}** (2 cores), trained in "
            f"{r.get('trained_precision', '?')}, then "
            f"`tmt evaluate` with beam {r['beam']} on the checkpoint the recipe selected "
            f"({r['evaluated']}).",
            "",
            "| BLEU | chrF | TER | training minutes | steps | epochs | target tok/s | decode "
            "sent/s |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
            f"| {r['bleu']:.2f} | {r['chrf']:.2f} | {r['ter']:.2f} | {r['train_minutes']} | "
            f"{r['steps']:,} | "
            f"{r['epochs']} | {r['tgt_tok_per_s']:,} | {r['sentences_per_second']} |",
            "",
            f"BLEU signature: `{r['bleu_signature']}`; chrF: `{r['chrf_signature']}`; TER: "
            f"`{r['ter_signature']}`.",
            "",
        ]
        if "tokenized_bleu" in r:
            lines += [
                "Beside it, the literature's measure: **tokenized BLEU "
                f"{r['tokenized_bleu']:.2f}** (sacreBLEU "
                f"{r['bleu']:.2f}), {r['tokenized_bleu_description']}.",
                "",
            ]
        if r.get("test_bleu_by_minute"):
            lines += [
                "Test BLEU on the way (the newest step checkpoint as each mark passed, minutes "
                "from launch with "
                f"set-up, not averaged; beam {r['beam']}), as sacreBLEU / tokenized BLEU: "
                + "; ".join(
                    f"{m} min (step {v['step']:,}): {both_bleus(v)}"
                    for m, v in r["test_bleu_by_minute"].items()
                )
                + f"; the end ({r['evaluated']}, step {r['step']:,}): {both_bleus(r)}.",
                "",
            ]
        if r.get("valid_bleu_by_minute"):
            lines += [
                "Validation BLEU (greedy, whole dev set) of the last validation by each mark: "
                + "; ".join(f"{m} min: {b}" for m, b in r["valid_bleu_by_minute"].items())
                + ".",
                "",
            ]
    if "tokenization_agreement" in res:
        a = res["tokenization_agreement"]
        lines += [
            "Our tokenization of the raw German references against the official "
            "`tok/*.lc.norm.tok.de` files: "
            + "; ".join(
                f"{split} {v['same']:,} of {v['lines']:,} lines identical" for split, v in a.items()
            )
            + ".",
            "",
        ]
    if "budget" in res and "rows" not in res["budget"]:
        lines += [
            "The earlier equal-budget race trained the two toolkits with different regularisation, "
            "precision and "
            "checkpoint selection; it is not shown. `scripts/bench_quality.py --budget 20` runs it "
            "like for like.",
            "",
        ]
    elif "budget" in res:
        b = res["budget"]
        lines += [
            f"### Equal budget: {b['minutes']:g} minutes of training, the same model and "
            "regularisation",
            "",
            "Both toolkits train the peers' model and schedule (3+3 layers, d 256, FFN 1024, "
            "pre-norm, tied "
            "embeddings, dropout 0.1 on residuals, attention and activations, 200 warm-up updates "
            "to a 1e-3 "
            f"peak, seed 42) for {b['minutes']:g} minutes from launch, set-up included, one after "
            "the other on "
            f"the same machine: ours with `{' '.join(BUDGET_SETTINGS)} "
            f"train.max_minutes={b['minutes']:g}`, "
            f"fairseq with `../shared/peers/budget.sh fairseq {b['minutes']:g}`. Each is judged on "
            "its last "
            "checkpoint, and, as a second row, on the checkpoint its own selection keeps inside "
            "the budget "
            "(ours: best validation BLEU; fairseq: best validation loss). Beam 4, length penalty "
            "1.0 by each "
            "toolkit's formula (ours GNMT ((5 + |Y|) / 6)^α, fairseq |Y|^α).",
            "",
            "| toolkit | checkpoint | precision | updates | BLEU | decode sent/s | signature |",
            "| --- | --- | --- | ---: | ---: | ---: | --- |",
        ]
        for v in b["rows"]:
            lines.append(
                f"| {v['toolkit']} | {v['checkpoint']} | {v['precision']} | {v.get('steps', '?')} "
                "| "
                f"{v['bleu']} | {v['decode_sent_per_s']} | `{v['signature']}` |"
            )
        by = {(v["toolkit"], v["selection"]): v for v in b["rows"]}
        for sel in ("last", "own best"):
            ours, fs = by.get(("transformer-mt", sel)), by.get(("fairseq", sel))
            if ours and fs:
                updates = (
                    f", after {ours['steps'] / fs['steps']:.2f}× its updates in the same minutes"
                    if all(isinstance(v.get("steps"), int) for v in (ours, fs))
                    else ""
                )
                lines += [
                    "",
                    f"{sel.capitalize()} checkpoints: ours {ours['bleu'] - fs['bleu']:+.2f} BLEU "
                    "against "
                    f"fairseq{updates}; decoding "
                    f"{ours['decode_sent_per_s'] / fs['decode_sent_per_s']:.2f}× "
                    "as fast.",
                ]
        lines.append("")
    if "precision" in res and res.get("recipe", {}).get("trained_precision") == "bf16":
        p = res["precision"]
        lines += [
            "### bf16 against fp32 at equal steps (validation BLEU, greedy, whole dev set)",
            "",
            f"The recipe run (bf16) and the same recipe in fp32 for {p['steps']} steps (same seed "
            "and "
            "batches).",
            "",
            "| step | bf16 | fp32 | bf16 − fp32 |",
            "| ---: | ---: | ---: | ---: |",
        ]
        lines += [
            f"| {r['step']:,} | {r['bf16']} | {r['fp32']} | {r['diff']:+.2f} |" for r in p["rows"]
        ]
        lines.append("")
    return "\n".join(lines)


def budget_race(config: str, minutes: float) -> list[dict]:
    """Ours and fairseq with the same model, regularisation and schedule for `minutes` each
    (BUDGET_SETTINGS): rows for each toolkit's last checkpoint and the one its own selection
    keeps."""
    run_dir = Path("runs") / f"budget_{minutes:g}min"
    train_clean(config, run_dir, BUDGET_SETTINGS + [f"train.max_minutes={minutes}"])
    state = torch.load(ROOT / run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]
    rows = []
    for selection, name in (("last", "last.pt"), ("own best", "best.pt")):
        r = evaluate_test(
            ROOT / run_dir / "checkpoints" / name,
            "--beam",
            "4",
            "--alpha",
            "1.0",
            "--max-len",
            "0",
            "200",
        )
        rows.append(
            {
                "toolkit": "transformer-mt",
                "selection": selection,
                "checkpoint": name,
                "precision": state.get("precision") or "?",
                "steps": state["step"],
                "bleu": r["bleu"],
                "decode_sent_per_s": r["sentences_per_second"],
                "signature": r["bleu_signature"],
            }
        )
    if not peers_ready():
        log("fairseq skipped: the peers kit is not set up (bash ../shared/peers/setup.sh)")
        return rows
    out = run_peer("budget.sh", "fairseq", f"{minutes:g}", timeout=int(minutes * 60 + 1800))
    fs_run = PEERS_DIR / "runs" / f"fairseq_budget_{minutes:g}min"
    best = (
        run_peer(
            "decode_speed.sh", "fairseq", str(fs_run / "checkpoints" / "checkpoint_best.pt"), "64"
        )
        if out
        else None
    )
    updates = fairseq_updates(fs_run / "train.log")
    for selection, name, r in (
        ("last", "checkpoint_last.pt", out),
        ("own best", "checkpoint_best.pt", best),
    ):
        if r:
            rows.append(
                {
                    "toolkit": "fairseq",
                    "selection": selection,
                    "checkpoint": name,
                    "precision": "fp32",
                    "steps": updates,
                    "bleu": float(r["bleu"]),
                    "decode_sent_per_s": float(r["decode_sent_per_s"]),
                    "signature": r.get("signature", ""),
                }
            )
    return rows


def fairseq_updates(train_log: Path) -> int | str:
    """The last num_updates fairseq-train logged ('?' without a log)."""
    found = (
        re.findall(r"num_updates[ =](\d+)", train_log.read_text(errors="replace"))
        if train_log.exists()
        else []
    )
    return int(found[-1]) if found else "?"


def valid_bleu_by_step(run_dir: Path) -> dict[int, float]:
    """Validation BLEU at each validated step, from the run's TensorBoard events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir / "tb"))
    acc.Reload()
    if "valid/bleu" not in acc.Tags()["scalars"]:
        return {}
    return {e.step: round(e.value, 2) for e in acc.Scalars("valid/bleu")}


def precision_check(config: str, steps: int) -> dict | None:
    """The recipe in fp32 for `steps` updates beside the recipe run when it trained in bf16 (same
    seed and batches); None when it trained in fp32 (precision auto's choice on a CPU without fast
    bf16)."""
    recipe_dir = ROOT / yaml.safe_load((ROOT / config).read_text())["output_dir"]
    last = torch.load(recipe_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]
    if last.get("precision") != "bf16":
        log(
            f"precision check skipped: {recipe_dir} trained in {last.get('precision') or '?'}, not "
            "bf16"
        )
        return None
    run_dir = Path("runs") / "precision_fp32"
    train_clean(
        config,
        run_dir,
        [
            "train.precision=fp32",
            f"train.max_steps={steps}",
            "train.max_minutes=0",
            "train.average_last=0",
            "train.save_every=0",
            "train.keep_last=0",
        ],
    )
    bf16, fp32 = valid_bleu_by_step(recipe_dir), valid_bleu_by_step(ROOT / run_dir)
    rows = [
        {"step": k, "bf16": bf16[k], "fp32": fp32[k], "diff": round(bf16[k] - fp32[k], 2)}
        for k in sorted(set(bf16) & set(fp32))
    ]
    return {"steps": steps, "rows": rows}


RECIPE_KEYS = [
    ("model", "d_model"),
    ("model", "encoder_layers"),
    ("model", "d_ff"),
    ("model", "heads"),
    ("model", "dropout"),
    ("model", "norm"),
    ("tokenizer", "vocab_size"),
    ("train", "max_tokens"),
    ("train", "warmup"),
    ("train", "lr_factor"),
    ("train", "cooldown"),
    ("train", "label_smoothing"),
    ("train", "precision"),
    ("train", "max_minutes"),
    ("train", "save_every"),
    ("train", "average_last"),
    ("decode", "alpha"),
]


def record_experiment(res: dict, config: str, run_dir: Path, result: dict) -> None:
    """Append a recipe run (its settings and scores) to the history behind docs/multi30k.md."""
    cfg = yaml.safe_load((ROOT / run_dir / "config.yaml").read_text())
    entry = {
        "date": res["date"],
        "config": config,
        **{f"{a}.{b}": cfg[a].get(b, "") for a, b in RECIPE_KEYS},
        **{
            k: result.get(k, "")
            for k in (
                "bleu",
                "tokenized_bleu",
                "chrf",
                "steps",
                "train_minutes",
                "beam",
                "evaluated",
                "trained_precision",
            )
        },
        "cpu": res.get("cpu", ""),
    }
    history = [h for h in res.get("history", []) if h["date"] != entry["date"]]
    res["history"] = history + [entry]
    head = [
        "date",
        "cpu",
        *[f"{a}.{b}" for a, b in RECIPE_KEYS],
        "trained_precision",
        "steps",
        "train_minutes",
        "evaluated",
        "beam",
        "bleu",
        "tokenized_bleu",
        "chrf",
    ]
    rows = ["| " + " | ".join(h.split(".")[-1] for h in head) + " |", "|" + " --- |" * len(head)]
    rows += ["| " + " | ".join(str(e.get(h, "")) for h in head) + " |" for e in res["history"]]
    replace_section(ROOT / "docs" / "multi30k.md", "experiments", "\n".join(rows))


def tokenization_agreement() -> dict:
    """How many raw reference lines our tokenization (metrics.moses_tokenized) turns into the
    official file's line."""
    from transformer_mt.data import read_lines
    from transformer_mt.metrics import moses_tokenized

    out = {}
    for split in ("val", "test_2016_flickr"):
        ours = moses_tokenized(read_lines(MULTI30K / f"{split}.de.gz"), "de")
        official = read_lines(MULTI30K / "tok" / f"{split}.lc.norm.tok.de.gz")
        out[split] = {"lines": len(official), "same": sum(a == b for a, b in zip(ours, official))}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--recipe", default="configs/multi30k_en_de_local.yaml")
    ap.add_argument("--skip-recipe", action="store_true")
    ap.add_argument(
        "--evaluate-only", action="store_true", help="score the recipe's existing run, do not train"
    )
    ap.add_argument(
        "--budget", type=float, default=0, help="also compare with fairseq at this many minutes"
    )
    ap.add_argument(
        "--fp32-steps",
        type=int,
        default=0,
        metavar="N",
        help="also train the recipe in fp32 for N steps and compare its validation BLEU with the "
        "recipe run's (bf16) at the same steps",
    )
    ap.add_argument("--json", default=str(ROOT / "bench_quality.json"))
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite BENCHMARKS.md from an existing --json"
    )
    args = ap.parse_args()
    if args.report_only:
        replace_section(
            ROOT / "BENCHMARKS.md", "quality", report(json.loads(Path(args.json).read_text()))
        )
        return 0
    if not (MULTI30K / "train.en.gz").exists():
        log(f"skipped: {MULTI30K} is not here")
        return 0
    path = Path(args.json)
    res = json.loads(path.read_text()) if path.exists() else {}
    res["date"] = time.strftime("%Y-%m-%d %H:%M")
    res["cpu"] = cpu_model()
    res["tokenization_agreement"] = tokenization_agreement()
    if not args.skip_recipe:
        res["recipe_config"] = args.recipe
        # the user's own command
        run_dir = yaml.safe_load((ROOT / args.recipe).read_text())["output_dir"]
        res["recipe"] = train_and_evaluate(
            args.recipe, Path(run_dir), [], train=not args.evaluate_only
        )
        record_experiment(res, args.recipe, Path(run_dir), res["recipe"])
        log(f"recipe: BLEU {res['recipe']['bleu']} in {res['recipe']['train_minutes']} min")
    if args.budget:
        res["budget"] = {"minutes": args.budget, "rows": budget_race(args.recipe, args.budget)}
    if args.fp32_steps:
        res.pop("precision", None)
        if (check := precision_check(args.recipe, args.fp32_steps)) is not None:
            res["precision"] = check
    path.write_text(json.dumps(res, indent=2), encoding="utf-8")
    replace_section(ROOT / "BENCHMARKS.md", "quality", report(res))
    log("wrote BENCHMARKS.md and " + str(path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
