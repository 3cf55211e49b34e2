"""`make bench-quality`: the Multi30k recipe end to end, and an equal-budget comparison with
fairseq, into the `quality` section of BENCHMARKS.md and bench_quality.json.

  recipe     `tmt train configs/multi30k_en_de_local.yaml` into a clean run directory, then `tmt
             evaluate` on test_2016_flickr (the recipe's beam): BLEU, chrF, TER with signatures,
             minutes, steps, tok/s; the run's settings and scores go to docs/multi30k.md.
  budget     (--budget M) ours and `../shared/peers/budget.sh fairseq M` with the peers' model,
             regularisation, schedule and precision (BUDGET_SETTINGS): BLEU of the last and
             own-best checkpoints, beam-4 speed.
  precision  (--fp32-steps N) when the recipe trained in bf16, the recipe in fp32 for N steps:
             validation BLEU against the recipe run's at the same steps.

  --variant  the recipe with --set changes, as an experiment: recorded in the history (its own
             run directory, …_variant), the quality section's recipe row left as it is.
  --avx2     the recipe with AVX2 kernels only (benchlib.AVX2_ONLY), approximating an AVX2-only
             CPU on a bigger one: the section's second row, its own run directory (…_avx2).

usage: python -m scripts.bench_quality [--recipe CONFIG] [--budget MINUTES] [--fp32-steps N]
       [--avx2] [--variant] [--skip-recipe] [--report-only]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from scripts.benchlib import (
    AVX2_ONLY,
    BENCHMARKS,
    MULTI30K,
    PEERS_DIR,
    ROOT,
    TEST_PREFIX,
    TMT,
    avx2_description,
    cpu_model,
    evaluate_checkpoint,
    logger,
    md_table,
    now,
    peers_ready,
    read_json,
    reported_flags,
    run_peer,
    src_ref_files,
    tb_scalars,
    write_json,
    write_section,
)
from transformer_mt.checkpoint import ensemble_members, step_checkpoints
from transformer_mt.config import load_config
from transformer_mt.data import DataError
from transformer_mt.fileio import atomic_write

log = logger("bench-quality")

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
# Minutes from launch at which the recipe's newest step checkpoint is kept and scored on test (the
# end is the third).
TEST_MARKS = (20.0, 40.0)


def train_clean(
    config: str, run_dir: Path, overrides: list[str], marks: tuple[float, ...] = ()
) -> float:
    """`tmt train CONFIG` into a fresh run directory with --set overrides; the wall-clock minutes.
    With `marks`, the newest step checkpoint is copied as each mark (minutes from launch) passes."""
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [a for o in [f"output_dir={run_dir}", *overrides] for a in ("--set", o)]
    log(f"training {config} into {run_dir}")
    t0 = time.perf_counter()
    with Snapshots(run_dir, marks):
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

    def __enter__(self) -> Snapshots:
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
        """Copy the newest step checkpoint for every mark passed by `minutes` and not yet taken (of
        every member, in an ensemble run)."""
        due = [m for m in self.marks if m <= minutes and m not in self.taken]
        newest = [step_checkpoints(d)[-1:] for d in model_dirs(self.run_dir)] if due else []
        for mark in due if newest and all(newest) else ():  # nothing saved yet: the next poll
            try:
                for (path,) in newest:
                    with open(path, "rb") as src:
                        dest = path.parent / f"at_{mark:g}min.pt"
                        atomic_write(dest, lambda f: shutil.copyfileobj(src, f))
            except FileNotFoundError:  # rotated away since it was listed: the next poll
                return
            self.taken[mark] = newest[0][0].parent / f"at_{mark:g}min.pt"


def model_dirs(run_dir: Path) -> list[Path]:
    """The run directories of the run's models: its members' for an ensemble, else its own."""
    return ensemble_members(run_dir) or [run_dir]


def train_state(run_dir: Path) -> dict:
    """The loop's state in the run's last checkpoint: steps, epochs, seconds, precision."""
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["train_state"]


def train_and_evaluate(
    config: str, run_dir: Path, overrides: list[str], test: Path, train: bool = True
) -> dict:
    """Train from a clean run directory (unless `train` is false), then evaluate the run's best
    checkpoint on the test set with the run's own beam."""
    minutes = train_clean(config, run_dir, overrides, marks=TEST_MARKS) if train else None
    result = evaluate_checkpoint(run_dir, test=test)
    # an ensemble's: every model's updates and tokens, side by side in the same seconds
    states = [train_state(d) for d in model_dirs(run_dir)]
    seconds = max(s["seconds"] for s in states)
    # evaluate's list of an ensemble's checkpoints; "ensemble" becomes their count below
    evaluated = [Path(p) for p in result.pop("ensemble", [result["checkpoint"]])]
    result.update(
        train_minutes=minutes or round(seconds / 60, 1),
        steps=sum(s["step"] for s in states),
        epochs=max(s["epoch"] for s in states),
        tgt_tok_per_s=round(sum(s["target_tokens"] for s in states) / max(seconds, 1e-9)),
        evaluated=" + ".join(
            f"{p.parent.parent.name}/{p.name}" if len(evaluated) > 1 else p.name for p in evaluated
        ),
        trained_precision=states[0].get("precision") or "?",
        trained_attention=states[0].get("attention") or "?",
        # precision auto's ms a step for each precision it timed at start-up ({}: not measured)
        precision_probe_ms=states[0].get("precision_probe_ms") or {},
        valid_bleu_by_minute=valid_bleu_by_minute(run_dir),
        test_bleu_by_minute=test_bleu_by_minute(run_dir, test),
    )
    if len(states) > 1:  # an ensemble: each member's steps, the ensemble's validation (tmt train's)
        result.update(
            ensemble=len(states),
            member_steps=[s["step"] for s in states],
            ensemble_valid_bleu=read_json(run_dir / "ensemble.json").get("valid_bleu"),
        )
    return result


