"""`make bench`: training and decoding speed, side by side with the peers, into the `speed` section
of BENCHMARKS.md and bench.json.

Measured in one run on one machine (these machines are shared and noisy: read the ratios):
  - the matmul ceiling (fp32, bf16) on the model's shapes;
  - training target tokens/s of ours (fp32, bf16 autocast, bf16-output, and bf16 with torch's
    dropout instead of ours) and of a plain torch.nn.Transformer loop (fp32, bf16) on the same
    batches, taking turns every 10 steps; medians of the 10-step windows. Where bf16 is emulated
    (no AVX512-BF16 or AMX: 10-20x slower than fp32) only the fp32 rows are timed, the ablation in
    fp32: an AVX2-only CPU would spend most of an hour on rows no toolkit would train in;
  - fairseq and JoeyNMT through ../shared/peers, once a round (skipped when the kit is absent);
  - tokens/s against batch size, and decoding cost per token against output length (KV cache);
  - beam-4 decoding of test_2016_flickr by every engine and precision (scripts.bench_decode) and by
    fairseq-generate, on models trained for the same budget by `make bench-quality`;
  - with --avx2, the training table's fp32 rows and fairseq again in a child process with AVX2
    kernels only (benchlib.AVX2_ONLY): an AVX2-only CPU, where bf16 is emulated, approximated
    (on a CPU without AVX-512 the native rows are already that, and no child runs).

usage: python -m scripts.bench [--rounds 2] [--steps 30] [--no-peers] [--quick] [--avx2]
       [--set KEY=VALUE]
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch import nn

from scripts.bench_decode import conclusions, decode_engines
from scripts.benchlib import (
    AVX2_ONLY,
    BENCHMARKS,
    MULTI30K,
    PEERS_DIR,
    ROOT,
    TEST_PREFIX,
    avx2_description,
    cpu_bf16,
    cpu_model,
    logger,
    md_table,
    now,
    peak_rss_mb,
    peers_ready,
    ratio,
    read_json,
    reported_flags,
    run_peer,
    src_ref_files,
    write_json,
    write_section,
)
from scripts.benchlib.training import (
    BenchData,
    Step,
    training_step,
    window_speeds,
    with_torch_dropout,
)
from transformer_mt.config import Config, apply_override, config_from_dict
from transformer_mt.data import Batch, DataError, text_file
from transformer_mt.model import Transformer, label_smoothed_loss
from transformer_mt.prepare import set_up_attention
from transformer_mt.runtime import (
    DTYPES,
    cpu_bf16_obstacle,
    cpu_flags,
    matmul_gflops,
    set_threads,
)
from transformer_mt.vocab import PAD

log = logger("bench")

# The peers' model: 3+3 layers, d 256, 4 heads, FFN 1024, pre-norm, all embeddings tied, dropout 0.1
# everywhere, Adam (0.9, 0.98), warm-up 200 to a 1e-3 peak (Noam factor 1e-3 * sqrt(256 * 200)).
BENCH_CONFIG = {
    "data": {
        "src_lang": "en",
        "tgt_lang": "de",
        "train": str(MULTI30K / "train"),
        "valid": str(MULTI30K / "val"),
        "test": str(TEST_PREFIX),
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
    "output_dir": str(ROOT / "runs" / "bench"),
}
# Ours against fairseq in training throughput, each at the precision it trains fastest in on the CPU
# at hand (issue 25's target): the report says whether it is met, and by how much it falls short.
TARGET_X_FAIRSEQ = 2.0
# where the bench's training steps run
CPU = torch.device("cpu")
# Window by window ratios the report gives (those of contenders that ran): (contender, baseline)
RATIOS = (
    ("ours_fp32", "reference_fp32"),
    ("ours_bf16", "reference_fp32"),
    ("ours_bf16", "reference_bf16"),
    ("ours_bf16", "ours_fp32"),
    ("ours_bf16-output", "ours_fp32"),
)


def bench_config(overrides: list[str]) -> Config:
    """BENCH_CONFIG with `--set KEY=VALUE` overrides."""
    raw = copy.deepcopy(BENCH_CONFIG)
    for item in overrides:
        apply_override(raw, item)
    return config_from_dict(raw, source="scripts/bench.py BENCH_CONFIG")


def matmul_peak(cfg: Config, seconds: float) -> dict[str, float]:
    """Sustained torch.mm GFLOP/s, fp32 and bf16: the best of the model's own shapes (a batch of
    train.max_tokens rows against its attention, feed-forward and output projections)."""
    n, d, vocab = cfg.train.max_tokens, cfg.model.d_model, cfg.tokenizer.vocab_size
    shapes = [
        (n, d, cfg.model.d_ff),
        (n, cfg.model.d_ff, d),
        (n, d, 3 * d),
        (n, d, d),
        (n, d, vocab),
    ]
    cpu = torch.device("cpu")
    return {
        name: round(max(matmul_gflops(cpu, DTYPES[name], *s, seconds) for s in shapes), 1)
        for name in ("fp32", "bf16")
    }


# --------------------------------------------------------------------------- the contenders


class Reference(nn.Module):
    """The peers' plain loop: torch.nn.Transformer (pre-norm) with one shared embedding, sinusoidal
    positions and a tied output projection, dropout 0.1 on residuals, attention and activations
    (nn.Transformer's one `dropout`, as ours is configured) — as ../shared/peers/torch_reference.py.
    """

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


def reference_step(vocab: int, cfg: Config, bf16: bool) -> Step:
    """One update of the plain loop: Adam at a constant rate, the same loss."""
    torch.manual_seed(cfg.train.seed)
    m = cfg.model
    model = Reference(vocab, m.d_model, m.heads, m.encoder_layers, m.d_ff, m.dropout).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98))

    def step(batch: Batch) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(batch.src, batch.tgt_in)
        loss = label_smoothed_loss(logits, batch.tgt_out, cfg.train.label_smoothing)
        opt.zero_grad(set_to_none=True)
        (loss / batch.n_tgt_tokens).backward()
        opt.step()
        return loss.detach()

    return step


def contenders(
    bench: BenchData, cfg: Config, ablation: bool, bf16: bool = True
) -> tuple[dict[str, Step], dict, dict[str, str]]:
    """Every training step the table compares (same seed, same batches), our models by precision,
    and the attention kernel each of ours runs (train.attention resolved as the loop does it);
    without `bf16` (emulated on this CPU) the fp32 ones only."""
    precisions = ("fp32", "bf16", "bf16-output") if bf16 else ("fp32",)
    ours = {p: bench.model(cfg, cfg.train.seed) for p in precisions}
    kernels = {p: set_up_attention(m, cfg.train, CPU, p) for p, m in ours.items()}
    steps = {f"ours_{p}": training_step(m, cfg.train, p, kernels[p]) for p, m in ours.items()}
    vocab = bench.tokenizer.tgt_vocab_size
    steps["reference_fp32"] = reference_step(vocab, cfg, bf16=False)
    if bf16:
        steps["reference_bf16"] = reference_step(vocab, cfg, bf16=True)
    if ablation:  # what our dropout gives: ours at its fastest precision here with torch's
        fastest = "bf16" if bf16 else "fp32"
        model = with_torch_dropout(bench.model(cfg, cfg.train.seed))
        steps[f"ours_{fastest}_without_fast_dropout"] = training_step(
            model, cfg.train, fastest, kernels[fastest]
        )
    return steps, ours, kernels


def native_avx2_only() -> str:
    """Why this process's own kernels already are what --avx2's child would run ("" when they
    are not): a CPU without AVX-512, or the AVX2-only variables set (benchlib.AVX2_ONLY)."""
    if "avx512f" not in cpu_flags():
        return "the CPU has no AVX-512"
    if all(os.environ.get(k, "").lower() == v.lower() for k, v in AVX2_ONLY.items()):
        return "the AVX2-only variables are set"
    return ""


# --------------------------------------------------------------------------- measurements


def batch_figures(batches: list[Batch], model: Transformer) -> dict:
    """The padding share of the timed batches and the model's FLOPs per real target token."""
    real_s = sum(b.n_src_tokens for b in batches)
    real_t = sum(b.n_tgt_tokens for b in batches)
    return {
        "padding": {
            "src": 1 - real_s / sum(b.src.numel() for b in batches),
            "tgt": 1 - real_t / sum(b.tgt_out.numel() for b in batches),
        },
        "flops_per_tgt_token": sum(model.train_flops(b.src, b.tgt_out) for b in batches) / real_t,
    }


def training_rounds(
    steps: dict[str, Step], batches: list[Batch], args: argparse.Namespace, peers: list[str]
) -> dict:
    """Ours and the reference window by window, then each peer, every round; medians and the
    window-by-window ratios (the same batches at the same moment: steadier than ratios of
    medians)."""
    windows: dict[str, list[float]] = {k: [] for k in steps}
    peer_runs: dict[str, list[dict]] = {p: [] for p in peers}
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}: {', '.join(steps)}, window by window")
        for name, v in window_speeds(steps, batches, args.warmup).items():
            windows[name] += v
        for peer in peers:
            out = run_peer("train_throughput.sh", peer, str(args.peer_updates))
            if out:
                peer_runs[peer].append(out)
    res: dict = {
        "training": {
            k: {"tok_s": statistics.median(v), "windows": [round(x) for x in v]}
            for k, v in windows.items()
        },
        "window_ratios": {
            f"{a}/{b}": statistics.median(x / y for x, y in zip(windows[a], windows[b]))
            for a, b in RATIOS
            if a in windows and b in windows
        },
    }
    runs = {p: [float(o["tgt_tok_per_s"]) for o in v] for p, v in peer_runs.items() if v}
    if runs:
        res["peers"] = {
            p: {
                "tok_s": statistics.median(runs[p]),
                "runs": runs[p],
                "peak_rss_mb": peer_runs[p][-1].get("peak_rss_mb"),
            }
            for p in runs
        }
    return res


