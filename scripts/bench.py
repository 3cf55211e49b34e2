"""`make bench`: training and decoding speed, side by side with the peers, into BENCHMARKS.md +
bench.json.

Measured in one run on one machine (these machines are shared and noisy: read the ratios):
  - the matmul ceiling (fp32, bf16) on the model's shapes;
  - training target tokens/s of ours (fp32, bf16 autocast, bf16-output) and of a plain
    torch.nn.Transformer loop (fp32, bf16) on the *same* batches, taking turns every 10 steps,
    medians of the 10-step windows;
  - fairseq and JoeyNMT through ../shared/peers, once a round (skipped with a message when the kit
    is absent);
  - tokens/s against batch size, and decoding cost per token against output length (KV cache);
  - beam-4 decoding of test_2016_flickr by ours (bf16 and fp32) and fairseq-generate, when both have
    a model trained for the same budget (`make bench-quality` trains them), and by JoeyNMT once when
    `bash ../shared/peers/budget.sh joey 20` has trained its model.

usage: python scripts/bench.py [--rounds 2] [--steps 30] [--no-peers] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_decode import peak_rss_mb  # noqa: E402
from benchlib import cpu_bf16, cpu_model, replace_section  # noqa: E402

from transformer_mt.config import config_from_dict  # noqa: E402
from transformer_mt.data import Batch, collate, make_batches  # noqa: E402
from transformer_mt.runtime import DTYPES, matmul_gflops  # noqa: E402
from transformer_mt.train import Trainer, label_smoothed_loss  # noqa: E402
from transformer_mt.vocab import PAD  # noqa: E402

SHARED = ROOT.parent / "shared"
MULTI30K = SHARED / "data" / "multi30k"
PEERS_KIT = SHARED / "peers"
PEERS_DIR = ROOT / ".peers"
BENCH_RUN = ROOT / "runs" / "bench"

# The peers' model: 3+3 layers, d 256, 4 heads, FFN 1024, pre-norm, all embeddings tied, dropout 0.1
# everywhere, Adam (0.9, 0.98), warm-up 200 to a 1e-3 peak (Noam factor 1e-3 * sqrt(256 * 200)).
BENCH_CONFIG = {
    "data": {
        "src_lang": "en",
        "tgt_lang": "de",
        "train": str(MULTI30K / "train"),
        "valid": str(MULTI30K / "val"),
        "test": str(MULTI30K / "test_2016_flickr"),
        "max_len": 128,
    },
    "tokenizer": {"type": "unigram", "vocab_size": 8000, "joint": True},
    "model": {
        "d_model": 256,
        "heads": 4,
        "encoder_layers": 3,
        "decoder_layers": 3,
        "d_ff": 1024,
        "norm": "pre",
        "dropout": 0.1,
        "attention_dropout": 0.1,
        "activation_dropout": 0.1,
        "tie_embeddings": True,
    },
    "train": {
        "max_tokens": 4096,
        "warmup": 200,
        "lr_factor": 1e-3 * math.sqrt(256 * 200),
        "clip_norm": 0.0,
        "seed": 42,
        "threads": 2,
        "valid_bleu": False,
    },
    "decode": {"beam": 4, "alpha": 1.0, "max_len_a": 1.2, "max_len_b": 10},
    "output_dir": str(BENCH_RUN),
}


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def evaluate_test(checkpoint: Path, *flags: str) -> dict:
    """`tmt evaluate --json` of a checkpoint (or run directory) on test_2016_flickr with extra
    flags; raises CalledProcessError (with the stderr) when it fails."""
    test = MULTI30K / "test_2016_flickr"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "transformer_mt",
            "evaluate",
            "--checkpoint",
            str(checkpoint),
            "--src",
            f"{test}.en.gz",
            "--ref",
            f"{test}.de.gz",
            "--json",
            *flags,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


# --------------------------------------------------------------------------- FLOPs and the matmul
# ceiling


def matmul_peak(seconds: float) -> dict[str, float]:
    """Sustained torch.mm GFLOP/s (max over the model's shapes), fp32 and bf16."""
    shapes = [
        (4096, 256, 1024),
        (4096, 1024, 256),
        (4096, 256, 768),
        (4096, 256, 256),
        (4096, 256, 8000),
    ]
    cpu = torch.device("cpu")
    return {
        name: round(
            max(matmul_gflops(cpu, DTYPES[name], m, k, n, seconds) for m, k, n in shapes), 1
        )
        for name in ("fp32", "bf16")
    }


# --------------------------------------------------------------------------- the plain-PyTorch
# reference


class Reference(nn.Module):
    """The peers' plain loop: torch.nn.Transformer (pre-norm) with one shared embedding, sinusoidal
    positions and a tied output projection, dropout 0.1 — as ../shared/peers/torch_reference.py."""

    def __init__(self, vocab: int, d=256, h=4, layers=3, ff=1024, p=0.1):
        super().__init__()
        self.d = d
        self.emb = nn.Embedding(vocab, d, padding_idx=PAD)
        nn.init.normal_(self.emb.weight, 0, d**-0.5)
        self.tf = nn.Transformer(d, h, layers, layers, ff, p, batch_first=True, norm_first=True)
        self.drop = nn.Dropout(p)
        pos = torch.arange(1024).unsqueeze(1)
        div = torch.exp(torch.arange(0, d, 2) * (-math.log(10000.0) / d))
        pe = torch.zeros(1024, d)
        pe[:, 0::2], pe[:, 1::2] = torch.sin(pos * div), torch.cos(pos * div)
        self.register_buffer("pe", pe)

    def forward(self, src, tgt_in):
        def embed(x):
            return self.drop(self.emb(x) * math.sqrt(self.d) + self.pe[: x.size(1)])

        T = tgt_in.size(1)
        causal = torch.triu(torch.full((T, T), float("-inf")), 1)
        h = self.tf(
            embed(src),
            embed(tgt_in),
            tgt_mask=causal,
            src_key_padding_mask=src == PAD,
            tgt_key_padding_mask=tgt_in == PAD,
            memory_key_padding_mask=src == PAD,
        )
        return h @ self.emb.weight.t()


def reference_step_fn(vocab: int, bf16: bool):
    torch.manual_seed(42)
    model = Reference(vocab).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))

    def step(batch: Batch) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch.src, batch.tgt_in)
        loss = label_smoothed_loss(logits, batch.tgt_out, 0.1)
        opt.zero_grad(set_to_none=True)
        (loss / batch.n_tgt_tokens).backward()
        opt.step()

    return step