def test_bleu_by_minute(run_dir: Path, test: Path) -> dict[str, dict]:
    """Test BLEU (and tokenized BLEU where the evaluation gives it) of the snapshot taken at each
    mark (the newest step checkpoint then, unaveraged), keyed by minute."""
    out = {}
    for mark in TEST_MARKS:
        paths = [d / "checkpoints" / f"at_{mark:g}min.pt" for d in model_dirs(run_dir)]
        if all(p.exists() for p in paths):
            r = evaluate_checkpoint(paths, test=test)
            out[f"{mark:g}"] = {k: r[k] for k in ("step", "bleu", "tokenized_bleu") if k in r}
            if len(paths) > 1:  # an ensemble: every member's step
                out[f"{mark:g}"]["step"] = [torch.load(p, weights_only=True)["step"] for p in paths]
    return out


def valid_bleu_by_minute(
    run_dir: Path, marks: tuple[int, ...] = (20, 40, 60)
) -> dict[str, float | str]:
    """The validation BLEU of the last validation at or before each mark, in minutes from the run's
    first event (set-up before it is not counted), from its tb/ events; an ensemble's members',
    as "a / b"."""
    members = ensemble_members(run_dir)
    if members:
        each = [valid_bleu_by_minute(d, marks) for d in members]
        common = [str(m) for m in marks if all(str(m) in e for e in each)]
        return {m: " / ".join(f"{e[m]:.2f}" for e in each) for m in common}
    scalars = tb_scalars(run_dir)
    events = scalars.get("valid/bleu", [])
    if not events:
        return {}
    start = min(e.wall_time for tag in scalars.values() for e in tag)
    out = {}
    for m in marks:
        before = [e for e in events if e.wall_time - start <= m * 60]
        if before:
            out[str(m)] = round(before[-1].value, 2)
    return out


def valid_bleu_by_step(run_dir: Path) -> dict[int, float]:
    """Validation BLEU at each validated step, from the run's tb/ events."""
    return {e.step: round(e.value, 2) for e in tb_scalars(run_dir).get("valid/bleu", [])}