def batch_scaling(bench: BenchData, cfg: Config, step: Step, sizes: list[int]) -> list[dict]:
    """Target tokens/s of one step function at each batch size, over about the same number of
    tokens at every size."""
    rows = []
    for mt in sizes:
        n = max(3, min(12, int(12 * 4096 / mt)))
        batches = bench.batches(mt, seed=cfg.train.seed, limit=n + 2)
        if len(batches) < 3:
            log(f"batch size {mt}: too few batches in the corpus, left out")
            continue
        n = min(n, len(batches) - 2)
        speed = window_speeds({"step": step}, batches, 2, window=n)["step"][0]
        sentences = statistics.mean(b.src.size(0) for b in batches)
        rows.append({"max_tokens": mt, "tok_s": speed, "sentences": sentences})
    return rows


def decode_cost_by_length(model: Transformer, vocab: int, lengths: list[int]) -> list[dict]:
    """Milliseconds per decoding step of 16 sentences when forcing outputs of each length, with
    the KV cache (greedy)."""
    model.eval()
    src = torch.randint(4, vocab, (16, 20))
    rows = []
    with torch.inference_mode():
        memory, mask = model.encode(src)
        for n in lengths:
            cache, tok = model.new_cache(), torch.full((16, 1), 2)
            t0 = time.perf_counter()
            for _ in range(n):
                tok = model.decode_step(tok, memory, mask, cache).argmax(-1, keepdim=True)
            dt = time.perf_counter() - t0
            rows.append(
                {"length": n, "ms_per_token": round(1000 * dt / n, 3), "seconds": round(dt, 3)}
            )
    model.train()
    return rows


