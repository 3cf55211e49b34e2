"""Big-corpus bench (issue 6): generate a 2,000,000-pair corpus, prepare it (SentencePiece, then
tokenization into the memory-mapped cache) and train 50 steps on it, each phase in its own process
(`--phase`) with its own peak RSS; preparation throughput in pairs/s. Writes the `bigcorpus`
section of BENCHMARKS.md and bench_bigcorpus.json.

usage: python -m scripts.bench_bigcorpus [--pairs 2000000] [--workdir runs/bigcorpus]
       [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    json_of,
    md_table,
    now,
    peak_rss_mb,
    read_json,
    write_json,
    write_section,
)


def big_config(work: Path, overrides: list[str]) -> dict:
    """The run's config: the generated corpus, the recipe's model size, 50 steps, no
    validation."""
    from transformer_mt.config import apply_override

    data = work / "data"
    raw = {
        "data": {
            "train": f"{data}/train",
            "valid": f"{data}/valid",
            "test": f"{data}/test",
            "cache_dir": str(work / "cache"),
        },
        "tokenizer": {"vocab_size": 8000, "max_sentences": 1_000_000},
        "model": {
            "d_model": 256,
            "heads": 4,
            "encoder_layers": 3,
            "decoder_layers": 3,
            "d_ff": 1024,
        },
        "train": {
            "max_steps": 50,
            "valid_every": 1_000_000,
            "log_every": 10,
            "valid_bleu": False,
            "keep_last": 0,
            "max_tokens": 2048,
        },
        "output_dir": str(work / "run"),
    }
    for item in overrides:
        apply_override(raw, item)
    return raw


def prepare(config: Path) -> dict:
    """Phase one: train the tokenizer (streamed) and tokenize the train split into the cache."""
    from transformer_mt.config import load_config
    from transformer_mt.data import cache_dir, load_tokenized, prepare_tokenizer

    cfg = load_config(config)
    run = Path(cfg.output_dir)
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tok = prepare_tokenizer(cfg, run)
    t1 = time.perf_counter()
    corpus = load_tokenized(cfg.data, "train", tok, cache_dir(cfg.data))
    t2 = time.perf_counter()
    return {
        "pairs": len(corpus),
        "tokens": int(corpus.src_offsets[-1] + corpus.tgt_offsets[-1]),
        "tokenizer_seconds": t1 - t0,
        "tokenize_seconds": t2 - t1,
        "peak_rss_mb": peak_rss_mb(),
    }


def train(config: Path) -> dict:
    """Phase two: `tmt train` on the prepared corpus (the tokenizer and the cache are reused)."""
    from transformer_mt.cli import main as tmt

    return {"rc": tmt(["-q", "train", str(config)]), "peak_rss_mb": peak_rss_mb()}


PHASES = {"prepare": prepare, "train": train}


def measure(args: argparse.Namespace) -> dict:
    """Generate, then each phase in a fresh process; the figures."""
    work = Path(args.workdir)
    raw = big_config(work, args.set)
    t0 = time.perf_counter()
    counts = ["--train", str(args.pairs), "--valid", "500", "--test", "500", "--seed", "7"]
    subprocess.run(
        [sys.executable, "-m", "transformer_mt.demo_corpus", str(work / "data"), *counts],
        check=True,
    )
    generate_s = time.perf_counter() - t0
    cfg = work / "big.yaml"
    cfg.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    shutil.rmtree(raw["output_dir"], ignore_errors=True)
    shutil.rmtree(raw["data"]["cache_dir"], ignore_errors=True)
    phase = [sys.executable, "-m", "scripts.bench_bigcorpus", "--config", str(cfg), "--phase"]
    prep = json_of([*phase, "prepare"])
    t0 = time.perf_counter()
    trained = json_of([*phase, "train"])
    train_s = time.perf_counter() - t0
    if trained["rc"] != 0:
        raise SystemExit(f"bench_bigcorpus: tmt train {cfg} failed with {trained['rc']}")
    prep_s = prep["tokenizer_seconds"] + prep["tokenize_seconds"]
    return {
        "pairs": prep["pairs"],
        "tokens": prep["tokens"],
        "generate_seconds": round(generate_s, 1),
        "tokenizer_seconds": round(prep["tokenizer_seconds"], 1),
        "tokenize_seconds": round(prep["tokenize_seconds"], 1),
        "prepare_pairs_per_second": round(prep["pairs"] / prep_s),
        "tokenize_pairs_per_second": round(prep["pairs"] / prep["tokenize_seconds"]),
        "prepare_peak_rss_mb": round(prep["peak_rss_mb"]),
        "train_seconds": round(train_s, 1),
        "train_peak_rss_mb": round(trained["peak_rss_mb"]),
        "train_steps": raw["train"]["max_steps"],
        "d_model": raw["model"]["d_model"],
        "max_tokens": raw["train"]["max_tokens"],
        "tokenizer_sample": raw["tokenizer"]["max_sentences"],
        "date": now(),
    }


def write_report(res: dict, path: Path) -> str:
    """The `bigcorpus` section, from the JSON alone (runs before the steps and sizes were recorded
    had the defaults)."""
    steps, d = res.get("train_steps", 50), res.get("d_model", 256)
    train_s = res.get("train_seconds", res.get("train_50_steps_seconds"))
    sample = res.get("tokenizer_sample", 1_000_000)
    prep_s = res["tokenizer_seconds"] + res["tokenize_seconds"]
    batches = f"{res.get('max_tokens', 2048):,}-token batches"
    rows = [
        (f"SentencePiece training (streamed, sample of {sample / 1e6:g}M lines)",)
        + (res["tokenizer_seconds"], "", ""),
        ("tokenization into the memory-mapped cache", res["tokenize_seconds"])
        + (f"{res['tokenize_pairs_per_second']:,}", ""),
        ("preparation as a whole", f"{prep_s:.1f}", f"{res['prepare_pairs_per_second']:,}")
        + (f"{res['prepare_peak_rss_mb']:,}",),
        (f"training, first {steps} steps (d {d}, {batches})", train_s, "")
        + (f"{res['train_peak_rss_mb']:,}",),
    ]
    return write_section(
        path,
        "bigcorpus",
        f"## A corpus of {res['pairs']:,} pairs ({res['tokens'] / 1e6:.0f}M tokens), generated",
        f"Written by `scripts/bench_bigcorpus.py` on {res['date']}. Each phase runs in its own "
        "process.",
        md_table(["phase", "seconds", "pairs/s", "peak RSS (MiB)"], rows, "lrrr"),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_bigcorpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bigcorpus"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="the run")
    ap.add_argument("--json", default=str(ROOT / "bench_bigcorpus.json"))
    ap.add_argument("--out", default=str(BENCHMARKS))
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    ap.add_argument("--phase", choices=list(PHASES), help="run one phase (a child process)")
    ap.add_argument("--config", type=Path, help="the phase's config (with --phase)")
    args = ap.parse_args(argv)
    if args.phase:
        print(json.dumps(PHASES[args.phase](args.config)))
        return 0
    res = read_json(args.json) if args.report_only else measure(args)
    if not args.report_only:
        write_json(args.json, res)
    write_report(res, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