def ours_step_fn(trainer_cfg, precision: str):
    cfg = config_from_dict(
        {**trainer_cfg, "train": {**trainer_cfg["train"], "precision": precision}}
    )
    trainer = Trainer(cfg)

    def step(batch: Batch) -> None:
        trainer.train_step([batch])

    return step, trainer


def ablation(trainer_cfg, what: str):
    """Ours in bf16 with one optimisation undone, to show what it gives."""
    step, trainer = ours_step_fn(trainer_cfg, "bf16")
    model = trainer.model
    if what == "torch_dropout":  # F.dropout: one CPU random draw per element
        for m in model.modules():
            if type(m).__name__ == "Dropout" and hasattr(m, "threshold"):
                m.forward = lambda x, m=m: torch.nn.functional.dropout(x, m.p, m.training)
    return step


def interleaved_windows(
    contenders: dict, batches: list[Batch], warmup: int, window: int = 10
) -> dict[str, list[float]]:
    """Target tokens/s of each contender over the same windows of `window` batches, the contenders
    taking turns window by window: a slow spell on the shared machine then hits all of them, not
    one."""
    for step in contenders.values():
        for b in batches[:warmup]:
            step(b)
    speeds: dict[str, list[float]] = {name: [] for name in contenders}
    timed = batches[warmup:]
    for i in range(0, len(timed) - window + 1, window):
        chunk = timed[i : i + window]
        tokens = sum(b.n_tgt_tokens for b in chunk)
        for name, step in contenders.items():
            t0 = time.perf_counter()
            for b in chunk:
                step(b)
            speeds[name].append(tokens / (time.perf_counter() - t0))
    return speeds