def decode_side_by_side(minutes: int, rounds: int) -> dict | None:
    """Beam-4 decoding of test_2016_flickr by every engine and precision (scripts.bench_decode)
    and by fairseq-generate, interleaved `rounds` times. Ours decodes the model `make
    bench-quality` trained for `minutes` (else the recipe's run), fairseq its budget model."""
    ours = ROOT / "runs" / f"budget_{minutes}min" / "checkpoints" / "best.pt"
    if not ours.exists():
        ours = ROOT / "runs" / "multi30k_en_de" / "checkpoints" / "best.pt"
    if not ours.exists():
        return None
    fs = PEERS_DIR / "runs" / f"fairseq_budget_{minutes}min" / "checkpoints" / "checkpoint_last.pt"
    fairseq = (
        partial(run_peer, "decode_speed.sh", "fairseq", str(fs), "64") if fs.exists() else None
    )
    if fairseq is None:
        log(f"no fairseq model at {fs} (make bench-quality trains it): no fairseq-generate row")
    src, ref = src_ref_files(TEST_PREFIX)
    d = decode_engines(ours, src, ref, rounds, log, fairseq=fairseq)
    for v in d.values():
        model = fs if v["engine"] == "fairseq-generate" else ours
        v["model"] = str(model.relative_to(ROOT))
    return d


# --------------------------------------------------------------------------- report


