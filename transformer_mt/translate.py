"""Text in, text out: `load_translator` sets a trained model up for inference; `Translator` chunks
the input, sorts it by length, batches, searches, detokenizes and restores the order."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Optional, Sequence

import torch

from .checkpoint import load_for_inference, resolve_checkpoint
from .config import Config, ConfigError, DecodeConfig
from .model import Transformer
from .runtime import inference_model, pick_device
from .search import translate_ids
from .tokenizer import Tokenizer


class Translator:
    """Translates sentences with a trained model; `translate_stream` keeps memory bounded.

    From `load_translator`, it also knows where it came from: `checkpoint` (path), `config` (the run's)
    and `step`; built around a model in memory (validation during training), those are None.
    """

    checkpoint: Optional[Path] = None
    config: Optional[Config] = None
    step: Optional[int] = None

    def __init__(self, model: Transformer, tokenizer: Tokenizer, decode: DecodeConfig,
                 device: Optional[torch.device] = None, precision: str = "fp32"):
        """precision: the run's train.precision; bf16 and fp16 runs decode with a copy of the model in that
        dtype (runtime.inference_model), and the caller's model is left as it is."""
        self.tokenizer, self.decode = tokenizer, decode
        self.device = device or next(model.parameters()).device
        self.model, self.precision = inference_model(model, precision, self.device)

    def translate(self, lines: list[str], *, beam: Optional[int] = None) -> list[str]:
        """One output line per input line, in input order; empty input gives empty output."""
        ids = self.tokenizer.encode_src([line.strip() for line in lines])
        return self.tokenizer.decode_tgt(translate_ids(self.model, ids, self.decode, beam=beam or self.decode.beam))

    def translate_stream(self, lines: Iterable[str], *, beam: Optional[int] = None,
                         chunk: int = 2000) -> Iterator[str]:
        """Translate an arbitrarily long stream in chunks of `chunk` lines, yielding in order.

        A line ends at "\\n" only (a trailing "\\r" of a CRLF file is dropped); with chunk=1 each line is
        translated as soon as it arrives, for interactive use.
        """
        buf: list[str] = []
        for line in lines:
            line = line[:-1] if line.endswith("\n") else line
            buf.append(line[:-1] if line.endswith("\r") else line)
            if len(buf) == chunk:
                yield from self.translate(buf, beam=beam)
                buf = []
        if buf:
            yield from self.translate(buf, beam=beam)


def load_translator(checkpoint: Optional[str | os.PathLike] = None, *, device: str = "auto",
                    precision: Optional[str] = None, beam: Optional[int] = None, alpha: Optional[float] = None,
                    max_len: Optional[Sequence[float]] = None) -> Translator:
    """A Translator for a checkpoint file or run directory (None: the newest run under ./runs/).

    precision defaults to the run's train.precision; beam, alpha and max_len (A, B: output at most
    A x source length + B tokens) override the run's decode settings.
    """
    path = resolve_checkpoint(checkpoint)
    model, tokenizer, cfg, ckpt = load_for_inference(path, pick_device(device))
    cfg.decode = decode_overrides(cfg.decode, beam=beam, alpha=alpha, max_len=max_len)
    translator = Translator(model, tokenizer, cfg.decode, precision=precision or cfg.train.precision)
    translator.checkpoint, translator.config, translator.step = path, cfg, ckpt.get("step")
    return translator


def decode_overrides(decode: DecodeConfig, *, beam: Optional[int] = None, alpha: Optional[float] = None,
                     max_len: Optional[Sequence[float]] = None) -> DecodeConfig:
    """The run's decode settings with command-line overrides, checked like the config's own."""
    changes: dict[str, Any] = {}
    if beam is not None:
        changes["beam"] = beam
    if alpha is not None:
        changes["alpha"] = alpha
    if max_len is not None:
        a, b = max_len
        if b != int(b):
            raise ConfigError(f"--max-len: B must be a whole number of tokens, got {b}")
        changes.update(max_len_a=float(a), max_len_b=int(b))
    return dataclasses.replace(decode, **changes)