def budget_race(
    config: str, minutes: float, run_dir: Path, extra: list[str], test: Path
) -> list[dict]:
    """Ours and fairseq with the same model, regularisation and schedule for `minutes` each
    (BUDGET_SETTINGS): rows for each toolkit's last checkpoint and the one its own selection
    keeps."""
    one = "train.ensemble=1"  # fairseq trains one model, whatever the recipe or --set say
    train_clean(config, run_dir, [*BUDGET_SETTINGS, f"train.max_minutes={minutes}", *extra, one])
    state = train_state(run_dir)
    rows = []
    for selection, name in (("last", "last.pt"), ("own best", "best.pt")):
        flags = ("--beam", "4", "--alpha", "1.0", "--max-len", "0", "200")
        r = evaluate_checkpoint(run_dir / "checkpoints" / name, *flags, test=test)
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
    return rows + fairseq_budget(minutes)


def fairseq_budget(minutes: float) -> list[dict]:
    """fairseq's rows of the budget race: trained by the peers kit for `minutes`, its last and its
    own best checkpoint decoded."""
    out = run_peer("budget.sh", "fairseq", f"{minutes:g}", timeout=int(minutes * 60 + 1800))
    fs_run = PEERS_DIR / "runs" / f"fairseq_budget_{minutes:g}min"
    best_ckpt = str(fs_run / "checkpoints" / "checkpoint_best.pt")
    best = run_peer("decode_speed.sh", "fairseq", best_ckpt, "64") if out else None
    updates = fairseq_updates(fs_run / "train.log")
    return [
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
        for selection, name, r in (
            ("last", "checkpoint_last.pt", out),
            ("own best", "checkpoint_best.pt", best),
        )
        if r
    ]


def fairseq_updates(train_log: Path) -> int | str:
    """The last num_updates fairseq-train logged ('?' without a log)."""
    text = train_log.read_text(errors="replace") if train_log.exists() else ""
    found = re.findall(r"num_updates[ =](\d+)", text)
    return int(found[-1]) if found else "?"


def precision_check(
    config: str, recipe_dir: Path, steps: int, run_dir: Path, extra: list[str]
) -> dict | None:
    """The recipe in fp32 for `steps` updates beside the recipe run when it trained in bf16 (same
    seed and batches); None when it trained in fp32 (precision auto's choice on a CPU without fast
    bf16)."""
    precision = train_state(model_dirs(recipe_dir)[0]).get("precision") or "?"
    if precision != "bf16":
        log(f"precision check skipped: {recipe_dir} trained in {precision}, not bf16")
        return None
    fp32 = ["train.precision=fp32", f"train.max_steps={steps}", "train.max_minutes=0"]
    fp32 += ["train.average_last=0", "train.save_every=0", "train.keep_last=0", "train.ensemble=1"]
    train_clean(config, run_dir, [*extra, *fp32])
    bf16 = valid_bleu_by_step(model_dirs(recipe_dir)[0])  # an ensemble's first member: same seed
    fp32_bleu = valid_bleu_by_step(run_dir)
    rows = [
        {"step": k, "bf16": bf16[k], "fp32": fp32_bleu[k], "diff": round(bf16[k] - fp32_bleu[k], 2)}
        for k in sorted(set(bf16) & set(fp32_bleu))
    ]
    return {"steps": steps, "rows": rows}


RECIPE_KEYS = [
    ("data", "subword_sampling"),
    ("model", "d_model"),
    ("model", "encoder_layers"),
    ("model", "decoder_layers"),
    ("model", "d_ff"),
    ("model", "heads"),
    ("model", "dropout"),
    ("model", "norm"),
    ("model", "norm_type"),
    ("tokenizer", "vocab_size"),
    ("train", "max_tokens"),
    ("train", "warmup"),
    ("train", "warmup_share"),
    ("train", "lr_factor"),
    ("train", "cooldown"),
    ("train", "label_smoothing"),
    ("train", "word_dropout"),
    ("train", "r_drop"),
    ("train", "bidirectional_epochs"),
    ("train", "ensemble"),
    ("train", "precision"),
    ("train", "max_minutes"),
    ("train", "max_steps"),
    ("train", "save_every"),
    ("train", "average_last"),
    ("decode", "alpha"),
]
SCORE_KEYS = ["bleu", "tokenized_bleu", "chrf"]
RESULT_KEYS = [
    "trained_precision",
    "trained_attention",
    "steps",
    "train_minutes",
    "evaluated",
    "beam",
    *SCORE_KEYS,
]