def write_report(res: dict, path: Path) -> str:
    """The `speed` section, from the JSON alone."""
    scaling = md_table(
        ["max_tokens", "target tok/s", "sentences/batch"],
        [
            (f"{r['max_tokens']:,}", f"{r['tok_s']:,.0f}", f"{r['sentences']:.0f}")
            for r in res["batch_scaling"]
        ],
        "rrr",
    )
    lengths = md_table(
        ["output tokens", "ms per decoding step", "total s"],
        [
            (r["length"], f"{r['ms_per_token']:.2f}", f"{r['seconds']:.2f}")
            for r in res["decode_scaling"]
        ],
        "rrr",
    )
    return write_section(
        path,
        "speed",
        "## Speed",
        f"Written by `make bench` (`scripts/bench.py`) on {res['date']}: {res['machine']}"
        + (f" (flags {', '.join(res['cpu_flags'])})" if res.get("cpu_flags") else "")
        + f", torch {res['torch']}, {res['threads']} threads. Figures drift between runs on these "
        "shared machines: compare the ratios, which come from one run with every contender on the "
        "same batches.",
        "### Training throughput (Multi30k En→De, the peers' model)",
        training_setup(res),
        training_table(res),
        ceiling_paragraph(res),
        fastest_sentence(res),
        "Ratios window by window (the same batches, run one after the other), median over the "
        "windows: " + ", ".join(f"{k} {v:.2f}×" for k, v in res["window_ratios"].items()) + ".",
        f"Peak RSS of the bench process: {res['peak_rss_mb']:,.0f} MiB.",
        *avx2_blocks(res),
        f"### Tokens/s against batch size (ours, {res.get('batch_scaling_precision', 'bf16')})",
        scaling,
        "### Decoding cost against output length (KV cache, 16 sentences, greedy, forced length)",
        lengths,
        decode_scaling_sentence(res["decode_scaling"]),
        *(decoding_blocks(res) if res.get("decoding") else []),
        "\n".join(f"- {note}" for note in res.get("notes", [])),
    )


def training_setup(res: dict) -> str:
    """What trained, on what batches, and how it was timed."""
    m = res.get("model", BENCH_CONFIG["model"])
    vocab = res.get("vocab_size", BENCH_CONFIG["tokenizer"]["vocab_size"])
    return (
        f"Model: {m['encoder_layers']}+{m['decoder_layers']} layers, d_model {m['d_model']}, "
        f"{m['heads']} heads, FFN {m['d_ff']}, {m['norm']}-norm, tied joint {vocab:,}-piece "
        f"SentencePiece vocabulary, dropout {m['dropout']:g} (residual, attention, activation). "
        f"Batches: ~{res.get('max_tokens', 4096):,} tokens (sentences × longest side), "
        f"length-bucketed; padding {res['padding']['src']:.1%} of source and "
        f"{res['padding']['tgt']:.1%} of target positions. {res['steps']} timed steps after "
        f"{res['warmup']} warm-up in each of {res['rounds']} rounds; ours and the reference take "
        "turns every 10 steps on the same batches, and the figure is the median 10-step window. "
        f"The peers run once a round, after ours.{attention_sentence(res)}"
    )


def attention_sentence(res: dict) -> str:
    """Which attention kernel ours trained with in each precision (train.attention, auto timed at
    start-up as `tmt train` does); "" for a run from before the bench recorded it."""
    kernels = res.get("attention")
    if not kernels:
        return ""
    each = ", ".join(f"{kernel} in {precision}" for precision, kernel in kernels.items())
    return f" Ours' attention kernel (`train.attention`, resolved as `tmt train` does): {each}."


MFU_HEADS = {"bf16": "MFU vs bf16 ceiling", "fp32": "vs fp32 ceiling"}


def training_table(res: dict) -> str:
    """Every contender's tokens/s, against the reference and the peers, and its MFU."""
    peak, peers = res["matmul_gflops"], res.get("peers", {})
    ref = res["training"].get("reference_fp32", {}).get("tok_s")
    fs, jy = (peers.get(p, {}).get("tok_s") for p in ("fairseq", "joey"))
    # MFU against the bf16 ceiling only where bf16 runs in hardware: an emulated one means nothing
    ceilings = ["fp32"] if res.get("bf16_obstacle") else ["bf16", "fp32"]
    rows = []
    named = [*res["training"].items(), *((f"peer_{k}", v) for k, v in peers.items())]
    for name, v in named:
        tok = v["tok_s"]
        gf = tok * res["flops_per_tgt_token"] / 1e9
        mfu = [f"{gf / peak[c]:.0%}" for c in ceilings]
        rows.append(
            (
                name,
                f"{tok:,.0f}",
                ratio(tok, ref),
                ratio(tok, fs),
                ratio(tok, jy),
                f"{gf:,.0f}",
                *mfu,
            )
        )
    head = ["contender", "target tok/s", "× plain nn.Transformer fp32", "× fairseq", "× JoeyNMT"]
    head += ["model GFLOP/s", *(MFU_HEADS[c] for c in ceilings)]
    return md_table(head, rows, "l" + "r" * (len(head) - 1))


