"""Beam-4 decoding by every engine and precision, side by side (issue 15): `make bench` calls
`decode_engines` for the decoding table of its `speed` section; run alone, it writes the rows to
--json.

Every contender decodes the same batches: the sources sorted by length and cut into batches of
`batch` sentences (fairseq-generate's --batch-size), on the same number of threads. Each run is a
child process (`--child`), which reports its own peak RSS; rounds interleave the contenders and the
rows give medians.

usage: python -m scripts.bench_decode --checkpoint CKPT [--src FILE --ref FILE] [--rounds 3]
       [--only NAME ...] [--json bench_decode.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from scripts.benchlib import ROOT, TEST_PREFIX, json_of, logger, peak_rss_mb, write_json

# name -> (engine, precision); CTranslate2 reads the export of its own quantization
CONTENDERS = {
    "transformer-mt fp32": ("torch", "fp32"),
    "transformer-mt bf16": ("torch", "bf16"),
    "transformer-mt int8": ("torch", "int8"),
    "ctranslate2 float32": ("ctranslate2", "float32"),
    "ctranslate2 int8": ("ctranslate2", "int8"),
}
# fairseq-generate's beam 4, lenpen 1, max-len-b 200
SETTINGS = {"beam": 4, "alpha": 1.0, "max_len": (0.0, 200)}


def child(
    engine: str, precision: str, model: str, src: str, ref: str, batch: int, threads: int
) -> dict:
    """One contender: load, warm up on one batch, decode every batch (timed), score; with its own
    peak RSS."""
    from transformer_mt.data import chunks, read_lines
    from transformer_mt.inference import load_translator
    from transformer_mt.metrics import score
    from transformer_mt.runtime import set_threads

    set_threads(threads)
    t = load_translator(
        model,
        device="cpu",
        engine=engine,
        beam=SETTINGS["beam"],
        alpha=SETTINGS["alpha"],
        max_len=SETTINGS["max_len"],
        precision=None if engine == "ctranslate2" else precision,
    )
    # a batch is `batch` sentences, nothing else: no budget of source tokens cuts it further
    t.defaults = dataclasses.replace(t.defaults, max_src_tokens=10**9)
    sources, references = read_lines(src), read_lines(ref)
    lengths = [len(x) for x in t.tokenizer.encode_src(sources)]
    order = sorted(range(len(sources)), key=lambda i: lengths[i])
    batches = list(chunks(order, batch))
    t.translate_text([sources[i] for i in batches[len(batches) // 2]])  # warm-up
    hyps: list[str] = [""] * len(sources)
    start = time.perf_counter()
    for b in batches:
        for i, h in zip(b, t.translate_text([sources[i] for i in b])):
            hyps[i] = h
    seconds = time.perf_counter() - start
    s = score(hyps, [references], lang=t.config.data.tgt_lang)
    return {
        "sent_s": len(sources) / seconds,
        "seconds": seconds,
        "bleu": round(s["bleu"], 2),
        "signature": s["signature"],
        "precision": t.precision,
        "engine": t.name,
        "peak_rss_mb": round(peak_rss_mb()),  # its own VmHWM, not the bench's
        "rss_of": "self",
    }


def decode_engines(
    checkpoint: Path,
    src: Path,
    ref: Path,
    rounds: int,
    log: Callable[[str], None],
    *,
    batch: int = 64,
    threads: int = 2,
    only: list[str] | None = None,
    workdir: Path = ROOT / "runs" / "bench_ct2",
    fairseq: Callable[[], dict | None] | None = None,
) -> dict:
    """Every contender (or the `only` ones; and fairseq-generate, when `fairseq` runs it) `rounds`
    times, interleaved; medians."""
    from transformer_mt.export import export_ctranslate2

    chosen = {k: v for k, v in CONTENDERS.items() if not only or k in only}
    models = {}
    for name, (engine, precision) in chosen.items():
        models[name] = (
            export_ctranslate2(checkpoint, workdir / precision, precision, force=True)
            if engine == "ctranslate2"
            else checkpoint
        )
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name, (engine, precision) in chosen.items():
            log(f"decoding round {r + 1}/{rounds}: {name}")
            cmd = [sys.executable, "-m", "scripts.bench_decode", "--child", engine, precision]
            cmd += [str(models[name]), str(src), str(ref), "--batch", str(batch)]
            try:
                runs.setdefault(name, []).append(json_of([*cmd, "--threads", str(threads)]))
            except subprocess.CalledProcessError as e:  # the other contenders keep their rows
                log(f"{name} failed: {e.stderr.strip()[-400:]}")
        if fairseq is not None:
            log(f"decoding round {r + 1}/{rounds}: fairseq")
            if f := fairseq():
                runs.setdefault("fairseq", []).append(fairseq_row(f))
    return {
        name: {
            **v[-1],
            "sent_s": round(statistics.median(x["sent_s"] for x in v), 1),
            "runs": [round(x["sent_s"], 1) for x in v],
            "peak_rss_mb": max(x["peak_rss_mb"] for x in v),
        }
        for name, v in runs.items()
        if v
    }


def fairseq_row(f: dict) -> dict:
    """A row from the peers kit's decode_speed.sh RESULT line."""
    return {
        "sent_s": float(f["decode_sent_per_s"]),
        "bleu": float(f["bleu"]),
        "signature": f.get("signature", ""),
        "precision": "fp32",
        "engine": "fairseq-generate",
        "peak_rss_mb": int(f.get("peak_rss_mb", 0) or 0),
    }


