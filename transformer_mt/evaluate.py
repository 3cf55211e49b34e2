"""`tmt evaluate`: translate a split or a file with a trained model and score it with sacreBLEU,
beside the literature's tokenized BLEU, optionally against other systems with a paired significance
test; and training's validation (loss and BLEU on the valid split)."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from .checkpoint import run_dir_of
from .config import Config
from .data import DataError, TrainingData, read_lines, read_split
from .inference import Translator, load_translator
from .metrics import ASIAN, compare, paper_bleu, score
from .model import Transformer
from .tokenizer import Tokenizer


def evaluate(
    checkpoint: Optional[str | Sequence[str]] = None,
    *,
    src: Optional[str] = None,
    ref: Optional[str | Sequence[str]] = None,
    beam: Optional[int] = None,
    alpha: Optional[float] = None,
    max_len: Optional[tuple[float, float]] = None,
    device: str = "auto",
    precision: Optional[str] = None,
    output: Optional[str] = None,
    others: Sequence[str] = (),
    paired_ar: bool = False,
    confidence: bool = False,
    tokenize: Optional[str] = None,
    engine: str = "torch",
) -> dict[str, Any]:
    """Translate the run's test split (or --src) and score it against its references (or --ref, one
    or more).

    The hypotheses are written next to the checkpoint; the result dict includes their path. `others`
    are hypothesis files or checkpoints/runs (translated the same way) compared with this one by
    sacreBLEU's paired bootstrap (or approximate randomization); `confidence` adds 95% bootstrap
    intervals.
    """
    refs = [ref] if isinstance(ref, str) else list(ref or [])
    if (src is None) != (not refs):
        raise DataError("give both --src and --ref, or neither (to use the run's test split)")
    translator = load_translator(
        checkpoint,
        device=device,
        precision=precision,
        beam=beam,
        alpha=alpha,
        max_len=max_len,
        engine=engine,
    )
    sources, references, name = _test_set(translator, src, refs)
    d, path = translator.defaults, translator.checkpoint
    start = time.perf_counter()
    hyps = translator.translate_text(sources)
    seconds = time.perf_counter() - start
    hyp_path = Path(output) if output else _hypotheses_file(translator, f"{name}.beam{d.beam}.hyp")
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    lang = translator.config.data.tgt_lang
    result = score(
        hyps, references, lang=lang, tokenize=tokenize, confidence=1000 if confidence else 0
    )
    if lang not in ASIAN:  # Moses tokenization means nothing for these scripts
        result.update(paper_bleu(hyps, references, lang))
    result.update(_how(translator, len(hyps), seconds), hypotheses_path=str(hyp_path))
    result["references"] = len(references)
    if others:
        systems = [(str(path), hyps)] + [
            (o, _hypotheses_of(o, sources, translator, device, precision)) for o in others
        ]
        result["comparison"] = compare(
            systems, references, method="ar" if paired_ar else "bs", lang=lang, tokenize=tokenize
        )
    return result


def _hypotheses_file(translator: Translator, suffix: str) -> Path:
    """Where evaluate writes its hypotheses by default: next to the checkpoint; an ensemble run's
    in its directory (ensemble.SUFFIX), other ensembles next to their first checkpoint."""
    path, members = translator.checkpoint, translator.members
    if not members:
        return path.parent / f"{path.stem}.{suffix}"
    parents = {run_dir_of(m).parent for m in members}
    if len(parents) == 1 and next(iter(parents)).name == "members":
        return next(iter(parents)).parent / f"ensemble.{suffix}"
    return path.parent / f"{path.stem}.ensemble{len(members)}.{suffix}"


def _how(translator: Translator, sentences: int, seconds: float) -> dict[str, Any]:
    """What was decoded, with what and how fast: the facts beside the scores."""
    d = translator.defaults
    return {
        "checkpoint": str(translator.checkpoint),
        **({"ensemble": [str(m) for m in translator.members]} if translator.members else {}),
        "step": translator.step,
        "beam": d.beam,
        "alpha": d.alpha,
        "sentences": sentences,
        "decode_seconds": round(seconds, 2),
        "sentences_per_second": round(sentences / max(seconds, 1e-9), 1),
        "max_len": [d.max_len_a, d.max_len_b],
        "precision": translator.precision,
        "engine": translator.name,
    }


def _test_set(
    translator: Translator, src: Optional[str], refs: list[str]
) -> tuple[list[str], list[list[str]], str]:
    """Sources, one or more reference streams, and a name for the hypothesis file."""
    if src is None:
        sources, references = read_split(translator.config.data, "test")
        return sources, [references], "test"
    sources = read_lines(src)
    streams = [read_lines(r) for r in refs]
    for r, lines in zip(refs, streams):
        if len(lines) != len(sources):
            raise DataError(f"{src} has {len(sources)} lines but {r} has {len(lines)}")
    return sources, streams, Path(src).name.removesuffix(".gz")


def _hypotheses_of(
    other: str,
    sources: list[str],
    translator: Translator,
    device: str,
    precision: Optional[str],
) -> list[str]:
    """Another system's output: a hypothesis file as it is, or a checkpoint/run translated like
    ours."""
    path = Path(other)
    if path.is_dir() or path.suffix == ".pt":
        d = translator.defaults
        return load_translator(
            other,
            device=device,
            precision=precision,
            beam=d.beam,
            alpha=d.alpha,
            max_len=(d.max_len_a, d.max_len_b),
            engine=translator.name,
        ).translate_text(sources)
    lines = read_lines(path)
    if len(lines) != len(sources):
        raise DataError(
            f"--compare {other} has {len(lines)} lines but the test set has {len(sources)}"
        )
    return lines


def validation_metrics(
    model: Transformer,
    data: TrainingData,
    refs: list[str] | None,
    tokenizer: Tokenizer,
    cfg: Config,
    precision: str,
    device: torch.device,
) -> dict[str, float]:
    """Training's validation: loss and perplexity (forced scoring of the usable pairs) and, given
    `refs`, the BLEU of every source's translation, through the inference layer in the run's
    precision; empty without a valid split. The model is left in training mode."""
    if data.valid is None:
        return {}
    model.eval()
    translator = Translator.for_model(model, tokenizer, cfg.decode, precision, device)
    valid, idx = data.valid, data.valid_idx
    logps = translator.score_ids([valid.src(i) for i in idx], [valid.tgt(i) for i in idx])
    loss = -sum(map(sum, logps)) / max(sum(map(len, logps)), 1)  # per target token, EOS included
    metrics = {"loss": loss, "ppl": math.exp(min(loss, 50.0))}
    if refs is not None:
        options = translator.defaults.replace(beam=cfg.train.valid_beam)
        found = translator.translate_ids([valid.src(i) for i in range(len(valid))], options)
        hyps = tokenizer.decode_tgt([nbest[0].tokens for nbest in found])
        metrics["bleu"] = score(hyps, refs, names=("bleu",), lang=cfg.data.tgt_lang)["bleu"]
    model.train()
    return metrics
