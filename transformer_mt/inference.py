"""The Python API over both engines: `load_translator` gives our PyTorch engine (translate.py) or
CTranslate2's (ct2.py) behind one interface, BaseTranslator. The engines don't import each other;
this module imports both."""

from __future__ import annotations

import os
from typing import Sequence

from .config import ConfigError
from .ct2 import load_ct2_translator
from .translate import BaseTranslator, load_torch_translator


def load_translator(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    device: str = "auto",
    precision: str | None = None,
    beam: int | None = None,
    alpha: float | None = None,
    max_len: Sequence[float] | None = None,
    engine: str = "torch",
) -> BaseTranslator:
    """A translator for a checkpoint file or run directory (None: the newest run under ./runs/), or
    several (an ensemble, our engine only). engine="ctranslate2" decodes with CTranslate2, from a
    `tmt export` directory or a checkpoint (exported once, into the run's ct2-cache/); the options
    are translate.load_torch_translator's.
    """
    options = {
        "device": device,
        "precision": precision,
        "beam": beam,
        "alpha": alpha,
        "max_len": max_len,
    }
    if engine == "ctranslate2":
        return load_ct2_translator(checkpoint, **options)
    if engine != "torch":
        raise ConfigError(f"unknown engine {engine!r}: torch or ctranslate2")
    return load_torch_translator(checkpoint, **options)