def ceiling_paragraph(res: dict) -> str:
    """The matmul ceilings and FLOP count behind the MFU columns, and the peers' own runs."""
    peak, peers = res["matmul_gflops"], res.get("peers")
    text = (
        "Matmul ceiling measured in the same run (torch.mm, max over the model's shapes): fp32 "
        f"{peak['fp32']:,.0f}, bf16 {peak['bf16']:,.0f} GFLOP/s. FLOPs: "
        f"{res['flops_per_tgt_token'] / 1e6:.1f} M per target token, counted on real tokens "
        "(`Transformer.train_flops`: 2 per multiply-add of each weight matrix a token meets, plus "
        "attention, the causal half for decoder self-attention; training = 3 × forward). "
        + ceiling_sentence(res)
    )
    if peers:
        runs = "; ".join(
            f"{p} {', '.join(f'{x:,.0f}' for x in v.get('runs', [v['tok_s']]))}"
            for p, v in peers.items()
        )
        text += (
            " Peers: the kit's `train_throughput.sh` (their own batches of the same size and "
            f"data), median of the rounds: {runs}."
        )
    return text


def ceiling_sentence(res: dict) -> str:
    """How the two matmul ceilings compare on this CPU, and what runs its bf16 products."""
    peak, unit = res["matmul_gflops"], res.get("cpu_bf16")
    what = {
        "AMX": "its AMX tiles",
        "AVX512-BF16": "AVX512-BF16, no AMX",
        "none": "no bf16 matrix instructions",
    }
    if res.get("bf16_obstacle"):
        return (
            f"On this CPU ({what.get(unit, 'bf16 support not recorded')}) bf16 is emulated "
            f"({res['bf16_obstacle']}): its ceiling is {peak['bf16'] / peak['fp32']:.2f}× the "
            "fp32 one, so the table gives MFU against the fp32 ceiling only."
        )
    return (
        f"On this CPU ({what.get(unit, 'bf16 support not recorded')}) the bf16 ceiling is "
        f"{peak['bf16'] / peak['fp32']:.1f}× the fp32 one, so the table gives MFU against both."
    )


def fairseq_tok_s(res: dict) -> float | None:
    """fairseq's median target tokens/s in a run's results (None where it was not measured)."""
    return res.get("peers", {}).get("fairseq", {}).get("tok_s")


def fastest_sentence(res: dict) -> str:
    """Ours at its fastest precision on this CPU against fairseq (which trains in fp32 on a
    CPU)."""
    fs = fairseq_tok_s(res)
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
        f"{best.removeprefix('ours_')} {ours[best]:,.0f} target tok/s, fairseq fp32 {fs:,.0f}: "
        f"{ours[best] / fs:.2f}× fairseq"
        + (" (target ≥ 2×: met)." if ours[best] >= TARGET_X_FAIRSEQ * fs else ".")
    )


def avx2_blocks(res: dict) -> list[str]:
    """The fp32 rows and fairseq measured again with AVX2 kernels only, and whether ours reaches
    the target there; if not, by how much it falls short and what the matmul ceiling allows."""
    if res.get("avx2_native"):  # the rows above are AVX2's already: the verdict on them
        fs = fairseq_tok_s(res)
        return [
            f"#### {avx2_description()}",
            f"Not measured again in a child process: {res['avx2_native']}, so this run's own "
            "kernels are the AVX2 ones and the table above is the AVX2-only measurement.",
            avx2_verdict(
                res["training"]["ours_fp32"]["tok_s"],
                fs,
                res["flops_per_tgt_token"],
                res["matmul_gflops"]["fp32"],
            ),
        ]
    a = res.get("avx2")
    if not a:
        return []
    peak, flops = a["matmul_gflops"]["fp32"], a["flops_per_tgt_token"]
    fs = fairseq_tok_s(a)
    named = [*a["training"].items(), *((f"peer_{k}", v) for k, v in a.get("peers", {}).items())]
    rows = [
        (name, f"{v['tok_s']:,.0f}", ratio(v["tok_s"], a["training"]["reference_fp32"]["tok_s"]))
        + (ratio(v["tok_s"], fs), f"{v['tok_s'] * flops / 1e9 / peak:.0%}")
        for name, v in named
    ]
    head = ["contender", "target tok/s", "× plain nn.Transformer fp32", "× fairseq"]
    return [
        f"#### The same, with {avx2_description()}",
        f"Measured in a child process of the same run ({a['date']}): torch dispatched "
        f"{a['kernels']} kernels; bf16 is not timed here ({a['bf16_obstacle'] or 'none'}: "
        f"emulated, so every toolkit trains in fp32). fp32 matmul ceiling under these kernels: "
        f"{peak:,.0f} GFLOP/s ({peak / res['matmul_gflops']['fp32']:.0%} of the native one)."
        + attention_sentence(a),
        md_table([*head, "vs fp32 ceiling"], rows, "lrrrr"),
        avx2_verdict(a["training"]["ours_fp32"]["tok_s"], fs, flops, peak),
    ]