def setting(value: object) -> object:
    """A config value as the history table shows it: subword sampling in a few words."""
    if isinstance(value, dict) and "nbest" in value:
        return f"{value['nbest']}-best, α {value['alpha']:g}" if value["nbest"] else "off"
    return value


def recipe_settings(cfg: dict) -> dict[str, object]:
    """A config's RECIPE_KEYS (config.yaml's nesting) as the history table shows them."""
    return {f"{a}.{b}": setting(cfg[a].get(b, "")) for a, b in RECIPE_KEYS}


def changed_settings(res: dict, r: dict) -> list[str]:
    """ "`key` then (now …)" for each recipe setting of run r (its history entry) that its config
    file no longer has, leaving out the keys its --set changes name; [] when either is missing."""
    config = ROOT / r.get("config", res.get("recipe_config", ""))
    then = next((h for h in res.get("history", []) if h["date"] == r.get("date")), None)
    if then is None or not config.is_file():
        return []
    now = recipe_settings(load_config(config).to_dict())
    changed = [c.split("=")[0] for c in r.get("changes", "").split()]
    return [
        f"`{k}` {then[k]} (now {v})"
        for k, v in now.items()
        if k in then and then[k] != v and not any(c == k or c.startswith(k + ".") for c in changed)
    ]


def record_experiment(res: dict, key: str, config: str, run_dir: Path, history: Path) -> None:
    """Append the recipe run res[key] (its settings and scores) to res["history"] and write the
    history table into `history` (docs/multi30k.md's `experiments` section)."""
    cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
    run = res[key]
    entry = {
        "date": res["date"],
        "config": config,
        "cpu": res.get("cpu", "") + (" (AVX2 kernels)" if run.get("avx2") else ""),
        "changes": run.get("changes", ""),
        **recipe_settings(cfg),
        **{k: run.get(k, "") for k in RESULT_KEYS},
    }
    res["history"] = [h for h in res.get("history", []) if h["date"] != entry["date"]] + [entry]
    write_history(res, history)


def score_cell(key: str, value: object) -> object:
    """A score as the metrics print it, two decimals (the JSON's 39.8 is sacreBLEU's 39.80), so
    the table's column reads alike; other cells as they are."""
    return f"{value:.2f}" if key in SCORE_KEYS and isinstance(value, float) else value


def write_history(res: dict, history: Path) -> None:
    """res["history"] as the table of docs/multi30k.md's `experiments` section."""
    head = ["date", "cpu", "changes", *(f"{a}.{b}" for a, b in RECIPE_KEYS), *RESULT_KEYS]
    rows = [[score_cell(h, e.get(h, "")) for h in head] for e in res["history"]]
    write_section(history, "experiments", md_table([h.split(".")[-1] for h in head], rows))


def tokenization_agreement() -> dict | None:
    """How many raw reference lines our tokenization (metrics.moses_tokenized) turns into the
    official tokenized file's line; None without the official files."""
    from transformer_mt.data import read_lines
    from transformer_mt.metrics import moses_tokenized

    out = {}
    for split in ("val", "test_2016_flickr"):
        official = MULTI30K / "tok" / f"{split}.lc.norm.tok.de.gz"
        if not official.exists():
            return None
        ours = moses_tokenized(read_lines(MULTI30K / f"{split}.de.gz"), "de")
        lines = read_lines(official)
        out[split] = {"lines": len(lines), "same": sum(a == b for a, b in zip(ours, lines))}
    return out


# --------------------------------------------------------------------------- report


def both_bleus(r: dict) -> str:
    """ "sacreBLEU / tokenized BLEU", or sacreBLEU alone when the evaluation gave no tokenized
    BLEU."""
    return f"{r['bleu']:.2f}" + (f" / {r['tokenized_bleu']:.2f}" if "tokenized_bleu" in r else "")


def attention_text(r: dict) -> str:
    """ " with the math attention kernel" (train.attention auto's choice), or "" for a run from
    before the checkpoint recorded it."""
    kernel = r.get("trained_attention", "?")
    return "" if kernel == "?" else f" with the {kernel} attention kernel"