def time_windows(step, batches: list[Batch], warmup: int, window: int = 10) -> list[float]:
    """Target tokens/s of consecutive `window`-step windows after `warmup` untimed steps.

    Collation is done beforehand for both sides alike; the loss is read once per window.
    """
    for b in batches[:warmup]:
        step(b)
    speeds = []
    timed = batches[warmup:]
    for i in range(0, len(timed) - window + 1, window):
        chunk = timed[i : i + window]
        t0 = time.perf_counter()
        for b in chunk:
            step(b)
        speeds.append(sum(b.n_tgt_tokens for b in chunk) / (time.perf_counter() - t0))
    return speeds


# --------------------------------------------------------------------------- peers


def run_peer(script: str, *args: str, timeout: int = 1800) -> dict[str, str] | None:
    """Run one of the kit's scripts from the project root; return its RESULT line as a dict."""
    cmd = ["bash", str(PEERS_KIT / script), *args]
    log(" ".join(cmd))
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        log(f"{script} timed out")
        return None
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        log(f"{script} failed (exit {out.returncode}): {out.stderr.strip()[-300:]}")
        return None
    return dict(kv.split("=", 1) for kv in lines[-1].split()[1:])


def peers_ready() -> bool:
    return PEERS_KIT.is_dir() and (PEERS_DIR / "data" / ".prepared").exists()


def decode_side_by_side(minutes: int, rounds: int) -> dict | None:
    """Beam-4 decoding of test_2016_flickr by every engine and precision (bench_decode.py) and by
    fairseq-generate, interleaved `rounds` times, same 64-sentence batches, 2 threads; medians. Ours
    decodes the model `make bench-quality` trained for `minutes` (else the recipe's run), fairseq
    its budget model."""
    from bench_decode import decode_engines

    ours = ROOT / "runs" / f"budget_{minutes}min"
    if not (ours / "checkpoints" / "best.pt").exists():
        ours = ROOT / "runs" / "multi30k_en_de"
    if not (ours / "checkpoints" / "best.pt").exists():
        return None
    fs_ckpt = (
        PEERS_DIR / "runs" / f"fairseq_budget_{minutes}min" / "checkpoints" / "checkpoint_last.pt"
    )
    fairseq = (
        (lambda: run_peer("decode_speed.sh", "fairseq", str(fs_ckpt), "64"))
        if fs_ckpt.exists()
        else None
    )
    if fairseq is None:
        log(
            f"no fairseq model at {fs_ckpt} (make bench-quality trains it): decoding without "
            "fairseq-generate"
        )
    test = MULTI30K / "test_2016_flickr"
    d = decode_engines(
        ours / "checkpoints" / "best.pt",
        Path(f"{test}.en.gz"),
        Path(f"{test}.de.gz"),
        rounds,
        log,
        batch=64,
        threads=2,
        fairseq=fairseq,
    )
    for v in d.values():
        v["model"] = (
            str(fs_ckpt.relative_to(ROOT))
            if v["engine"] == "fairseq-generate"
            else str((ours / "checkpoints" / "best.pt").relative_to(ROOT))
        )
    return d


# --------------------------------------------------------------------------- scaling


def decode_cost_by_length(trainer: Trainer, lengths: list[int], batch: int = 16) -> list[dict]:
    """Milliseconds per generated token when forcing outputs of each length, with the KV cache."""
    model = trainer.model.eval()
    src = torch.randint(4, trainer.tokenizer.src_vocab_size, (batch, 20))
    rows = []
    with torch.inference_mode():
        memory, mask = model.encode(src)
        for n in lengths:
            cache = model.new_cache()
            tok = torch.full((batch, 1), 2)
            t0 = time.perf_counter()
            for _ in range(n):
                logp = model.decode_step(tok, memory, mask, cache)
                tok = logp.argmax(-1, keepdim=True)
            dt = time.perf_counter() - t0
            rows.append(
                {"length": n, "ms_per_token": round(1000 * dt / n, 3), "seconds": round(dt, 3)}
            )
    model.train()
    return rows


# --------------------------------------------------------------------------- report


