"""Choose the beam size and the length penalty on the validation set, never on test.

Each checkpoint (several seeds' runs, so that a setting is judged across them) decodes its run's
valid split (or --src/--ref) once per (beam, alpha) pair; every output is scored with sacreBLEU and
the literature's tokenized BLEU, and the table ranks the pairs by their mean sacreBLEU over the
checkpoints. A model is loaded once and decodes every pair.

    python -m scripts.sweep_decode runs/a/checkpoints/best.pt runs/b/checkpoints/best.pt \\
        --beam 4 5 8 --alpha 0.6 0.8 1.0 1.2 --out docs/sweeps/decode
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import mean

from scripts.benchlib import cpu_model, logger, md_table, now, reported_flags, write_json

log = logger("sweep-decode")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m scripts.sweep_decode",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoints", nargs="+", help="checkpoint files or run directories")
    p.add_argument("--beam", type=int, nargs="+", default=[5], help="beam sizes (default 5)")
    p.add_argument(
        "--alpha", type=float, nargs="+", default=[1.0], help="length penalties (default 1.0)"
    )
    p.add_argument("--src", help="source file (default: each run's data.valid)")
    p.add_argument("--ref", help="reference file, with --src")
    p.add_argument("--device", default="auto", help="cpu, cuda, ... (default: auto)")
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    args = p.parse_args(argv)
    if (args.src is None) != (args.ref is None):
        p.error("give both --src and --ref, or neither (each run's valid split)")
    return args


def pair_key(beam: int, alpha: float) -> str:
    """How results.json names a (beam, alpha) pair: "5/1", "8/1.5"."""
    return f"{beam}/{alpha:g}"


def sweep_checkpoint(
    checkpoint: str, pairs: list[tuple[int, float]], args: argparse.Namespace
) -> dict:
    """One checkpoint's scores for every (beam, alpha) pair, keyed by pair_key."""
    from transformer_mt.data import read_lines, read_split
    from transformer_mt.inference import load_translator
    from transformer_mt.metrics import paper_bleu, score

    translator = load_translator(checkpoint, device=args.device)
    if args.src:
        sources, references = read_lines(args.src), read_lines(args.ref)
    else:
        sources, references = read_split(translator.config.data, "valid")
    lang = translator.config.data.tgt_lang
    scores, signature = {}, ""
    for beam, alpha in pairs:
        start = time.perf_counter()
        found = translator.translate(sources, beam=beam, alpha=alpha, token_scores=False)
        hyps = [h[0].text for h in found]
        seconds = time.perf_counter() - start
        s = score(hyps, [references], names=("bleu",), lang=lang)
        s.update(paper_bleu(hyps, [references], lang))
        signature = s["bleu_signature"]
        scores[pair_key(beam, alpha)] = {
            "bleu": s["bleu"],
            "tokenized_bleu": s["tokenized_bleu"],
            "bleu_detail": s["bleu_detail"],
            "seconds": round(seconds, 1),
        }
        log(f"{checkpoint} beam {beam} alpha {alpha:g}: {s['bleu_detail']}")
    return {
        "step": translator.step,
        "sentences": len(sources),
        "signature": signature,
        "scores": scores,
    }


def ranked(results: dict[str, dict], pairs: list[tuple[int, float]]) -> list[dict]:
    """The pairs with each checkpoint's BLEU and the means, best mean sacreBLEU first."""
    rows = []
    for beam, alpha in pairs:
        each = [r["scores"][pair_key(beam, alpha)] for r in results.values()]
        rows.append(
            {
                "beam": beam,
                "alpha": alpha,
                "bleu": [e["bleu"] for e in each],
                "mean_bleu": round(mean(e["bleu"] for e in each), 2),
                "mean_tokenized_bleu": round(mean(e["tokenized_bleu"] for e in each), 2),
            }
        )
    return sorted(rows, key=lambda r: -r["mean_bleu"])


def table(results: dict[str, dict], rows: list[dict]) -> str:
    """Markdown: a row per pair, a BLEU column per checkpoint (numbered as listed above it)."""
    head = ["beam", "α", *(f"BLEU ({i})" for i in range(1, len(results) + 1))]
    head += ["mean BLEU", "mean tokenized BLEU"]
    body = [
        (r["beam"], f"{r['alpha']:g}", *r["bleu"], r["mean_bleu"], r["mean_tokenized_bleu"])
        for r in rows
    ]
    return md_table(head, body, align="r" * len(head)) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    pairs = [(b, a) for b in args.beam for a in args.alpha]
    results = {c: sweep_checkpoint(c, pairs, args) for c in args.checkpoints}
    rows = ranked(results, pairs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(
        out / "results.json",
        {
            "date": now(),
            "cpu": cpu_model(),
            "flags": reported_flags(),
            "data": args.src or "each run's data.valid",
            "checkpoints": results,
            "ranked": rows,
        },
    )
    sig = next(iter(results.values()))["signature"]
    listed = "".join(
        f"{i}. `{c}` (step {r['step']})\n" for i, (c, r) in enumerate(results.items(), 1)
    )
    text = f"Validation sacreBLEU by beam and length penalty ({sig}) of:\n\n{listed}\n"
    text += table(results, rows)
    (out / "results.md").write_text(text, encoding="utf-8")
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
