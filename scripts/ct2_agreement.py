"""CTranslate2 against our engine, output for output (issue 22): the share of identical
translations.

Both engines decode the same sources at fp32 with the same beam, length penalty and length budget:
the run's own decode settings, and `--max-len 0 5` (every output cut at 4 pieces and EOS, so the
budget decides nearly every sentence); on the test file and on long inputs (consecutive test
sentences joined in pairs). Each engine scores its own output by our ranking (log P / GNMT penalty,
P from the same weights), so a differing line says which engine found the better translation (a
search difference) or whether the two tie within float error (a rounding difference).
Writes bench_ct2_agreement.json and its BENCHMARKS.md section. Times nothing: any machine will do.

usage: python -m scripts.ct2_agreement [--checkpoint runs/multi30k_en_de] [--src FILE]
       [--threads 2] [--limit N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from scripts.benchlib import (
    BENCHMARKS,
    ROOT,
    TEST_PREFIX,
    cpu_model,
    md_table,
    now,
    read_json,
    write_json,
    write_section,
)

# score differences below this are float rounding between the engines, not a search difference
TIE = 1e-4


def long_inputs(lines: Sequence[str]) -> list[str]:
    """Consecutive sentences joined in pairs: inputs twice as long as the test set's, and their
    outputs."""
    return [f"{a.strip()} {b.strip()}" for a, b in zip(lines[0::2], lines[1::2])]


def settings(decode_max_len: tuple[float, int]) -> list[dict]:
    """Every (inputs, length budget) pair the report compares, the run's own budget first."""
    # no "|": a table cell
    own = f"the run's budget {decode_max_len[0]:g} × source + {decode_max_len[1]}"
    return [
        {"inputs": inputs, "max_len": max_len, "name": f"{inputs}, {label}"}
        for max_len, label in ((decode_max_len, own), ((0.0, 5), "--max-len 0 5"))
        for inputs in ("test", "long")
    ]


def classify(ours_score: float, theirs_score: float) -> str:
    """Which engine's output our model ranks higher (GNMT-normalised log-probability), or a tie."""
    if abs(ours_score - theirs_score) < TIE:
        return "tie"
    return "ours better" if ours_score > theirs_score else "ctranslate2 better"


def agreement(
    ours: Sequence[Sequence[str]], theirs: Sequence[Sequence[str]]
) -> tuple[int, list[int]]:
    """The number of identical outputs (piece for piece) and the indices of the differing ones."""
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if list(a) != list(b)]
    return len(ours) - len(differing), differing


def compare(
    checkpoint: Path,
    export: Path,
    sources: list[str],
    *,
    beam: int,
    alpha: float,
    max_len: tuple[float, int],
    examples: int = 5,
) -> dict:
    """Decode `sources` with both engines at fp32; the share identical, and the differing lines
    classified by each engine's score of its own output (log P / lp, the same formula, P from the
    same weights)."""
    from transformer_mt.inference import load_translator

    opts = {
        "device": "cpu",
        "precision": "fp32",
        "beam": beam,
        "alpha": alpha,
        "max_len": max_len,
    }
    ours = load_translator(checkpoint, **opts)
    theirs = load_translator(export, engine="ctranslate2", **opts)
    a = [h[0] for h in ours.translate(sources)]
    b = [h[0] for h in theirs.translate(sources, token_scores=False)]
    same, differing = agreement([t.pieces for t in a], [t.pieces for t in b])
    kinds = [classify(a[i].score, b[i].score) for i in differing]
    return {
        "sentences": len(sources),
        "identical": same,
        "share": same / max(1, len(sources)),
        "differing": {
            kind: kinds.count(kind) for kind in ("tie", "ours better", "ctranslate2 better")
        },
        "examples": [
            {
                "source": sources[i],
                "ours": a[i].text,
                "ctranslate2": b[i].text,
                "ours_score": round(a[i].score, 4),
                "ctranslate2_score": round(b[i].score, 4),
                "kind": kind,
            }
            for i, kind in list(zip(differing, kinds))[:examples]
        ],
    }


