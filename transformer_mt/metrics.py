"""sacreBLEU metrics (BLEU, chrF, TER, each with its signature) of detokenized hypotheses."""

from __future__ import annotations

from typing import Any, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER


METRICS = {"bleu": BLEU, "chrf": CHRF, "ter": TER}


def score(hypotheses: Sequence[str], references: Sequence[str],
          names: Sequence[str] = ("bleu", "chrf", "ter")) -> dict[str, Any]:
    """Corpus BLEU (13a), chrF and TER (or those `names`) of detokenized hypotheses against raw references."""
    out: dict[str, Any] = {}
    for name in names:
        metric = METRICS[name]()
        result = metric.corpus_score(list(hypotheses), [list(references)])
        out[name] = round(result.score, 2)
        out[f"{name}_signature"] = str(metric.get_signature())
        if name == "bleu":
            out["bleu_detail"] = result.format(signature=out["bleu_signature"])
    if "bleu" in out:
        out["signature"] = out["bleu_signature"]
    return out