def avx2_verdict(ours: float, fs: float | None, flops: float, peak: float) -> str:
    """Ours fp32 against fairseq fp32 under AVX2 kernels, against the target, from the figures."""
    if not fs:
        return "fairseq not measured (--no-peers, or the peers kit is not set up): no ratio."
    x = ours / fs
    text = f"With AVX2 kernels only, ours fp32 trains at {x:.2f}× fairseq fp32"
    if x >= TARGET_X_FAIRSEQ:
        return text + f" (target ≥ {TARGET_X_FAIRSEQ:g}×: met)."
    need = TARGET_X_FAIRSEQ * fs
    share = need * flops / 1e9 / peak
    return (
        text + f": short of the {TARGET_X_FAIRSEQ:g}× target, which needs {need:,.0f} target "
        f"tok/s, {need / ours - 1:.0%} more than ours. Why: ours runs at "
        f"{ours * flops / 1e9 / peak:.0%} of the fp32 matmul ceiling measured under the same "
        f"kernels and fairseq at {fs * flops / 1e9 / peak:.0%}; {TARGET_X_FAIRSEQ:g}× fairseq "
        f"would take {share:.0%} of it" + (", above the ceiling itself." if share > 1 else ".")
    )


def decode_scaling_sentence(rows: list[dict]) -> str:
    """The step cost at the longest output over the shortest, flat within 1.5× (a KV cache attends
    over cached keys instead of re-running the prefix, so only the attention grows)."""
    first, last = rows[0], rows[-1]
    r = last["ms_per_token"] / first["ms_per_token"]
    return (
        f"A decoding step at {last['length']} output tokens costs {r:.2f}× one at "
        f"{first['length']} ({last['length'] / first['length']:.0f}× the length): "
        f"{'about flat' if r <= 1.5 else 'growing with the output'}."
    )


def decoding_blocks(res: dict) -> list[str]:
    """The engines-and-precisions decoding table (issue 15) and what its figures say."""
    d = res["decoding"]
    fs, ct2 = d.get("fairseq", {}).get("sent_s"), d.get("ctranslate2 int8", {}).get("sent_s")
    rounds = max(len(v["runs"]) for v in d.values())
    when = f" on {res['decoding_date']}" if res.get("decoding_date") else ""
    rows, stale = [], False
    for name, v in d.items():
        # Rows our engines measured before issue 22 carry the bench process's peak (ru_maxrss of
        # an exec'd child inherits its parent's), not their own: not shown. fairseq's comes from
        # the peers kit's own measurement.
        own = v.get("rss_of") == "self" or v.get("engine") == "fairseq-generate"
        stale |= not own
        rows.append(
            (name, v.get("engine", ""), v.get("precision", ""), f"{v['sent_s']:.1f}")
            + (", ".join(f"{x:.1f}" for x in v["runs"]), ratio(v["sent_s"], fs))
            + (ratio(v["sent_s"], ct2), v.get("peak_rss_mb", "") if own else "–*")
            + (v.get("bleu", ""), f"`{v.get('model', '')}`", f"`{v.get('signature', '')}`")
        )
    head = ["contender", "engine", "precision", "sentences/s", "runs", "× fairseq"]
    head += ["× CTranslate2 int8", "peak RSS MB", "BLEU", "model", "signature"]
    return [
        "### Beam-4 decoding of test_2016_flickr (1,000 sentences), every engine and precision",
        f"Median of {rounds} interleaved rounds{when} on {res.get('decoding_cpu', 'this CPU')}: "
        "every contender decodes the same batches (the sources sorted by length, 64 sentences a "
        "batch, as fairseq-generate's --batch-size 64), 2 threads, beam 4, at most 200 output "
        "tokens, model loading excluded; each run is its own process (peak RSS its own). Length "
        "penalty 1.0 by each toolkit's formula: GNMT ((5 + |Y|) / 6)^α for ours and for "
        "CTranslate2 through tmt, |Y|^α for fairseq.",
        md_table(head, rows, "lllrlrrrrll"),
        "\\* Peak RSS not shown: these rows were measured before each contender reported its own "
        "peak (the figure then was the bench process's); the next `make bench` measures it."
        if stale
        else "",
        "fairseq-generate did not run: no fairseq model of the same budget was there (`make "
        "bench-quality` trains one)."
        if fs is None
        else "",
        "\n".join(f"- {c}" for c in conclusions(d)),
    ]


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds of every contender")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per contender and round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before timing")
    ap.add_argument("--peer-updates", type=int, default=60, help="updates of each peer's run")
    ap.add_argument("--no-peers", action="store_true", help="skip fairseq and JoeyNMT")
    ap.add_argument("--no-ablation", action="store_true", help="skip ours with torch's dropout")
    ap.add_argument(
        "--decode-minutes",
        type=int,
        default=20,
        help="compare decoding on the models make bench-quality trained for this many minutes",
    )
    ap.add_argument("--quick", action="store_true", help="1 round, 10 steps, no peers, no ablation")
    ap.add_argument(
        "--avx2",
        action="store_true",
        help="also time the fp32 training rows and fairseq with AVX2 kernels only (a child "
        "process): an AVX2-only CPU approximated",
    )
    ap.add_argument(
        "--training-only",
        action="store_true",
        help="only the matmul ceiling and the fp32 training rows (and fairseq) into --json: what "
        "--avx2's child runs",
    )
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="BENCH_CONFIG")
    ap.add_argument("--matmul-seconds", type=float, default=1.5, help="timing of each matmul")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--decode-lengths", type=int, nargs="+", default=[10, 25, 50, 100, 200])
    ap.add_argument("--out", default=str(BENCHMARKS))
    ap.add_argument(
        "--json", help="the results file (default bench.json; --training-only needs its own)"
    )
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    ap.add_argument(
        "--decode-only",
        action="store_true",
        help="re-run only the decoding comparison, updating an existing --json and --out",
    )
    args = ap.parse_args(argv)
    if args.training_only and args.json is None:  # its partial result would replace bench.json
        ap.error("--training-only writes only the fp32 training rows: give it its own --json PATH")
    args.json = args.json or str(ROOT / "bench.json")
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 10, 2
        args.no_peers = args.no_ablation = True
        args.matmul_seconds = 0.5
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        write_report(read_json(args.json), Path(args.out))
        return 0
    if args.decode_only:  # the decoding comparison again, the rest of --json kept
        res = read_json(args.json)
        found = decoding_comparison(args.decode_minutes, args.rounds + 1)
        for note in found.pop("notes", []):
            log(note)
        res.update(found)
        write_json(args.json, res)
        write_report(res, Path(args.out))
        return 0
    cfg = bench_config(args.set)
    try:
        text_file(cfg.data.train, cfg.data.src_lang)
    except DataError:
        log(f"skipped: the benchmark corpus {cfg.data.train} is not here (it ships in ../shared)")
        return 0
    if args.training_only:
        write_json(args.json, fp32_training(args, cfg))
        return 0
    res = measure(args, cfg)
    keep_earlier_decoding(res, Path(args.json))
    write_json(args.json, res)
    write_report(res, Path(args.out))
    log(f"wrote {args.out} and {args.json}")
    for k, v in res["training"].items():
        log(f"{k}: {v['tok_s']:,.0f} tgt tok/s")
    return 0


