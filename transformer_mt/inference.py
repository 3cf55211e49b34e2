"""The layer users call, over both engines: `load_translator` (`transformer_mt.load`) picks ours
(translate.py) or CTranslate2's (ct2.py); a `Translator` turns text into ids and back, gives empty
lines an empty translation, truncates long sources (once, here), cuts many sentences into batches
by decode.max_src_tokens, and takes decoding options per call with the run's as defaults."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch

from .config import Config, ConfigError, DecodeConfig
from .ct2 import is_export, load_ct2_engine
from .data import DataError, chunks, cut_batches
from .decoding import (
    DecodeOptions,
    Engine,
    Scored,
    Translation,
    align_words,
    empty_hypothesis,
)
from .model import Ensemble, Transformer
from .search import Hypothesis, Sampling, StopCheck
from .tokenizer import Tokenizer
from .translate import TorchEngine, load_torch_engine

log = logging.getLogger("transformer_mt")


class Translator:
    """Translates and scores sentences with one engine: n-best lists, scores, sampling, attention
    and alignment (our engine), forced scoring; streams of any length in bounded memory."""

    def __init__(self, engine: Engine, defaults: DecodeOptions):
        self.engine, self.defaults = engine, defaults
        self.tokenizer = engine.tokenizer

    @classmethod
    def for_model(
        cls,
        model: Transformer | Ensemble,
        tokenizer: Tokenizer,
        decode: DecodeConfig,
        precision: str = "fp32",
        device: torch.device | None = None,
    ) -> Translator:
        """Our engine around a model in memory (validation, notebooks, tests), in `precision`."""
        engine = TorchEngine(model, tokenizer, device=device, precision=precision)
        return cls(engine, DecodeOptions.from_config(decode))

    # What it runs on and where it came from (None for a model in memory)
    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def device(self) -> Any:
        return self.engine.device

    @property
    def precision(self) -> str:
        return self.engine.precision

    @property
    def max_positions(self) -> int:
        return self.engine.max_positions

    @property
    def parameters(self) -> int:
        return self.engine.parameters

    @property
    def checkpoint(self) -> Path | None:
        return self.engine.checkpoint

    @property
    def members(self) -> tuple[Path, ...]:
        return self.engine.members

    @property
    def config(self) -> Config | None:
        return self.engine.config

    @property
    def step(self) -> int | None:
        return self.engine.step

    # ------------------------------------------------------------------------------- translation

    def translate(
        self,
        lines: Sequence[str],
        *,
        beam: int | None = None,
        nbest: int = 1,
        alpha: float | None = None,
        max_len: Sequence[float] | None = None,
        sampling: Sampling | None = None,
        attention: bool = False,
        alignment: bool = False,
        generator: torch.Generator | None = None,
        should_stop: StopCheck = None,
        token_scores: bool = True,
        prefix: Sequence[str] | None = None,
    ) -> list[list[Translation]]:
        """The `nbest` best translations of each line, best first (one per line when sampling).

        beam, alpha and max_len (A, B: at most A x source length + B tokens) override the defaults
        for this call. attention: add each translation's cross-attention; alignment: its word
        alignment (our engine). `generator` carries a sampling seed across calls (translate_stream
        passes one); by default `sampling.seed` seeds each call. should_stop is asked between
        decoding steps; True raises search.Cancelled (the server stops work nobody waits for).
        token_scores=False lets an engine skip per-token log-probabilities.

        prefix: one target prefix per line ("": none). Each translation starts with its line's
        prefix as typed (stripped), the rest searched from there; its pieces, scores and
        log-probabilities count the prefix's tokens. An empty line with a prefix gives the prefix.
        """
        options = self.defaults.replace(
            beam=beam, nbest=nbest, alpha=alpha, max_len=max_len, sampling=sampling
        )
        if (attention or alignment) and self.engine.name != "torch":
            raise ConfigError("attention and alignment need our engine: drop --engine ctranslate2")
        typed = self._typed_prefixes(prefix, len(lines))
        prefix_ids = None if typed is None else self._prefix_ids(typed)
        ids = self._truncated(self.tokenizer.encode_src([line.strip() for line in lines]))
        found = self.translate_ids(
            ids,
            options,
            generator=generator,
            should_stop=should_stop,
            token_scores=token_scores,
            prefix=prefix_ids,
        )
        shown = [None] * len(lines) if typed is None else self._shown_prefixes(typed, prefix_ids)
        out = [[self._translation(h, shown[i]) for h in hyps] for i, hyps in enumerate(found)]
        if attention or alignment:
            for src, hyps in zip(ids, out):
                for t in hyps:
                    self._add_attention(src, t)
        return out

    def translate_ids(
        self,
        ids: Sequence[Sequence[int]],
        options: DecodeOptions | None = None,
        *,
        generator: torch.Generator | None = None,
        should_stop: StopCheck = None,
        token_scores: bool = True,
        prefix: Sequence[Sequence[int]] | None = None,
    ) -> list[list[Hypothesis]]:
        """The n-best hypotheses of each (truncated) source, in input order; an empty source gives
        one empty hypothesis (its prefix's tokens, if any, unscored). Sources are sorted by length
        and cut into batches of at most max_src_tokens = sentences x beam x (longest source + 1).
        prefix: target ids each source's hypotheses start with ([]: none), at most
        max_positions - 1 of them."""
        options, ids = options or self.defaults, self._truncated(ids)
        if options.sampling is not None and generator is None:  # one seed for the whole call
            generator = self.engine.seeded_generator(options.sampling)
        pre = [list(p) for p in prefix] if prefix is not None and any(prefix) else None
        if pre is not None and len(pre) != len(ids):
            raise DataError(f"{len(pre)} prefixes for {len(ids)} sources: one per source")
        out = [[empty_hypothesis(pre[i] if pre else [])] for i in range(len(ids))]
        lengths = [len(x) for x in ids]
        for batch in self._batches(lengths, options.beam, options.max_src_tokens):
            found = self.engine.search(
                [ids[i] for i in batch],
                options,
                generator=generator,
                should_stop=should_stop,
                token_scores=token_scores,
                prefix=None if pre is None else [pre[i] for i in batch],
            )
            for i, hyps in zip(batch, found):
                out[i] = hyps
        return out

    def translate_text(self, lines: Sequence[str], *, beam: int | None = None) -> list[str]:
        """One output line per input line (the best translation), in input order."""
        return [hyps[0].text for hyps in self.translate(lines, beam=beam, token_scores=False)]

    def translate_stream(
        self,
        lines: Iterable[str],
        *,
        chunk: int = 2000,
        sampling: Sampling | None = None,
        prefix: Iterable[str] | None = None,
        **options: Any,
    ) -> Iterator[tuple[str, list[Translation]]]:
        """Translate an arbitrarily long stream in chunks of `chunk` lines, yielding (line, its
        n-best list) in order; `options` are translate()'s. A sampling seed seeds the whole stream
        once. prefix: a stream of target prefixes, one per line (read like the lines; "": none);
        DataError when the two streams differ in length.

        A line ends at "\\n" only (a trailing "\\r" of a CRLF file is dropped); with chunk=1 each
        line is translated as soon as it arrives, for interactive use.
        """
        generator = self.engine.seeded_generator(sampling) if sampling is not None else None
        pairs = ((_line(x), "") for x in lines) if prefix is None else _paired(lines, prefix)
        for buf in chunks(pairs, chunk):
            texts, prefixes = [x for x, _ in buf], [p for _, p in buf]
            found = self.translate(
                texts, sampling=sampling, generator=generator, prefix=prefixes, **options
            )
            yield from zip(texts, found)

    # ----------------------------------------------------------------------------------- scoring

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[Scored]:
        """Forced decoding: log P(target | source) of each pair, with per-token
        log-probabilities."""
        if len(sources) != len(targets):
            raise DataError(
                f"{len(sources)} sources but {len(targets)} targets: they must pair up line by line"
            )
        src_ids = self.tokenizer.encode_src([s.strip() for s in sources])
        tgt_ids = self.tokenizer.encode_tgt([t.strip() for t in targets])
        limit = self.max_positions - 1
        too_long = [i for i, t in enumerate(tgt_ids) if len(t) > limit]
        if too_long:
            raise DataError(
                f"target {too_long[0] + 1} has {len(tgt_ids[too_long[0]])} pieces; this model "
                f"scores at most model.max_positions - 1 = {limit}"
            )
        logps = self.score_ids(src_ids, tgt_ids)
        return [
            Scored(s, t, sum(lp), self.tokenizer.tgt.id_to_piece(ids), lp)
            for s, t, ids, lp in zip(sources, targets, tgt_ids, logps)
        ]

    def score_ids(
        self, src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """Per-token log-probabilities (EOS included) of each target given its (truncated) source,
        in input order; batched like translate_ids at beam 1, a pair counting its longer side (the
        decoder reads the whole target at once)."""
        out: list[list[float]] = [[] for _ in src_ids]
        src_ids = self._truncated(src_ids)
        lengths = [max(len(s), len(t)) for s, t in zip(src_ids, tgt_ids)]
        for batch in self._batches(lengths, 1, self.defaults.max_src_tokens, keep_empty=True):
            found = self.engine.score(
                [src_ids[i] for i in batch], [list(tgt_ids[i]) for i in batch]
            )
            for i, logps in zip(batch, found):
                out[i] = logps
        return out

    def score_stream(
        self, pairs: Iterable[tuple[str, str]], *, chunk: int = 2000
    ) -> Iterator[Scored]:
        for buf in chunks(pairs, chunk):
            yield from self.score([s for s, _ in buf], [t for _, t in buf])

    # --------------------------------------------------------------------------------- internals

    def _truncated(self, ids: Sequence[Sequence[int]], what: str = "input line") -> list[list[int]]:
        """Sources (or target prefixes) cut to the model's positions, EOS taking the last, with one
        warning: the one place that truncates, for both engines."""
        limit = self.max_positions - 1
        too_long = sum(len(x) > limit for x in ids)
        if too_long:
            log.warning("%d %s(s) longer than %d tokens were truncated", too_long, what, limit)
        return [list(x[:limit]) for x in ids]

    @staticmethod
    def _batches(
        lengths: Sequence[int], width: int, max_src_tokens: int, keep_empty: bool = False
    ) -> list[np.ndarray]:
        """Indices of the (non-empty) items, sorted by length and cut so that each batch has at
        most max_src_tokens = items x width x (longest + 1): decode.max_src_tokens's one unit."""
        keep = (i for i in range(len(lengths)) if keep_empty or lengths[i])
        order = np.array(sorted(keep, key=lambda i: lengths[i]), dtype=np.int64)
        widths = np.array([lengths[i] + 1 for i in order], dtype=np.int64)
        return cut_batches(order, widths, max_src_tokens // width)

    def _typed_prefixes(self, prefix: Sequence[str] | None, n: int) -> list[str] | None:
        """The prefixes as typed (stripped), one per line; None when there are none."""
        if prefix is None:
            return None
        if isinstance(prefix, str) or len(prefix) != n:
            count = "a string" if isinstance(prefix, str) else f"{len(prefix)} prefixes"
            raise DataError(f"{count} for {n} lines: prefix takes one string per line")
        typed = [p.strip() for p in prefix]
        return typed if any(typed) else None

    def _prefix_ids(self, typed: list[str]) -> list[list[int]]:
        """Target ids of each prefix, cut like sources: the output budget always has room for the
        prefix and EOS."""
        return self._truncated(self.tokenizer.encode_tgt(typed), "prefix")

    def _shown_prefixes(
        self, typed: list[str], ids: list[list[int]]
    ) -> list[tuple[list[int], str, str] | None]:
        """Per line: its prefix's ids, their detokenized text and the text as typed (None without
        a prefix), decoded once for the line's n-best list."""
        decoded = self.tokenizer.decode_tgt(ids)
        return [(p, d, t) if p else None for p, d, t in zip(ids, decoded, typed)]

    def _translation(
        self, h: Hypothesis, prefix: tuple[list[int], str, str] | None = None
    ) -> Translation:
        """A hypothesis as text and pieces; a prefix, when it has one, is shown as it was typed
        (where detokenizing would change it: normalised spaces, unknown characters)."""
        text = self.tokenizer.decode_tgt([h.tokens])[0]
        if prefix is not None:
            ids, decoded, typed = prefix
            if h.tokens[: len(ids)] == ids and text.startswith(decoded):
                text = typed + text[len(decoded) :]
        pieces = self.tokenizer.tgt.id_to_piece(h.tokens)
        return Translation(text, pieces, h.logprob, h.score, h.token_logprobs)

    def _add_attention(self, src_ids: list[int], t: Translation) -> None:
        """Teacher-force a translation to read its cross-attention; align words from the last
        layer."""
        heads = self.engine.cross_attention(src_ids, self.tokenizer.tgt.piece_to_id(t.pieces))
        t.attention_heads = heads  # (L, H, T, S)
        last = heads[-1].mean(0)  # last layer, heads averaged: (T, S)
        t.attention = last.tolist()
        t.source_pieces = self.tokenizer.src.id_to_piece(src_ids)
        t.alignment = align_words(last, t.source_pieces, t.pieces)


def _paired(lines: Iterable[str], prefixes: Iterable[str]) -> Iterator[tuple[str, str]]:
    """(line, prefix) pairs of two streams read alike; DataError when one ends first."""
    missing = object()
    lines_it, prefix_it = iter(lines), iter(prefixes)
    for n, line in enumerate(lines_it):
        p = next(prefix_it, missing)
        if p is missing:
            raise DataError(f"the prefixes end after {n} lines: one prefix line per input line")
        yield _line(line), _line(p)  # type: ignore[arg-type]
    if next(prefix_it, missing) is not missing:
        raise DataError("there are more prefix lines than input lines")


def _line(text: str) -> str:
    """A line without its "\\n" (and a CRLF's "\\r"); lines end at "\\n" only."""
    text = text[:-1] if text.endswith("\n") else text
    return text[:-1] if text.endswith("\r") else text


def load_translator(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    device: str = "auto",
    precision: str | None = None,
    beam: int | None = None,
    alpha: float | None = None,
    max_len: Sequence[float] | None = None,
    engine: str = "torch",
) -> Translator:
    """A Translator for a checkpoint file or run directory (None: the newest run under ./runs/), or
    several (an ensemble, our engine only). engine="ctranslate2" decodes with CTranslate2, from a
    `tmt export` directory or a checkpoint (exported once, into the run's ct2-cache/). precision
    defaults to the one the run trained in; beam, alpha and max_len replace the run's decode
    settings as this translator's defaults (each call may still override them)."""
    if engine == "ctranslate2":
        chosen: Engine = load_ct2_engine(checkpoint, device=device, precision=precision)
    elif engine == "torch":
        many = checkpoint is not None and not isinstance(checkpoint, (str, os.PathLike))
        for c in checkpoint if many else [checkpoint]:
            if c is not None and is_export(c):
                raise ConfigError(
                    f"{c} is a CTranslate2 export: decode it with --engine ctranslate2"
                )
        chosen = load_torch_engine(checkpoint, device=device, precision=precision)
    else:
        raise ConfigError(f"unknown engine {engine!r}: torch or ctranslate2")
    defaults = DecodeOptions.from_config(chosen.config.decode)
    return Translator(chosen, defaults.replace(beam=beam, alpha=alpha, max_len=max_len))
