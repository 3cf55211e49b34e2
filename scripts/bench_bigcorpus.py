"""Big-corpus bench (issue 6): prepare a generated 2,000,000-pair corpus and train 50 steps on it,
measuring peak RSS of each phase in its own process, and preparation throughput in pairs/s.

usage: python scripts/bench_bigcorpus.py [--pairs 2000000] [--workdir runs/bigcorpus]
Writes the `bigcorpus` section of BENCHMARKS.md and bench_bigcorpus.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
from benchlib import replace_section  # noqa: E402

PREPARE = """
import json, resource, sys, time
from pathlib import Path
from transformer_mt.config import load_config
from transformer_mt.data import iter_split, load_tokenized
from transformer_mt.tokenizer import Tokenizer, train_tokenizer
cfg = load_config(sys.argv[1]); run = Path(cfg.output_dir); run.mkdir(parents=True, exist_ok=True)
t0 = time.perf_counter()
pairs = lambda: iter_split(cfg.data, "train")
tok = train_tokenizer(cfg.tokenizer, (s for s, _ in pairs()), (t for _, t in pairs()))
tok.save(run)
t1 = time.perf_counter()
corpus = load_tokenized(cfg.data, "train", tok, Path(cfg.data.cache_dir))
t2 = time.perf_counter()
print(json.dumps({"pairs": len(corpus), "tokens": int(corpus.src_offsets[-1] + corpus.tgt_offsets[-1]),
                  "tokenizer_seconds": t1 - t0, "tokenize_seconds": t2 - t1,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


TRAIN = """
import json, resource, sys
from transformer_mt.cli import main
rc = main(["-q", "train", sys.argv[1]])
print(json.dumps({"rc": rc, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
sys.exit(rc)
"""


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pairs", type=int, default=2_000_000)
    ap.add_argument("--workdir", default=str(ROOT / "runs" / "bigcorpus"))
    ap.add_argument("--json", default=str(ROOT / "bench_bigcorpus.json"))
    args = ap.parse_args()
    work = Path(args.workdir)
    data = work / "data"
    t0 = time.perf_counter()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_mt.demo_corpus",
            str(data),
            "--train",
            str(args.pairs),
            "--valid",
            "500",
            "--test",
            "500",
            "--seed",
            "7",
        ],
        check=True,
    )
    generate_s = time.perf_counter() - t0
    cfg = work / "big.yaml"
    cfg.write_text(
        textwrap.dedent(f"""\
        data: {{train: {data}/train, valid: {data}/valid, test: {data}/test, cache_dir: {work}/cache}}
        tokenizer: {{vocab_size: 8000, max_sentences: 1000000}}
        model: {{d_model: 256, heads: 4, encoder_layers: 3, decoder_layers: 3, d_ff: 1024}}
        train: {{max_steps: 50, valid_every: 1000000, log_every: 10, valid_bleu: false, keep_last: 0,
                 max_tokens: 2048}}
        output_dir: {work}/run
        """)
    )
    import shutil

    shutil.rmtree(work / "run", ignore_errors=True)
    shutil.rmtree(work / "cache", ignore_errors=True)
    out = subprocess.run(
        [sys.executable, "-c", PREPARE, str(cfg)], check=True, capture_output=True, text=True
    )
    prep = json.loads(out.stdout.strip().splitlines()[-1])
    t0 = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", TRAIN, str(cfg)], check=True, capture_output=True, text=True
    )
    train_rss = json.loads(out.stdout.strip().splitlines()[-1])["peak_rss_mb"]
    res = {
        "pairs": prep["pairs"],
        "tokens": prep["tokens"],
        "generate_seconds": round(generate_s, 1),
        "tokenizer_seconds": round(prep["tokenizer_seconds"], 1),
        "tokenize_seconds": round(prep["tokenize_seconds"], 1),
        "prepare_pairs_per_second": round(
            prep["pairs"] / (prep["tokenizer_seconds"] + prep["tokenize_seconds"])
        ),
        "tokenize_pairs_per_second": round(prep["pairs"] / prep["tokenize_seconds"]),
        "prepare_peak_rss_mb": round(prep["peak_rss_mb"]),
        "train_50_steps_seconds": round(time.perf_counter() - t0, 1),
        "train_peak_rss_mb": round(train_rss),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    Path(args.json).write_text(json.dumps(res, indent=2))
    replace_section(
        ROOT / "BENCHMARKS.md",
        "bigcorpus",
        textwrap.dedent(f"""\
        ## A corpus of {res["pairs"]:,} pairs ({res["tokens"] / 1e6:.0f}M tokens), generated

        Written by `scripts/bench_bigcorpus.py` on {res["date"]}. Each phase runs in its own process.

        | phase | seconds | pairs/s | peak RSS (MiB) |
        | --- | ---: | ---: | ---: |
        | SentencePiece training (streamed, sample of 1M lines) | {res["tokenizer_seconds"]} | | |
        | tokenization into the memory-mapped cache | {res["tokenize_seconds"]} | {res["tokenize_pairs_per_second"]:,} | |
        | preparation as a whole | {res["tokenizer_seconds"] + res["tokenize_seconds"]:.1f} | {res["prepare_pairs_per_second"]:,} | {res["prepare_peak_rss_mb"]:,} |
        | training, first 50 steps (d 256, 2,048-token batches) | {res["train_50_steps_seconds"]} | | {res["train_peak_rss_mb"]:,} |
        """),
    )
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