DECODING_KEYS = ("decoding", "decoding_minutes", "decoding_date", "decoding_cpu")


def keep_earlier_decoding(res: dict, json_path: Path) -> None:
    """Without models to decode (make bench-quality's budget race not run on this machine), the
    decoding table of the earlier --json is kept, under its own date and CPU, and a note says so."""
    if res.get("decoding") or not json_path.exists():
        return
    earlier = read_json(json_path)
    if earlier.get("decoding"):
        res.update({k: earlier[k] for k in DECODING_KEYS if k in earlier})
        # a --json written before decoding_date existed measured decoding in its own run
        res["decoding_date"] = earlier.get("decoding_date") or earlier.get("date", "?")
        res["notes"] = [n for n in res["notes"] if not n.startswith("decoding not compared")]
        res["notes"].append(
            f"the decoding table is the one measured on {res['decoding_date']} on "
            f"{earlier.get('decoding_cpu', '?')}: this run did not measure decoding"
        )


def decoding_comparison(minutes: int, rounds: int) -> dict:
    """The decoding rows and when and where they were measured; a note when there is no model."""
    d = decode_side_by_side(minutes, rounds)
    out = {"decoding": d, "decoding_minutes": minutes, "decoding_date": now()}
    out["decoding_cpu"] = cpu_model()
    if d is None:
        out["notes"] = [
            "decoding not compared: run `make bench-quality` first (it trains ours and fairseq "
            f"for {minutes} minutes each)"
        ]
    return out