def run(
    checkpoint: Path,
    src: Path,
    *,
    limit: int | None,
    threads: int,
    beam: int | None,
    alpha: float | None,
    log=print,
) -> dict:
    """Every setting of `settings` on `checkpoint` (a float32 export in a temporary directory)."""
    from transformer_mt.checkpoint import load_for_inference, resolve_checkpoint
    from transformer_mt.data import read_lines
    from transformer_mt.export import export_ctranslate2
    from transformer_mt.runtime import set_threads

    set_threads(threads)
    path = resolve_checkpoint(checkpoint)
    _, _, cfg, ckpt = load_for_inference(path, "cpu")
    beam, alpha = beam or cfg.decode.beam, cfg.decode.alpha if alpha is None else alpha
    lines = read_lines(src)[:limit]
    inputs = {"test": lines, "long": long_inputs(lines)}
    shown = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else path
    res = {
        "checkpoint": str(shown),
        "step": ckpt.get("step"),
        "source": str(src),
        "beam": beam,
        "alpha": alpha,
        "threads": threads,
        "date": now(),
        "cpu": cpu_model(),
        "settings": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        export = export_ctranslate2(path, Path(tmp) / "ct2", "float32")
        for s in settings((cfg.decode.max_len_a, cfg.decode.max_len_b)):
            log(f"[ct2_agreement] {s['name']}: {len(inputs[s['inputs']])} sources")
            r = compare(
                path,
                export,
                inputs[s["inputs"]],
                beam=beam,
                alpha=alpha,
                max_len=s["max_len"],
            )
            res["settings"].append({**s, **r})
            log(
                f"[ct2_agreement] {s['name']}: {r['share']:.2%} identical, differing "
                f"{r['differing']}"
            )
    return res


def report(res: dict) -> list[str]:
    """The BENCHMARKS.md section's blocks, from the JSON alone."""
    rows = [
        (s["name"], f"{s['sentences']:,}", f"{s['identical']:,}", f"{s['share']:.2%}")
        + tuple(s["differing"][k] for k in ("tie", "ours better", "ctranslate2 better"))
        for s in res["settings"]
    ]
    head = ["setting", "sentences", "identical", "share", "ties", "ours better"]
    examples = [(s["name"], e) for s in res["settings"] for e in s["examples"][:2]]
    shown = [
        f"- *{name}*, {e['kind']}: `{e['source']}`\n  - ours ({e['ours_score']}): `{e['ours']}`\n  "
        f"- CTranslate2 ({e['ctranslate2_score']}): `{e['ctranslate2']}`"
        for name, e in examples
    ]
    return [
        "## CTranslate2 against our engine, output for output",
        f"Written by `python -m scripts.ct2_agreement` on {res['date']} ({res['cpu']}): "
        f"`{res['checkpoint']}` (step {res.get('step')}) decoded by both engines at fp32, beam "
        f"{res['beam']}, α {res['alpha']:g}, on `{Path(res['source']).name}` and on long inputs "
        "(its sentences joined in pairs); identical means piece for piece. Each engine scores its "
        f"own output as our search ranks (log P / GNMT penalty): a tie (within {TIE:g}) is float "
        "rounding between the engines; otherwise the engine with the better score found a "
        "translation the other's search did not keep. How the CTranslate2 engine follows our "
        "search and what can still differ: `transformer_mt/ct2.py`.",
        md_table([*head, "CTranslate2 better"], rows, "lrrrrrr"),
        "Differing examples (log P / lp by each engine):\n\n" + "\n".join(shown)
        if shown
        else "No line differs in any setting.",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m scripts.ct2_agreement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--checkpoint",
        default=str(ROOT / "runs" / "multi30k_en_de"),
        help="checkpoint or run directory",
    )
    ap.add_argument(
        "--src",
        default=f"{TEST_PREFIX}.en.gz",
        help="source sentences, one a line (.gz read as gzip)",
    )
    ap.add_argument("--limit", type=int, help="only the first N sources (a smoke run)")
    ap.add_argument("--threads", type=int, default=2, help="threads of each engine")
    ap.add_argument("--beam", type=int, help="beam size (default: the run's)")
    ap.add_argument("--alpha", type=float, help="GNMT length penalty (default: the run's)")
    ap.add_argument("--json", default=str(ROOT / "bench_ct2_agreement.json"))
    ap.add_argument("--out", default=str(BENCHMARKS))
    ap.add_argument("--report-only", action="store_true", help="rewrite --out from --json")
    args = ap.parse_args(argv)
    if args.report_only:
        res = read_json(args.json)
    else:
        res = run(
            Path(args.checkpoint),
            Path(args.src),
            limit=args.limit,
            threads=args.threads,
            beam=args.beam,
            alpha=args.alpha,
            log=lambda m: print(m, file=sys.stderr, flush=True),
        )
        write_json(args.json, res)
    write_section(args.out, "ct2-agreement", *report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