def probe_text(r: dict) -> str:
    """ " (precision auto's start-up probe, a step: 361 ms in fp32, 395 ms in bf16)", or "" for a
    run whose precision was not measured, or from before its checkpoint kept the timings."""
    ms = r.get("precision_probe_ms") or {}
    timed = ", ".join(f"{v:,.0f} ms in {p}" for p, v in ms.items())
    return f" (precision auto's start-up probe, a step: {timed})" if timed else ""


def steps_text(step: int | list[int]) -> str:
    """ "step 1,234", or an ensemble's "steps 1,234 and 1,230" (one a member)."""
    if isinstance(step, list):
        return "steps " + " and ".join(f"{s:,}" for s in step)
    return f"step {step:,}"


def report(res: dict) -> list[str]:
    """The `quality` section's blocks, from the JSON alone."""
    blocks = ["## Quality (Multi30k En→De, test_2016_flickr, 1,000 sentences)"]
    for key in ("recipe", "recipe_avx2"):
        if key in res:
            blocks += recipe_blocks(res, res[key])
    if a := res.get("tokenization_agreement"):
        same = "; ".join(
            f"{s} {v['same']:,} of {v['lines']:,} lines identical" for s, v in a.items()
        )
        blocks.append(
            "Our tokenization of the raw German references against the official "
            f"`tok/*.lc.norm.tok.de` files: {same}."
        )
    if "budget" in res:
        blocks += budget_blocks(res["budget"])
    if "precision" in res and res.get("recipe", {}).get("trained_precision") == "bf16":
        p = res["precision"]
        blocks += [
            "### bf16 against fp32 at equal steps (validation BLEU, greedy, whole dev set)",
            f"The recipe run (bf16) and the same recipe in fp32 for {p['steps']} steps (same seed "
            "and batches).",
            md_table(
                ["step", "bf16", "fp32", "bf16 − fp32"],
                [(f"{r['step']:,}", r["bf16"], r["fp32"], f"{r['diff']:+.2f}") for r in p["rows"]],
                "rrrr",
            ),
        ]
    return blocks


def recipe_blocks(res: dict, r: dict) -> list[str]:
    """One recipe run's blocks: where and how it ran, its scores, BLEU on the way."""
    row = (f"{r['bleu']:.2f}", f"{r['chrf']:.2f}", f"{r['ter']:.2f}", r["train_minutes"])
    row += (f"{r['steps']:,}", r["epochs"], f"{r['tgt_tok_per_s']:,}", r["sentences_per_second"])
    head = ["BLEU", "chrF", "TER", "training minutes", "steps", "epochs", "target tok/s"]
    flags = f"; flags {', '.join(r['cpu_flags'])}" if r.get("cpu_flags") else ""
    trained = f"{r.get('trained_precision', '?')}{attention_text(r)}{probe_text(r)}"
    kernels = f", with {avx2_description()}" if r.get("avx2") else ""
    if kernels and r.get("cpu_flags") and "avx512f" not in r["cpu_flags"]:
        kernels += " (no AVX-512 on this CPU: its own kernels, an AVX2-only CPU itself)"
    blocks = [
        f"`tmt train {r.get('config', res.get('recipe_config'))}`"
        + (f" with `--set {' --set '.join(r['changes'].split())}`" if r.get("changes") else "")
        + " from a clean run directory on "
        f"{r.get('date', res['date'])} on **{r.get('cpu', res.get('cpu', 'an unrecorded CPU'))}** "
        f"({r.get('cores', res.get('cores', 2))} cores{flags}){kernels}, trained in "
        f"{trained}, then `tmt evaluate` with beam {r['beam']} on the checkpoint the recipe "
        f"selected ({r['evaluated']}).",
        md_table([*head, "decode sent/s"], [row], "rrrrrrrr"),
        f"BLEU signature: `{r['bleu_signature']}`; chrF: `{r['chrf_signature']}`; TER: "
        f"`{r['ter_signature']}`.",
    ]
    if changed := changed_settings(res, r):
        blocks.append(
            f"This run predates the config's present settings; it ran with {', '.join(changed)}."
        )
    if "tokenized_bleu" in r:
        blocks.append(
            f"Beside it, the literature's measure: **tokenized BLEU {r['tokenized_bleu']:.2f}** "
            f"(sacreBLEU {r['bleu']:.2f}), {r['tokenized_bleu_description']}."
        )
    if r.get("ensemble"):
        valid = r.get("ensemble_valid_bleu")
        blocks.append(
            f"An ensemble of {r['ensemble']} models trained side by side (`train.ensemble`), each "
            f"on its share of the cores: {steps_text(r['member_steps'])} updates (the steps column "
            "counts them all)"
            + (
                ""
                if valid is None
                else f"; validation BLEU (greedy, whole dev set) {valid:.2f} for the ensemble"
            )
            + "."
        )
    if by := r.get("test_bleu_by_minute"):
        marks = "; ".join(
            f"{m} min ({steps_text(v['step'])}): {both_bleus(v)}" for m, v in by.items()
        )
        end = steps_text(r.get("member_steps", r["step"]))
        blocks.append(
            "Test BLEU on the way (the newest step checkpoint as each mark passed, minutes from "
            f"launch with set-up, not averaged; beam {r['beam']}), as sacreBLEU / tokenized BLEU: "
            f"{marks}; the end ({r['evaluated']}, {end}): {both_bleus(r)}."
        )
    if by := r.get("valid_bleu_by_minute"):
        blocks.append(
            "Validation BLEU (greedy, whole dev set) of the last validation by each mark: "
            + "; ".join(f"{m} min: {b}" for m, b in by.items())
            + "."
        )
    return blocks


