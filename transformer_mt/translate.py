"""Text in, text out: chunk the input, sort by length, batch, search, detokenize, restore order."""

from __future__ import annotations

import copy
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


def resolve_precision(precision: str, device: torch.device) -> str:
    """auto: bf16 on GPUs that support it, fp16 (with a grad scaler) on older GPUs, fp32 elsewhere."""
    if precision != "auto":
        return precision
    if device.type == "cuda":
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "fp32"


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
                 device: Optional[torch.device] = None, precision: str = "fp32"):
        """precision: the run's train.precision. A bf16 (or, on GPUs, fp16) run decodes with a copy of the model
        wholly in that dtype, as fairseq's --fp16 generation does: no casts per operation and half the bytes
        through every op and the KV cache, without changing BLEU measurably (BENCHMARKS.md). The caller's model
        is left as it is, so training can go on after validating."""
        self.tokenizer, self.decode = tokenizer, decode
        self.device = device or next(model.parameters()).device
        self.precision = resolve_precision(precision, self.device)
        if self.precision == "fp16" and self.device.type != "cuda":  # a GPU fp16 run decoded elsewhere
            self.precision = "fp32"
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision, torch.float32)
        if next(model.parameters()).dtype != dtype:
            model = copy.deepcopy(model).to(dtype)
        self.model = model.eval()
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
            hyps = self._search(src, beam)
            for i, text in zip(batch, self.tokenizer.decode_tgt(hyps)):
                out[i] = text
        return out

    def _search(self, src: torch.Tensor, beam: int) -> list[list[int]]:
        d = self.decode
        if beam == 1:
            return greedy_search(self.model, src, max_len_a=d.max_len_a, max_len_b=d.max_len_b)
        return beam_search(self.model, src, beam=beam, alpha=d.alpha, max_len_a=d.max_len_a, max_len_b=d.max_len_b)

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