def fastest_sentence(res: dict) -> str:
    """Ours at its fastest precision on this CPU against fairseq (which trains in fp32 on a CPU),
    from the figures."""
    fs = res.get("peers", {}).get("fairseq", {}).get("tok_s")
    ours = {
        k: v["tok_s"]
        for k, v in res["training"].items()
        if k.startswith("ours_") and "without" not in k
    }
    if not fs or not ours:
        return ""
    best = max(ours, key=ours.get)
    return (
        "At the precision each toolkit trains fastest in on this CPU: ours "
        f"{best.removeprefix('ours_')} "
        f"{ours[best]:,.0f} target tok/s, fairseq fp32 {fs:,.0f}: {ours[best] / fs:.2f}× fairseq."
    )


def ceiling_sentence(res: dict) -> str:
    """How the two matmul ceilings compare on this CPU, and what runs its bf16 products, from the
    run's figures."""
    peak, unit = res["matmul_gflops"], res.get("cpu_bf16")
    what = {
        "AMX": "its AMX tiles",
        "AVX512-BF16": "AVX512-BF16, no AMX",
        "none": "no bf16 matrix instructions",
    }
    return (
        f"On this CPU ({what.get(unit, 'bf16 support not recorded')}) the bf16 ceiling is "
        f"{peak['bf16'] / peak['fp32']:.1f}× the fp32 one, so the table gives MFU against both."
    )


