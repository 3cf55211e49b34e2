"""sacreBLEU metrics (BLEU, chrF, TER, each with its signature) over a split or a pair of files."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from .checkpoint import load_for_inference, resolve_checkpoint
from .data import DataError, read_lines, read_split
from .translate import Translator, decode_overrides, pick_device


def score(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, Any]:
    """Corpus BLEU (13a), chrF and TER of detokenized hypotheses against raw references."""
    out: dict[str, Any] = {}
    for name, metric in (("bleu", BLEU()), ("chrf", CHRF()), ("ter", TER())):
        result = metric.corpus_score(list(hypotheses), [list(references)])
        out[name] = round(result.score, 2)
        out[f"{name}_signature"] = str(metric.get_signature())
        if name == "bleu":
            out["bleu_detail"] = result.format(signature=out["bleu_signature"])
    out["signature"] = out["bleu_signature"]
    return out


def evaluate(checkpoint: Optional[str] = None, *, src: Optional[str] = None, ref: Optional[str] = None,
             beam: Optional[int] = None, alpha: Optional[float] = None,
             max_len: Optional[tuple[float, float]] = None, device: str = "auto",
             precision: Optional[str] = None, output: Optional[str] = None) -> dict[str, Any]:
    """Translate the run's test split (or --src) and score it against its references (or --ref).

    The hypotheses are written next to the checkpoint; the result dict includes their path.
    """
    if (src is None) != (ref is None):
        raise DataError("give both --src and --ref, or neither (to use the run's test split)")
    path = resolve_checkpoint(checkpoint)
    model, tokenizer, cfg, ckpt = load_for_inference(path, pick_device(device))
    if src is not None:
        sources, references = read_lines(src), read_lines(ref)
        if len(sources) != len(references):
            raise DataError(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
        name = Path(src).name.removesuffix(".gz")
    else:
        sources, references = read_split(cfg.data, "test")
        name = "test"
    beam = beam or cfg.decode.beam
    cfg.decode = decode_overrides(cfg.decode, alpha, max_len)
    translator = Translator(model, tokenizer, cfg.decode, precision=precision or cfg.train.precision)
    start = time.perf_counter()
    hyps = translator.translate(sources, beam=beam)
    seconds = time.perf_counter() - start
    hyp_path = Path(output) if output else path.parent / f"{path.stem}.{name}.beam{beam}.hyp"
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    result = score(hyps, references)
    result.update(checkpoint=str(path), step=ckpt.get("step"), beam=beam, alpha=cfg.decode.alpha, sentences=len(hyps),
                  decode_seconds=round(seconds, 2), sentences_per_second=round(len(hyps) / max(seconds, 1e-9), 1),
                  max_len=[cfg.decode.max_len_a, cfg.decode.max_len_b], precision=translator.precision,
                  hypotheses_path=str(hyp_path))
    return result
