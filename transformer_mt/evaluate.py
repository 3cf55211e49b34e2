"""`tmt evaluate`: translate a split or a file with a trained model and score it with sacreBLEU."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

from .data import DataError, read_lines, read_split
from .metrics import score
from .translate import load_translator


def evaluate(checkpoint: Optional[str] = None, *, src: Optional[str] = None, ref: Optional[str] = None,
             beam: Optional[int] = None, alpha: Optional[float] = None,
             max_len: Optional[tuple[float, float]] = None, device: str = "auto",
             precision: Optional[str] = None, output: Optional[str] = None) -> dict[str, Any]:
    """Translate the run's test split (or --src) and score it against its references (or --ref).

    The hypotheses are written next to the checkpoint; the result dict includes their path.
    """
    if (src is None) != (ref is None):
        raise DataError("give both --src and --ref, or neither (to use the run's test split)")
    translator = load_translator(checkpoint, device=device, precision=precision, beam=beam, alpha=alpha,
                                 max_len=max_len)
    if src is not None:
        sources, references = read_lines(src), read_lines(ref)
        if len(sources) != len(references):
            raise DataError(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
        name = Path(src).name.removesuffix(".gz")
    else:
        sources, references = read_split(translator.config.data, "test")
        name = "test"
    d, path = translator.decode, translator.checkpoint
    start = time.perf_counter()
    hyps = translator.translate_text(sources)
    seconds = time.perf_counter() - start
    hyp_path = Path(output) if output else path.parent / f"{path.stem}.{name}.beam{d.beam}.hyp"
    hyp_path.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    result = score(hyps, references)
    result.update(checkpoint=str(path), step=translator.step, beam=d.beam, alpha=d.alpha, sentences=len(hyps),
                  decode_seconds=round(seconds, 2), sentences_per_second=round(len(hyps) / max(seconds, 1e-9), 1),
                  max_len=[d.max_len_a, d.max_len_b], precision=translator.precision, hypotheses_path=str(hyp_path))
    return result