def budget_blocks(b: dict) -> list[str]:
    if "rows" not in b:
        return [
            "The earlier equal-budget race trained the two toolkits with different "
            "regularisation, precision and checkpoint selection; it is not shown. `python -m "
            "scripts.bench_quality --budget 20` runs it like for like."
        ]
    m = f"{b['minutes']:g}"
    when = (
        f"on {b['date']} on {b['cpu']}"
        if "date" in b
        else "in an earlier run of this bench (its date and CPU were not recorded then)"
    )
    blocks = [
        f"### Equal budget: {m} minutes of training, the same model and regularisation",
        "Both toolkits train the peers' model and schedule (3+3 layers, d 256, FFN 1024, "
        "pre-norm, tied embeddings, dropout 0.1 on residuals, attention and activations, 200 "
        f"warm-up updates to a 1e-3 peak, seed 42) for {m} minutes from launch, set-up included, "
        f"one after the other on the same machine, {when}: ours with `{' '.join(BUDGET_SETTINGS)} "
        f"train.max_minutes={m}`, fairseq with `../shared/peers/budget.sh fairseq {m}`. Each is "
        "judged on its last checkpoint and on the one its own selection keeps (ours: best "
        "validation BLEU; fairseq: best validation loss). Beam 4, length penalty 1.0 by each "
        "toolkit's formula (ours GNMT ((5 + |Y|) / 6)^α, fairseq |Y|^α).",
        md_table(
            ["toolkit", "checkpoint", "precision", "updates", "BLEU", "decode sent/s", "signature"],
            [
                (v["toolkit"], v["checkpoint"], v["precision"], v.get("steps", "?"), v["bleu"])
                + (v["decode_sent_per_s"], f"`{v['signature']}`")
                for v in b["rows"]
            ],
            "lllrrrl",
        ),
    ]
    by = {(v["toolkit"], v["selection"]): v for v in b["rows"]}
    for sel in ("last", "own best"):
        ours, fs = by.get(("transformer-mt", sel)), by.get(("fairseq", sel))
        if ours and fs:
            updates = (
                f", after {ours['steps'] / fs['steps']:.2f}× its updates in the same minutes"
                if all(isinstance(v.get("steps"), int) for v in (ours, fs))
                else ""
            )
            blocks.append(
                f"{sel.capitalize()} checkpoints: ours {ours['bleu'] - fs['bleu']:+.2f} BLEU "
                f"against fairseq{updates}; decoding "
                f"{ours['decode_sent_per_s'] / fs['decode_sent_per_s']:.2f}× as fast."
            )
    return blocks


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--recipe", default="configs/multi30k_en_de_local.yaml")
    ap.add_argument("--skip-recipe", action="store_true")
    ap.add_argument(
        "--evaluate-only", action="store_true", help="score the recipe's existing run, do not train"
    )
    ap.add_argument("--budget", type=float, default=0, help="also race fairseq for this many min")
    ap.add_argument(
        "--fp32-steps",
        type=int,
        default=0,
        metavar="N",
        help="also train the recipe in fp32 for N steps and compare its validation BLEU with the "
        "recipe run's (bf16) at the same steps",
    )
    ap.add_argument(
        "--avx2",
        action="store_true",
        help="train and evaluate the recipe with AVX2 kernels only (an AVX2-only CPU, "
        "approximated): the quality section's second row",
    )
    ap.add_argument(
        "--variant",
        action="store_true",
        help="the recipe with --set changes as an experiment: into the history only",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="every run")
    ap.add_argument("--test", type=Path, default=TEST_PREFIX, help="test set: PREFIX.en, PREFIX.de")
    ap.add_argument("--runs", type=Path, default=ROOT / "runs", help="the budget and fp32 runs")
    ap.add_argument("--history", type=Path, default=ROOT / "docs" / "multi30k.md")
    ap.add_argument("--json", type=Path, default=ROOT / "bench_quality.json")
    ap.add_argument("--out", type=Path, default=BENCHMARKS)
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    args = ap.parse_args(argv)
    for alone in ("avx2", "variant"):
        if getattr(args, alone) and (args.budget or args.fp32_steps or args.skip_recipe):
            ap.error(
                f"--{alone} runs the recipe alone: leave out --budget, --fp32-steps and "
                "--skip-recipe"
            )
    if args.variant and not args.set:
        ap.error("--variant needs the --set changes it tries")
    return args


