"""sacreBLEU metrics of detokenized hypotheses: BLEU, chrF and TER with their signatures, chosen for
the target language as sacreBLEU's CLI chooses; paired significance tests; and the literature's
tokenized BLEU, always beside sacreBLEU and labelled as such."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from sacrebleu.metrics import BLEU, CHRF, TER

from .errors import UserError

# sacreBLEU's BLEU tokenizes these itself (zh, ja-mecab, ko-mecab); TER needs telling
ASIAN = ("zh", "ja", "ko")
METHODS = {"bs": "paired bootstrap resampling", "ar": "paired approximate randomization"}


def references_of(references: Sequence[str] | Sequence[Sequence[str]]) -> list[list[str]]:
    """One reference stream, or several (each a list of lines), as sacreBLEU takes them."""
    if references and isinstance(references[0], str):
        return [list(references)]  # type: ignore[list-item]
    return [list(r) for r in references]


def metrics_for(lang: str = "", tokenize: Optional[str] = None) -> dict[str, Any]:
    """BLEU, chrF and TER for a target language: BLEU's tokenizer follows the language exactly as
    sacreBLEU's CLI does (zh, ja-mecab, ko-mecab, else 13a) unless `tokenize` names one; TER gets
    its Asian-language support for those targets."""
    try:
        bleu = BLEU(trg_lang=lang, tokenize=tokenize)
    except (ImportError, RuntimeError) as e:  # ja-mecab / ko-mecab without their packages
        extra = {"ja": "ja", "ko": "ko"}.get(lang, "ja,ko")
        raise UserError(
            f"BLEU for target language {lang!r} needs sacreBLEU's {tokenize or lang} tokenizer: "
            f"pip install 'transformer-mt[{extra}]' ({e})"
        ) from None
    return {"bleu": bleu, "chrf": CHRF(), "ter": TER(asian_support=lang in ASIAN)}


def score(
    hypotheses: Sequence[str],
    references: Sequence[str] | Sequence[Sequence[str]],
    names: Sequence[str] = ("bleu", "chrf", "ter"),
    *,
    lang: str = "",
    tokenize: Optional[str] = None,
    confidence: int = 0,
) -> dict[str, Any]:
    """Corpus scores with their signatures; with `confidence` > 1, each also gets a 95% interval
    from that many bootstrap resamples (sacreBLEU's own: mean ± half-width)."""
    refs, metrics, out = references_of(references), metrics_for(lang, tokenize), {}
    for name in names:
        result = metrics[name].corpus_score(list(hypotheses), refs, n_bootstrap=max(confidence, 1))
        out[name] = round(result.score, 2)
        out[f"{name}_signature"] = str(metrics[name].get_signature())
        if confidence > 1:
            out[f"{name}_confidence"] = {
                "mean": round(float(result._mean), 2),
                "plus_minus": round(float(result._ci), 2),
                "level": 0.95,
                "bootstrap_samples": confidence,
            }
        if name == "bleu":
            out["bleu_detail"] = result.format(signature=out["bleu_signature"])
    if "bleu" in out:
        out["signature"] = out["bleu_signature"]
    return out


def paper_bleu(
    hypotheses: Sequence[str], references: Sequence[str] | Sequence[Sequence[str]], lang: str
) -> dict[str, Any]:
    """The literature's tokenized BLEU (e.g. Multi30k's `*.lc.norm.tok.*` files): lowercase, Moses
    punctuation normalisation and Moses tokenization (sacremoses, with Moses's escaping) of
    hypotheses and raw references, then BLEU on those tokens. Not comparable with sacreBLEU:
    reported beside it, never instead of it."""
    import sacremoses

    bleu = BLEU(tokenize="none", force=True)
    result = bleu.corpus_score(
        moses_tokenized(hypotheses, lang),
        [moses_tokenized(r, lang) for r in references_of(references)],
    )
    return {
        "tokenized_bleu": round(result.score, 2),
        "tokenized_bleu_description": "tokenized BLEU (papers' style, not sacreBLEU): lowercase + "
        "Moses punctuation normalisation + Moses tokenizer "
        f"({lang}), sacremoses {sacremoses.__version__}; then "
        f"{bleu.get_signature()}",
    }


def moses_tokenized(lines: Sequence[str], lang: str) -> list[str]:
    """What paper_bleu scores: lowercased, punctuation-normalised, Moses-tokenized lines."""
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    normalizer, tokenizer = MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)
    return [
        tokenizer.tokenize(normalizer.normalize(line.lower()), return_str=True, escape=True)
        for line in lines
    ]


def _compared(name: str, r: Any, base: float, i: int, same: bool) -> dict[str, Any]:
    """One system's row of a comparison (numpy floats made Python's, for JSON); system 0 is the
    baseline."""
    row = {
        "system": name,
        "score": round(float(r.score), 2),
        "delta": round(float(r.score - base), 2),
        "ci95": None
        if r.ci is None
        else [round(float(r.mean - r.ci), 2), round(float(r.mean + r.ci), 2)],
        "p_value": None if i == 0 else 1.0 if same else round(float(r.p_value), 4),
    }
    if i and same:
        row["note"] = "identical to the baseline's output: nothing to test"
    return row


def compare(
    systems: Sequence[tuple[str, Sequence[str]]],
    references: Sequence[str] | Sequence[Sequence[str]],
    *,
    method: str = "bs",
    samples: int = 0,
    lang: str = "",
    tokenize: Optional[str] = None,
) -> dict[str, Any]:
    """Is each system better than the first? sacreBLEU's paired test (bootstrap resampling, 1,000
    samples, or approximate randomization, 10,000 trials; seed $SACREBLEU_SEED, default 12345) on
    BLEU and chrF: each system's score and its 95% interval, the difference to the first, and the
    p-value."""
    import os

    from sacrebleu.significance import PairedTest

    metrics = {"bleu": metrics_for(lang, tokenize)["bleu"], "chrf": CHRF()}
    test = PairedTest(
        [(n, list(h)) for n, h in systems],
        metrics,
        references_of(references),
        test_type=method,
        n_samples=samples,
        n_ar_confidence=0 if method == "ar" else -1,
    )
    signatures, scores = test()
    out: dict[str, Any] = {
        "method": METHODS[method],
        "samples": test.n_samples,
        "seed": os.environ.get("SACREBLEU_SEED", "12345"),
        "metrics": {},
    }
    # sacreBLEU gives a system identical to the baseline p = 1/(samples + 1) (multeval's convention
    # that a zero difference is not chance); with nothing to test we say p = 1 and name it.
    same = [list(h) == list(systems[0][1]) for _, h in systems]
    for metric, results in scores.items():
        if metric != "System":
            out["metrics"][metric] = {
                "signature": str(signatures[metric]),
                "systems": [
                    _compared(name, r, results[0].score, i, same[i])
                    for i, (name, r) in enumerate(zip(scores["System"], results))
                ],
            }
    return out