def conclusions(d: dict) -> list[str]:
    """Sentences computed from the figures: the issue's two targets, met or not, and by how
    much."""
    out = []
    ct2, fs = d.get("ctranslate2 int8", {}).get("sent_s"), d.get("fairseq", {}).get("sent_s")
    if ct2 and fs:
        out.append(
            f"CTranslate2 int8 through tmt decodes {ct2 / fs:.2f}× as fast as fairseq-generate "
            f"(target ≥ 3×: {'met' if ct2 / fs >= 3 else 'not met'})."
        )
    ours32 = d.get("transformer-mt fp32", {})
    if ours32 and fs:
        out.append(
            f"fp32 against fp32, the headline: ours decodes {ours32['sent_s'] / fs:.2f}× as fast "
            "as fairseq-generate."
        )
    ours = {k: v["sent_s"] for k, v in d.items() if k.startswith("transformer-mt")}
    ct2s = {k: v["sent_s"] for k, v in d.items() if k.startswith("ctranslate2")}
    if ct2 and ours:
        best = max(ours, key=ours.get)
        fastest = max(ct2s, key=ct2s.get)
        out.append(
            f"Our fastest PyTorch decoding ({best}) runs at {ours[best] / ct2:.2f}× CTranslate2 "
            f"int8 (target ≥ 0.5×: {'met' if ours[best] / ct2 >= 0.5 else 'not met'})."
        )
        out.append(
            f"The fastest CTranslate2 here is {fastest}; our fastest runs at "
            f"{ours[best] / ct2s[fastest]:.2f}× it."
        )
    if fs and ours32 and abs(d["fairseq"]["bleu"] - ours32["bleu"]) > 2:
        out.append(
            f"fairseq decodes another model (BLEU {d['fairseq']['bleu']} against ours "
            f"{ours32['bleu']}): its outputs differ in length, so the ratios to it compare engines "
            "on different work."
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--checkpoint", type=Path, help="the model every contender decodes")
    mode.add_argument(
        "--child",
        nargs=5,
        metavar=("ENGINE", "PRECISION", "MODEL", "SRC", "REF"),
        help="decode as one contender and print its JSON line",
    )
    ap.add_argument("--src", type=Path, default=Path(f"{TEST_PREFIX}.en.gz"))
    ap.add_argument("--ref", type=Path, default=Path(f"{TEST_PREFIX}.de.gz"))
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds")
    ap.add_argument("--only", action="append", choices=list(CONTENDERS), help="these contenders")
    ap.add_argument("--batch", type=int, default=64, help="sentences per batch")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    ap.add_argument("--workdir", type=Path, default=ROOT / "runs" / "bench_ct2", help="exports")
    ap.add_argument("--json", default=str(ROOT / "bench_decode.json"))
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, batch=args.batch, threads=args.threads)))
        return 0
    rows = decode_engines(
        args.checkpoint,
        args.src,
        args.ref,
        args.rounds,
        logger("bench_decode"),
        batch=args.batch,
        threads=args.threads,
        only=args.only,
        workdir=args.workdir,
    )
    write_json(args.json, {"checkpoint": str(args.checkpoint), "decoding": rows})
    for c in conclusions(rows):
        print(c)
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