def load_results(path: Path) -> dict:
    """The JSON of earlier runs ({} at first)."""
    res = read_json(path) if path.exists() else {}
    if "recipe" in res:  # written before runs kept their own date and CPU: the file's were theirs
        res["recipe"].setdefault("date", res.get("date"))
        res["recipe"].setdefault("cpu", res.get("cpu"))
    return res


def recipe_run(args: argparse.Namespace, res: dict) -> Path:
    """Train and score the recipe (as --avx2 or --variant say) into res, unless --skip-recipe;
    the run directory."""
    recipe_dir = ROOT / yaml.safe_load((ROOT / args.recipe).read_text())["output_dir"]
    if args.avx2:  # every tmt this process starts inherits it
        os.environ.update(AVX2_ONLY)
        recipe_dir = recipe_dir.with_name(recipe_dir.name + "_avx2")
    if args.variant:
        recipe_dir = recipe_dir.with_name(recipe_dir.name + "_variant")
    if args.skip_recipe:
        return recipe_dir
    key = "variant" if args.variant else "recipe_avx2" if args.avx2 else "recipe"
    run = train_and_evaluate(args.recipe, recipe_dir, args.set, args.test, not args.evaluate_only)
    run.update(date=res["date"], cpu=res["cpu"], cpu_flags=reported_flags(), avx2=args.avx2)
    run.update(cores=os.cpu_count(), config=args.recipe, changes=" ".join(args.set))
    res[key] = run
    record_experiment(res, key, args.recipe, recipe_dir, args.history)
    log(f"{key}: BLEU {run['bleu']} in {run['train_minutes']} min")
    return recipe_dir


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_section(args.out, "quality", *report(read_json(args.json)))
        return 0
    try:
        src_ref_files(args.test)
    except DataError:
        log(f"skipped: the test set {args.test} is not here (it ships in ../shared)")
        return 0
    res = load_results(args.json)
    res.update(date=now(), cpu=cpu_model(), cores=os.cpu_count())
    if (agreement := tokenization_agreement()) is not None:
        res["tokenization_agreement"] = agreement
    recipe_dir = recipe_run(args, res)
    if args.budget:
        run_dir = args.runs / f"budget_{args.budget:g}min"
        rows = budget_race(args.recipe, args.budget, run_dir, args.set, args.test)
        res["budget"] = {"minutes": args.budget, "rows": rows, "date": now(), "cpu": cpu_model()}
    if args.fp32_steps:
        res.pop("precision", None)
        run_dir = args.runs / "precision_fp32"
        check = precision_check(args.recipe, recipe_dir, args.fp32_steps, run_dir, args.set)
        if check is not None:
            res["precision"] = check
    write_json(args.json, res)
    write_section(args.out, "quality", *report(res))
    log(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