def measure(args: argparse.Namespace, cfg: Config) -> dict:
    """Every figure of the report, into one dict (bench.json)."""
    set_threads(cfg.train.threads or 2)
    cpu = cpu_model()
    res: dict = {
        "date": now(),
        "cpu": cpu,
        "cpu_flags": reported_flags(),
        "cpu_bf16": cpu_bf16(),
        "bf16_obstacle": cpu_bf16_obstacle(),
        "machine": f"{cpu}, {platform.machine()} {os.cpu_count()} CPUs",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "model": {k: getattr(cfg.model, k) for k in BENCH_CONFIG["model"]},
        "vocab_size": cfg.tokenizer.vocab_size,
        "max_tokens": cfg.train.max_tokens,
        "notes": [],
    }
    log("matmul ceiling")
    res["matmul_gflops"] = matmul_peak(cfg, args.matmul_seconds)
    log(f"tokenizer and tokenized corpus (under {cfg.output_dir} and the corpus cache)")
    bench = BenchData.load(cfg)
    need = args.warmup + args.steps
    batches = bench.batches(cfg.train.max_tokens, seed=cfg.train.seed, limit=need)
    bf16 = not res["bf16_obstacle"]
    if not bf16:
        log(f"bf16 not timed ({res['bf16_obstacle']}: emulated): the fp32 rows only")
    steps, ours, res["attention"] = contenders(bench, cfg, not args.no_ablation, bf16=bf16)
    res.update(batch_figures(batches, ours["fp32"]))
    peers = [] if args.no_peers or not peers_ready() else ["fairseq", "joey"]
    res.update(training_rounds(steps, batches, args, peers))
    res["batch_scaling_precision"] = fastest = "bf16" if bf16 else "fp32"
    log(f"tokens/s against batch size ({fastest})")
    res["batch_scaling"] = batch_scaling(bench, cfg, steps[f"ours_{fastest}"], args.batch_sizes)
    log("decoding cost against length")
    vocab = bench.tokenizer.src_vocab_size
    res["decode_scaling"] = decode_cost_by_length(ours["fp32"], vocab, args.decode_lengths)
    if peers:
        log("beam-4 decoding side by side (models from make bench-quality)")
        found = decoding_comparison(args.decode_minutes, args.rounds + 1)
        res["notes"] += found.pop("notes", [])
        res.update(found)
    elif not args.no_peers:
        res["notes"].append(
            "peers not measured: run `bash ../shared/peers/setup.sh` once (see its README)"
        )
    res["peak_rss_mb"] = peak_rss_mb()
    if args.avx2 and (why := native_avx2_only()):
        res["avx2_native"] = why
        log(f"no AVX2 child: {why}, so the rows above are the AVX2-only ones")
    elif args.avx2:
        res["avx2"] = avx2_training(args)
    return res


def fp32_training(args: argparse.Namespace, cfg: Config) -> dict:
    """The matmul ceiling and the training table's fp32 rows (ours, the reference) and fairseq's
    (which trains in fp32 on a CPU), as the kernels this process was started with allow."""
    set_threads(cfg.train.threads or 2)
    res: dict = {
        "date": now(),
        "cpu": cpu_model(),
        "kernels": torch.backends.cpu.get_cpu_capability(),
        "bf16_obstacle": cpu_bf16_obstacle(),
        "matmul_gflops": matmul_peak(cfg, args.matmul_seconds),
    }
    bench = BenchData.load(cfg)
    batches = bench.batches(
        cfg.train.max_tokens, seed=cfg.train.seed, limit=args.warmup + args.steps
    )
    model = bench.model(cfg, cfg.train.seed)
    res["attention"] = {"fp32": set_up_attention(model, cfg.train, CPU, "fp32")}
    steps = {
        "ours_fp32": training_step(model, cfg.train, "fp32", res["attention"]["fp32"]),
        "reference_fp32": reference_step(bench.tokenizer.tgt_vocab_size, cfg, bf16=False),
    }
    res.update(batch_figures(batches, model))
    peers = [] if args.no_peers or not peers_ready() else ["fairseq"]
    res.update(training_rounds(steps, batches, args, peers))
    return res


def avx2_training(args: argparse.Namespace) -> dict | None:
    """fp32_training in a child process with AVX2 kernels only (torch reads ATEN_CPU_CAPABILITY
    once, at import); None, with a log line, when the child fails."""
    with tempfile.TemporaryDirectory(prefix="tmt-bench-avx2-") as tmp:
        out = Path(tmp) / "avx2.json"
        child = [sys.executable, "-m", "scripts.bench", "--training-only", "--json", str(out)]
        for flag in ("rounds", "steps", "warmup", "peer_updates", "matmul_seconds"):
            child += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        child += ["--no-peers"] * args.no_peers + [a for o in args.set for a in ("--set", o)]
        log(f"the fp32 training rows again with {avx2_description()}")
        env = {**os.environ, **AVX2_ONLY}
        if subprocess.run(child, cwd=ROOT, env=env).returncode or not out.exists():
            log("the AVX2 child failed: no AVX2 rows")
            return None
        res = read_json(out)
    if res["kernels"].startswith("AVX512"):  # another torch build, which ignores the variable
        log(f"the AVX2 child still ran {res['kernels']} kernels: no AVX2 rows")
        return None
    return res


if __name__ == "__main__":
    sys.exit(main())
