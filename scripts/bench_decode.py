"""Beam-4 decoding of test_2016_flickr by every engine and precision, side by side (issue 15); `make
bench` calls `decode_engines`, and `python scripts/bench_decode.py --child ...` is one contender's
run.

Every contender decodes the same batches: the 1,000 sources sorted by length and cut into batches of
`batch` sentences (fairseq-generate's --batch-size), on the same number of threads. Each run is a
child process, which reports its own peak RSS (peak_rss_mb); rounds interleave the contenders and
the table reports medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
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


def peak_rss_mb() -> float:
    """This process's own peak resident set, MiB: VmHWM of /proc/self/status. Not ru_maxrss: Linux
    carries the peak of the process that forked this one across exec into it, so every child of a 10
    GB bench reported 10 GB (and os.wait4 or RUSAGE_CHILDREN read that same figure). Elsewhere
    ru_maxrss is the best there is."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, KiB elsewhere


def child(
    engine: str, precision: str, model: str, src: str, ref: str, batch: int, threads: int
) -> dict:
    """One contender: load, warm up on one batch, decode every batch (timed), score; with its own
    peak RSS."""
    import torch

    from transformer_mt.data import chunks, read_lines
    from transformer_mt.inference import load_translator
    from transformer_mt.metrics import score

    torch.set_num_threads(threads)
    t = load_translator(
        model,
        device="cpu",
        engine=engine,
        beam=SETTINGS["beam"],
        alpha=SETTINGS["alpha"],
        max_len=SETTINGS["max_len"],
        precision=None if engine == "ctranslate2" else precision,
    )
    # a batch is `batch` sentences, nothing else
    t.decode = dataclasses.replace(t.decode, max_src_tokens=10**9)
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
        "engine": t.engine,
        # its own VmHWM (see decoding_table)
        "peak_rss_mb": round(peak_rss_mb()),
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
    fairseq: Callable[[], dict | None] | None = None,
) -> dict:
    """Every contender (and fairseq-generate, when `fairseq` runs it) `rounds` times, interleaved;
    medians."""
    from transformer_mt.export import export_ctranslate2

    exports = {}
    for quantization in ("float32", "int8"):
        exports[quantization] = export_ctranslate2(
            checkpoint, ROOT / "runs" / "bench_ct2" / quantization, quantization, force=True
        )
    runs: dict[str, list[dict]] = {}
    for r in range(rounds):
        for name, (engine, precision) in CONTENDERS.items():
            log(f"decoding round {r + 1}/{rounds}: {name}")
            model = exports[precision] if engine == "ctranslate2" else checkpoint
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    engine,
                    precision,
                    str(model),
                    str(src),
                    str(ref),
                    "--batch",
                    str(batch),
                    "--threads",
                    str(threads),
                ],
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            if out.returncode != 0:
                log(f"{name} failed: {out.stderr.strip()[-400:]}")
                continue
            runs.setdefault(name, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
        if fairseq is not None:
            log(f"decoding round {r + 1}/{rounds}: fairseq")
            f = fairseq()
            if f:
                runs.setdefault("fairseq", []).append(
                    {
                        "sent_s": float(f["decode_sent_per_s"]),
                        "bleu": float(f["bleu"]),
                        "signature": f.get("signature", ""),
                        "precision": "fp32",
                        "engine": "fairseq-generate",
                        "peak_rss_mb": int(f.get("peak_rss_mb", 0) or 0),
                    }
                )
    return {
        name: {
            **v[-1],
            "sent_s": round(statistics.median(x["sent_s"] for x in v), 1),
            "runs": [round(x["sent_s"], 1) for x in v],
            "peak_rss_mb": max(x["peak_rss_mb"] for x in v),
        }
        for name, v in runs.items()
    }


def conclusions(d: dict) -> list[str]:
    """Sentences computed from the figures: the issue's two targets, met or not, and by how much."""
    out = []
    ct2, fs = d.get("ctranslate2 int8", {}).get("sent_s"), d.get("fairseq", {}).get("sent_s")
    if ct2 and fs:
        out.append(
            f"CTranslate2 int8 through tmt decodes {ct2 / fs:.2f}× as fast as fairseq-generate "
            f"(target ≥ 3×: {'met' if ct2 / fs >= 3 else 'not met'})."
        )
    ours32 = d.get("transformer-mt fp32", {}).get("sent_s")
    if ours32 and fs:
        out.append(
            f"fp32 against fp32, the headline: ours decodes {ours32 / fs:.2f}× as fast as "
            "fairseq-generate."
        )
    ours = {k: v for k, v in d.items() if k.startswith("transformer-mt")}
    if ct2 and ours:
        best = max(ours, key=lambda k: ours[k]["sent_s"])
        ratio = ours[best]["sent_s"] / ct2
        out.append(
            f"Our fastest PyTorch decoding ({best}) runs at {ratio:.2f}× CTranslate2 int8 "
            f"(target ≥ 0.5×: {'met' if ratio >= 0.5 else 'not met'})."
        )
        ct2s = {k: v for k, v in d.items() if k.startswith("ctranslate2")}
        fastest = max(ct2s, key=lambda k: ct2s[k]["sent_s"])
        out.append(
            f"The fastest CTranslate2 here is {fastest}; our fastest runs at "
            f"{ours[best]['sent_s'] / ct2s[fastest]['sent_s']:.2f}× it."
        )
    if (
        fs
        and ours
        and abs(
            d["fairseq"]["bleu"]
            - d.get("transformer-mt fp32", {}).get("bleu", d["fairseq"]["bleu"])
        )
        > 2
    ):
        out.append(
            f"fairseq decodes another model (BLEU {d['fairseq']['bleu']} against ours "
            f"{d['transformer-mt fp32']['bleu']}): its outputs differ in length, so the ratios to "
            "it compare "
            "engines on different work."
        )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--child",
        nargs=5,
        metavar=("ENGINE", "PRECISION", "MODEL", "SRC", "REF"),
        required=True,
        help="decode as one contender and print its JSON line",
    )
    ap.add_argument("--batch", type=int, default=64, help="sentences per batch")
    ap.add_argument("--threads", type=int, default=2, help="intra-op threads")
    args = ap.parse_args()
    print(json.dumps(child(*args.child, batch=args.batch, threads=args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
