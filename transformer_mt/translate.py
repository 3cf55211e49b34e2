"""Text in, text out: chunk the input, sort by length, batch, search, detokenize, restore order."""

from __future__ import annotations

import dataclasses
import logging
from typing import Iterable, Iterator, Optional, Sequence

import torch

from .config import ConfigError, DecodeConfig
from .data import pad_sources
from .model import Transformer
from .search import beam_search, greedy_search
from .tokenizer import Tokenizer

log = logging.getLogger("transformer_mt")


def pick_device(name: str = "auto") -> torch.device:
    """CUDA, then Apple MPS, then CPU (or the device named)."""
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) is not None and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def decode_overrides(decode: DecodeConfig, alpha: Optional[float] = None,
                     max_len: Optional[Sequence[float]] = None) -> DecodeConfig:
    """The run's decode settings with command-line overrides, checked like the config's own."""
    changes: dict = {}
    if alpha is not None:
        changes["alpha"] = alpha
    if max_len is not None:
        a, b = max_len
        if b != int(b):
            raise ConfigError(f"--max-len: B must be a whole number of tokens, got {b}")
        changes.update(max_len_a=float(a), max_len_b=int(b))
    return dataclasses.replace(decode, **changes)


class Translator:
    """Translates sentences with a trained model; `translate_stream` keeps memory bounded."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, decode: DecodeConfig,
                 device: Optional[torch.device] = None):
        self.model, self.tokenizer, self.decode = model.eval(), tokenizer, decode
        self.device = device or next(model.parameters()).device
        self.max_src = model.cfg.max_positions  # longer sources are truncated, with a warning

    def translate(self, lines: list[str], *, beam: Optional[int] = None) -> list[str]:
        """One output line per input line, in input order; empty input gives empty output."""
        beam = beam or self.decode.beam
        ids = self.tokenizer.encode_src([line.strip() for line in lines])
        too_long = sum(len(x) >= self.max_src for x in ids)
        if too_long:
            log.warning("%d input line(s) longer than %d tokens were truncated", too_long, self.max_src - 1)
        out = [""] * len(lines)
        order = sorted((i for i in range(len(ids)) if ids[i]), key=lambda i: len(ids[i]))
        for batch in _length_batches(order, ids, self.decode.max_tokens // beam):
            src = pad_sources([ids[i] for i in batch], self.max_src).to(self.device)
            if beam == 1:
                hyps = greedy_search(self.model, src, max_len_a=self.decode.max_len_a,
                                     max_len_b=self.decode.max_len_b)
            else:
                hyps = beam_search(self.model, src, beam=beam, alpha=self.decode.alpha,
                                   max_len_a=self.decode.max_len_a, max_len_b=self.decode.max_len_b)
            for i, text in zip(batch, self.tokenizer.decode_tgt(hyps)):
                out[i] = text
        return out

    def translate_stream(self, lines: Iterable[str], *, beam: Optional[int] = None,
                         chunk: int = 2000) -> Iterator[str]:
        """Translate an arbitrarily long stream in chunks of `chunk` lines, yielding in order."""
        buf: list[str] = []
        for line in lines:
            buf.append(line.rstrip("\r\n"))
            if len(buf) == chunk:
                yield from self.translate(buf, beam=beam)
                buf = []
        if buf:
            yield from self.translate(buf, beam=beam)


def _length_batches(order: list[int], ids: list[list[int]], max_tokens: int) -> Iterator[list[int]]:
    """Cut length-sorted indices into batches of at most max_tokens source tokens (padded)."""
    batch: list[int] = []
    for i in order:
        if batch and (len(batch) + 1) * (len(ids[i]) + 1) > max_tokens:
            yield batch
            batch = []
        batch.append(i)
    if batch:
        yield batch