def write_report(res: dict, path: Path) -> None:
    t = res["training"]
    peak = res["matmul_gflops"]
    lines = [
        "## Speed",
        "",
        f"Written by `make bench` (`scripts/bench.py`) on {res['date']}: {res['machine']}, torch "
        f"{res['torch']}, "
        f"{res['threads']} threads. Figures drift between runs on these shared machines: compare "
        "the ratios, "
        "which come from one run with every contender on the same batches.",
        "",
        "### Training throughput (Multi30k En→De, the peers' model)",
        "",
        "Model: 3+3 layers, d_model 256, 4 heads, FFN 1024, pre-norm, tied joint 8k SentencePiece "
        "vocabulary, "
        "dropout 0.1 (residual, attention, activation). Batches: ~4,096 tokens (sentences × "
        "longest side), "
        f"length-bucketed; padding {res['padding']['src']:.1%} of source and "
        f"{res['padding']['tgt']:.1%} of target "
        f"positions. {res['steps']} timed steps after {res['warmup']} warm-up in each of "
        f"{res['rounds']} rounds; "
        "ours and the reference take turns every 10 steps on the same batches, and the figure is "
        "the median "
        "10-step window. The peers run once a round, after ours.",
        "",
        "| contender | target tok/s | × plain nn.Transformer fp32 | × fairseq | × JoeyNMT | model "
        "GFLOP/s | MFU vs bf16 ceiling | vs fp32 ceiling |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ref = t.get("reference_fp32", {}).get("tok_s")
    fs = res.get("peers", {}).get("fairseq", {}).get("tok_s")
    jy = res.get("peers", {}).get("joey", {}).get("tok_s")
    rows = [(k, v) for k, v in t.items()] + [
        (f"peer_{k}", v) for k, v in res.get("peers", {}).items()
    ]
    for name, v in rows:
        tok = v.get("tok_s")
        if tok is None:
            continue
        gf = tok * res["flops_per_tgt_token"] / 1e9
        lines.append(
            f"| {name} | {tok:,.0f} | {_ratio(tok, ref)} | {_ratio(tok, fs)} | {_ratio(tok, jy)} | "
            f"{gf:,.0f} | {gf / peak['bf16']:.0%} | {gf / peak['fp32']:.0%} |"
        )
    lines += [
        "",
        "Matmul ceiling measured in the same run (torch.mm, max over the model's shapes): fp32 "
        f"{peak['fp32']:,.0f}, "
        f"bf16 {peak['bf16']:,.0f} GFLOP/s. FLOPs: {res['flops_per_tgt_token'] / 1e6:.1f} M per "
        "target token, "
        "counted on real tokens (2 per multiply-add of each weight matrix a token meets, plus "
        "attention "
        "scores and sums, the causal half for decoder self-attention; training = 3 × forward; "
        "`Transformer.train_flops`). "
        + ceiling_sentence(res)
        + " Peers: the kit's `train_throughput.sh` (their "
        "own batches of the same size and data), median of the rounds: "
        + "; ".join(
            f"{p} {', '.join(f'{x:,.0f}' for x in v.get('runs', [v['tok_s']]))}"
            for p, v in res.get("peers", {}).items()
        )
        + "."
        if res.get("peers")
        else "",
        "",
        fastest_sentence(res),
        "",
        "Ratios window by window (the same batches, run one after the other), median over the "
        "windows: "
        + ", ".join(f"{k} {v:.2f}×" for k, v in res.get("window_ratios", {}).items())
        + "."
        if res.get("window_ratios")
        else "",
        "",
        f"Peak RSS of the bench process: {res['peak_rss_mb']:,.0f} MiB.",
        "",
        "### Tokens/s against batch size (ours, bf16)",
        "",
        "| max_tokens | target tok/s | sentences/batch |",
        "| ---: | ---: | ---: |",
    ]
    for row in res["batch_scaling"]:
        lines.append(f"| {row['max_tokens']:,} | {row['tok_s']:,.0f} | {row['sentences']:.0f} |")
    lines += [
        "",
        "### Decoding cost against output length (KV cache, 16 sentences, greedy, forced length)",
        "",
        "| output tokens | ms per decoding step | total s |",
        "| ---: | ---: | ---: |",
    ]
    for row in res["decode_scaling"]:
        lines.append(f"| {row['length']} | {row['ms_per_token']:.2f} | {row['seconds']:.2f} |")
    lines += ["", decode_scaling_sentence(res["decode_scaling"]), ""]
    if res.get("decoding"):
        lines += decoding_table(res)
    for note in res.get("notes", []):
        lines.append(f"- {note}")
    replace_section(path, "speed", "\n".join(lines))


def decode_scaling_sentence(rows: list[dict]) -> str:
    """What the decode-scaling figures say, computed from them: the step cost at the longest output
    over the shortest, flat only when within 1.5x (a KV cache attends over cached keys instead of
    re-running the prefix, so the step cost grows only with the attention over the longer cache)."""
    first, last = rows[0], rows[-1]
    ratio = last["ms_per_token"] / first["ms_per_token"]
    verdict = "about flat" if ratio <= 1.5 else "growing with the output"
    return (
        f"A decoding step at {last['length']} output tokens costs {ratio:.2f}× one at "
        f"{first['length']} "
        f"({last['length'] / first['length']:.0f}× the length): {verdict}."
    )


def decoding_table(res: dict) -> list[str]:
    """The engines-and-precisions decoding table (issue 15) and what its figures say."""
    from bench_decode import conclusions

    d = res["decoding"]
    fs, ct2 = d.get("fairseq", {}).get("sent_s"), d.get("ctranslate2 int8", {}).get("sent_s")
    rounds = max(len(v["runs"]) for v in d.values())
    lines = [
        "### Beam-4 decoding of test_2016_flickr (1,000 sentences), every engine and precision",
        "",
        f"Median of {rounds} interleaved "
        f"rounds{' on ' + res['decoding_date'] if res.get('decoding_date') else ''}"
        f" on {res.get('decoding_cpu', 'this CPU')}: every contender decodes the same batches (the "
        "sources sorted by length, 64 sentences a batch, as fairseq-generate's --batch-size 64), 2 "
        "threads, "
        "beam 4, at most 200 output tokens, model loading excluded; each run is its own process "
        "(peak RSS its "
        "own). Length penalty 1.0 by each toolkit's formula: GNMT ((5 + |Y|) / 6)^α for ours and "
        "for "
        "CTranslate2 through tmt (which re-ranks CTranslate2's finished hypotheses with it), |Y|^α "
        "for fairseq.",
        "",
        "| contender | engine | precision | sentences/s | runs | × fairseq | × CTranslate2 int8 | "
        "peak RSS MB | "
        "BLEU | model | signature |",
        "| --- | --- | --- | ---: | --- | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    stale = False
    for name, v in d.items():
        # Rows our engines measured before issue 22 carry the bench process's peak (ru_maxrss of an
        # exec'd child inherits its parent's), not their own: not shown. fairseq's comes from the
        # peers kit's own measurement.
        own = v.get("rss_of") == "self" or v.get("engine") == "fairseq-generate"
        stale |= not own
        rss = v.get("peak_rss_mb", "") if own else "–*"
        lines.append(
            f"| {name} | {v.get('engine', '')} | {v.get('precision', '')} | {v['sent_s']:.1f} | "
            f"{', '.join(f'{x:.1f}' for x in v['runs'])} | {_ratio(v['sent_s'], fs)} | "
            f"{_ratio(v['sent_s'], ct2)} | "
            f"{rss} | {v.get('bleu', '')} | `{v.get('model', '')}` | `{v.get('signature', '')}` |"
        )
    if stale:
        lines += [
            "",
            "\\* Peak RSS not shown: these rows were measured before each contender reported its "
            "own peak "
            "(the figure then was the bench process's); the next `make bench` measures it.",
        ]
    if fs is None:
        lines += [
            "",
            "fairseq-generate did not run: no fairseq model of the same budget was there "
            "(`make bench-quality` trains one).",
        ]
    return lines + [""] + [f"- {c}" for c in conclusions(d)] + [""]


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "–"


# --------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every contender")
    ap.add_argument(
        "--steps", type=int, default=30, help="timed training steps per contender and round"
    )
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument(
        "--peer-updates", type=int, default=60, help="updates for each peer's throughput run"
    )
    ap.add_argument("--no-peers", action="store_true", help="skip fairseq and JoeyNMT")
    ap.add_argument(
        "--decode-minutes",
        type=int,
        default=20,
        help="compare decoding on the models that make bench-quality trained for this many minutes",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: 1 round, 10 steps, no peers")
    ap.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"))
    ap.add_argument("--json", default=str(ROOT / "bench.json"))
    ap.add_argument(
        "--report-only", action="store_true", help="rewrite BENCHMARKS.md from an existing --json"
    )
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="re-run only the decoding comparison, updating an existing --json and BENCHMARKS.md",
    )
    args = ap.parse_args()
    if args.report_only:
        write_report(json.loads(Path(args.json).read_text()), Path(args.out))
        return 0
    if args.decode_only:  # re-measure the decoding comparison only, keeping the rest of --json
        res = json.loads(Path(args.json).read_text())
        res["decoding"] = decode_side_by_side(args.decode_minutes, args.rounds + 1)
        res["decoding_minutes"], res["decoding_date"] = (
            args.decode_minutes,
            time.strftime("%Y-%m-%d %H:%M"),
        )
        res["decoding_cpu"] = cpu_model()
        Path(args.json).write_text(json.dumps(res, indent=2), encoding="utf-8")
        write_report(res, Path(args.out))
        return 0
    if args.quick:
        args.rounds, args.steps, args.warmup, args.no_peers = 1, 10, 2, True
    torch.set_num_threads(2)
    if not (MULTI30K / "train.en.gz").exists():
        log(f"skipped: the benchmark corpus {MULTI30K} is not here (it ships in ../shared)")
        return 0

    cpu = cpu_model()
    res: dict = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu,
        "cpu_bf16": cpu_bf16(),
        "machine": f"{cpu}, {platform.machine()} {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "notes": [],
    }
    log("matmul ceiling")
    res["matmul_gflops"] = matmul_peak(0.5 if args.quick else 1.5)

    log("building ours (tokenizer and cached corpus under runs/bench)")
    step_fp32, trainer = ours_step_fn(BENCH_CONFIG, "fp32")
    step_bf16, _ = ours_step_fn(BENCH_CONFIG, "bf16")
    step_bf16_output, _ = ours_step_fn(BENCH_CONFIG, "bf16-output")
    vocab = trainer.tokenizer.tgt_vocab_size
    need = args.warmup + args.steps
    batches = [collate(trainer.data.train, b) for b in trainer.batches.epoch(1)[:need]]
    real_s = sum(b.n_src_tokens for b in batches)
    real_t = sum(b.n_tgt_tokens for b in batches)
    res["padding"] = {
        "src": 1 - real_s / sum(b.src.numel() for b in batches),
        "tgt": 1 - real_t / sum(b.tgt_out.numel() for b in batches),
    }
    flops = sum(trainer.model.train_flops(b.src, b.tgt_out) for b in batches)
    res["flops_per_tgt_token"] = flops / real_t
    contenders = {
        "ours_fp32": step_fp32,
        "ours_bf16": step_bf16,
        "ours_bf16-output": step_bf16_output,
        "reference_fp32": reference_step_fn(vocab, False),
        "reference_bf16": reference_step_fn(vocab, True),
    }
    if not args.quick:  # what each optimisation gives: ours in bf16 with it undone
        contenders["ours_bf16_without_fast_dropout"] = ablation(BENCH_CONFIG, "torch_dropout")
    peers = [] if args.no_peers or not peers_ready() else ["fairseq", "joey"]
    windows: dict[str, list[float]] = {k: [] for k in contenders}
    peer_runs: dict[str, list[dict]] = {p: [] for p in peers}
    # ours and the reference window by window, then each peer, every round
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}: {', '.join(contenders)}, window by window")
        for name, v in interleaved_windows(contenders, batches, args.warmup).items():
            windows[name] += v
        for peer in peers:
            out = run_peer("train_throughput.sh", peer, str(args.peer_updates))
            if out:
                peer_runs[peer].append(out)
    res["training"] = {
        k: {"tok_s": statistics.median(v), "windows": [round(x) for x in v]}
        for k, v in windows.items()
    }
    # Ratios window by window (the same batches at the same moment), medians: steadier than ratios
    # of medians.
    res["window_ratios"] = {
        f"{a}/{b}": statistics.median(x / y for x, y in zip(windows[a], windows[b]))
        for a, b in (
            ("ours_bf16", "reference_fp32"),
            ("ours_bf16", "reference_bf16"),
            ("ours_bf16", "ours_fp32"),
            ("ours_bf16-output", "ours_fp32"),
        )
    }
    if peers:
        res["peers"] = {
            p: {
                "tok_s": statistics.median(float(o["tgt_tok_per_s"]) for o in runs),
                "runs": [float(o["tgt_tok_per_s"]) for o in runs],
                "peak_rss_mb": runs[-1].get("peak_rss_mb"),
            }
            for p, runs in peer_runs.items()
            if runs
        }

    log("tokens/s against batch size")
    res["batch_scaling"] = []
    tr_idx = trainer.data.train_idx
    for mt in (1024, 2048, 4096, 8192, 16384):
        order = make_batches(
            trainer.data.train.src_lens[tr_idx],
            trainer.data.train.tgt_lens[tr_idx],
            mt,
            seed=42,
            epoch=1,
        )
        n = max(3, min(12, int(12 * 4096 / mt)))  # about the same number of tokens at every size
        bs = [collate(trainer.data.train, tr_idx[b]) for b in order[: n + 2]]
        res["batch_scaling"].append(
            {
                "max_tokens": mt,
                "tok_s": time_windows(step_bf16, bs, 2, window=n)[0],
                "sentences": statistics.mean(b.src.size(0) for b in bs),
            }
        )
    log("decoding cost against length")
    res["decode_scaling"] = decode_cost_by_length(trainer, [10, 25, 50, 100, 200])

    if not args.no_peers:
        if peers:
            log("beam-4 decoding side by side (models from make bench-quality)")
            res["decoding"] = decode_side_by_side(args.decode_minutes, args.rounds + 1)
            res["decoding_minutes"], res["decoding_cpu"] = args.decode_minutes, cpu_model()
            if res["decoding"] is None:
                res["notes"].append(
                    f"decoding not compared: run `make bench-quality` first (it trains ours and "
                    f"fairseq for {args.decode_minutes} minutes each)"
                )
        else:
            res["notes"].append(
                "peers not measured: run `bash ../shared/peers/setup.sh` once (see its README)"
            )
    res["peak_rss_mb"] = peak_rss_mb()
    Path(args.json).write_text(json.dumps(res, indent=2), encoding="utf-8")
    write_report(res, Path(args.out))
    log(f"wrote {args.out} and {args.json}")
    for k, v in res["training"].items():
        log(f"{k}: {v['tok_s']:,.0f} tgt tok/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
