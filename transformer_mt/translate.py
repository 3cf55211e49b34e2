"""What a user does with a trained model, as data, on our PyTorch engine: `load_torch_translator`
sets one or several checkpoints up for inference (inference.load_translator, or
`transformer_mt.load`, over both engines); `Translator` translates (n-best, scores, attention,
alignment, sampling) and scores given translations (forced decoding), in batches sorted by
length."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from .checkpoint import CheckpointError, load_for_inference, resolve_checkpoint, run_dir_of
from .config import Config, ConfigError, DecodeConfig
from .data import DataError, chunks
from .export import is_export
from .model import Ensemble, Transformer
from .runtime import cpu_bf16_obstacle, cpu_has_native_bf16, inference_model, pick_device
from .search import Hypothesis, Sampling, score_ids, translate_ids
from .tokenizer import Tokenizer
from .vocab import BOS, EOS

log = logging.getLogger("transformer_mt")


@dataclass
class Translation:
    """One hypothesis for one source sentence."""

    text: str  # detokenized
    pieces: list[str]  # SentencePiece pieces, without EOS
    logprob: float  # log P(translation | source), EOS included
    # what ranked it: logprob / GNMT length penalty under beam search, else the logprob
    score: float
    token_logprobs: list[float]  # one per piece, then EOS
    source_pieces: list[str] = field(default_factory=list)
    # Cross-attention of the last decoder layer, averaged over its heads: one row per piece (then
    # EOS), one column per source piece (then EOS). With attention=True only.
    attention: list[list[float]] | None = None
    # every layer and head: (layers, heads, rows, columns)
    attention_heads: torch.Tensor | None = None
    alignment: list[tuple[int, int]] | None = None  # (source word, target word) pairs, 0-based

    def pharaoh(self) -> str:
        """The alignment as `0-0 1-2 ...` (source-target), the format fairseq and Marian print."""
        return " ".join(f"{s}-{t}" for s, t in self.alignment or [])

    def to_json(self, alignment: bool = False) -> dict[str, Any]:
        out = {
            "text": self.text,
            "score": self.score,
            "logprob": self.logprob,
            "tokens": self.pieces,
            "token_logprobs": self.token_logprobs,
        }
        if alignment:
            out["alignment"] = self.pharaoh()
        return out


@dataclass
class Scored:
    """A (source, target) pair scored by forced decoding."""

    source: str
    target: str
    logprob: float  # log P(target | source), EOS included
    tokens: list[str]  # the target's pieces
    token_logprobs: list[float]  # one per piece, then EOS

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class BaseTranslator:
    """What every engine offers on top of its `translate` and `score`: one line per line, streams in
    bounded memory, and the checks on inputs. Engines: `Translator` (ours, PyTorch) and
    `ct2.CT2Translator` (a CTranslate2 export).

    From `inference.load_translator` it also knows where it came from: `checkpoint` (path of the
    first model), `config` (its run's) and `step`; built around a model in memory (validation,
    tests), those are None.
    """

    checkpoint: Path | None = None
    config: Config | None = None
    step: int | None = None
    engine = "torch"
    tokenizer: Tokenizer
    decode: DecodeConfig
    device: Any
    precision: str
    max_positions: int
    parameters: int  # number of model parameters (tied matrices once)

    def translate(self, lines: Sequence[str], **options: Any) -> list[list[Translation]]:
        raise NotImplementedError

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[Scored]:
        raise NotImplementedError

    def translate_text(self, lines: Sequence[str], *, beam: int | None = None) -> list[str]:
        """One output line per input line (the best translation), in input order."""
        return [hyps[0].text for hyps in self.translate(lines, beam=beam)]

    def translate_stream(
        self,
        lines: Iterable[str],
        *,
        chunk: int = 2000,
        sampling: Sampling | None = None,
        **options: Any,
    ) -> Iterator[tuple[str, list[Translation]]]:
        """Translate an arbitrarily long stream in chunks of `chunk` lines, yielding (line, its
        n-best list) in order; `options` are translate()'s. A sampling seed seeds the whole stream
        once.

        A line ends at "\\n" only (a trailing "\\r" of a CRLF file is dropped); with chunk=1 each
        line is translated as soon as it arrives, for interactive use.
        """
        generator = self._stream_generator(sampling) if sampling is not None else None
        for buf in chunks((_line(x) for x in lines), chunk):
            yield from zip(
                buf, self.translate(buf, sampling=sampling, generator=generator, **options)
            )

    def score_stream(
        self, pairs: Iterable[tuple[str, str]], *, chunk: int = 2000
    ) -> Iterator[Scored]:
        for buf in chunks(pairs, chunk):
            yield from self.score([s for s, _ in buf], [t for _, t in buf])

    def _stream_generator(self, sampling: Sampling) -> torch.Generator:
        """The random generator a whole sampled stream draws from (seeded once)."""
        return sampling.generator(self.device)

    def _beam(self, beam: int | None, nbest: int, sampling: Sampling | None) -> int:
        beam = beam or self.decode.beam
        if nbest > beam and sampling is None:
            raise ConfigError(
                f"--nbest {nbest} is more than the beam ({beam}): beam search keeps {beam} "
                "hypotheses"
            )
        return beam

    def _encode_pairs(
        self, sources: Sequence[str], targets: Sequence[str]
    ) -> tuple[list[list[int]], list[list[int]]]:
        """Pieces ids of (source, target) pairs to score: sources truncated as translate truncates
        them, targets refused when longer than the model's positions."""
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
                "scores "
                f"at most model.max_positions - 1 = {limit}"
            )
        return [s[:limit] for s in src_ids], tgt_ids


class Translator(BaseTranslator):
    """Translates and scores sentences with a trained model (or an `Ensemble`) in PyTorch: n-best,
    scores, attention, alignment and sampling."""

    def __init__(
        self,
        model: Transformer | Ensemble,
        tokenizer: Tokenizer,
        decode: DecodeConfig,
        device: torch.device | None = None,
        precision: str = "fp32",
    ):
        """precision: the run's train.precision; bf16 and fp16 runs decode with a copy of the model
        in that dtype, int8 with its linear layers quantized (runtime.inference_model); the caller's
        model is left as it is."""
        self.tokenizer, self.decode = tokenizer, decode
        self.device = device or next(model.parameters()).device
        self.parameters = sum(p.numel() for p in model.parameters())  # tied matrices once
        self.model, self.precision = inference_model(model, precision, self.device)
        self.max_positions = model.cfg.max_positions

    def translate(
        self,
        lines: Sequence[str],
        *,
        beam: int | None = None,
        nbest: int = 1,
        attention: bool = False,
        alignment: bool = False,
        sampling: Sampling | None = None,
        generator: torch.Generator | None = None,
        alpha: float | None = None,
        max_len: Sequence[float] | None = None,
        should_stop: Callable[[], bool] | None = None,
    ) -> list[list[Translation]]:
        """The `nbest` best translations of each line, best first (one per line when sampling).

        attention: add the cross-attention of each translation; alignment: add its word alignment
        (from that attention). An empty line gives one empty translation. `generator` carries a
        sampling seed across calls (translate_stream passes one); by default `sampling.seed` seeds
        each call. alpha and max_len (A, B) override the decode settings for this call; should_stop
        is asked between decoding steps and True raises search.Cancelled (the server stops work
        nobody waits for).
        """
        beam = self._beam(beam, nbest, sampling)
        if sampling is not None and generator is None:
            generator = sampling.generator(self.device)
        decode = decode_overrides(self.decode, alpha=alpha, max_len=max_len)
        ids = self.tokenizer.encode_src([line.strip() for line in lines])
        found = translate_ids(
            self.model,
            ids,
            decode,
            beam=beam,
            nbest=nbest,
            sampling=sampling,
            generator=generator,
            should_stop=should_stop,
        )
        out = [[self._translation(h) for h in hyps] for hyps in found]
        if attention or alignment:
            self._add_attention(ids, out, lines)
        return out

    def score(self, sources: Sequence[str], targets: Sequence[str]) -> list[Scored]:
        """Forced decoding: log P(target | source) of each pair, with per-token
        log-probabilities."""
        src_ids, tgt_ids = self._encode_pairs(sources, targets)
        logps = score_ids(self.model, src_ids, tgt_ids, self.decode.max_src_tokens)
        return [
            Scored(s, t, sum(lp), self.tokenizer.tgt.id_to_piece(ids), lp)
            for s, t, ids, lp in zip(sources, targets, tgt_ids, logps)
        ]

    def _translation(self, h: Hypothesis) -> Translation:
        return Translation(
            self.tokenizer.decode_tgt([h.tokens])[0],
            self.tokenizer.tgt.id_to_piece(h.tokens),
            h.logprob,
            h.score,
            h.token_logprobs,
        )

    def _add_attention(
        self, ids: list[list[int]], out: list[list[Translation]], lines: Sequence[str]
    ) -> None:
        """Teacher-force each translation to read its cross-attention; align words from the last
        layer."""
        limit = self.model.cfg.max_positions
        for src_ids, hyps in zip(ids, out):
            src = torch.tensor([list(src_ids[: limit - 1]) + [EOS]], device=self.device)  # (1, S)
            for h in hyps:
                tgt_in = torch.tensor(
                    [[BOS] + self.tokenizer.tgt.piece_to_id(h.pieces)], device=self.device
                )
                heads = self.model.cross_attention(src, tgt_in)[:, 0].float().cpu()  # (L, H, T, S)
                h.attention_heads = heads
                h.attention = heads[-1].mean(0).tolist()  # last layer, heads averaged: (T, S)
                h.source_pieces = self.tokenizer.src.id_to_piece(list(src_ids[: limit - 1]))
                h.alignment = align_words(heads[-1].mean(0), h.source_pieces, h.pieces)


def word_attention(
    attention: torch.Tensor, src_pieces: list[str], tgt_pieces: list[str]
) -> torch.Tensor:
    """Piece-level attention (T + 1, S + 1; EOS row and column last) -> word-level (target words,
    source words): summed over a source word's pieces, averaged over a target word's. Words are
    whitespace words, as SentencePiece's "▁" marks their first piece."""
    src_index, tgt_index = (
        torch.tensor(word_index(src_pieces)),
        torch.tensor(word_index(tgt_pieces)),
    )
    S, T = int(src_index.max()) + 1, int(tgt_index.max()) + 1
    by_src = torch.zeros(len(tgt_pieces), S).index_add_(1, src_index, attention[:-1, :-1].float())
    by_word = torch.zeros(T, S).index_add_(0, tgt_index, by_src)  # (T, S) sums over target pieces
    return by_word / torch.bincount(tgt_index, minlength=T).unsqueeze(1)


def align_words(
    attention: torch.Tensor, src_pieces: list[str], tgt_pieces: list[str]
) -> list[tuple[int, int]]:
    """Hard word alignment: each target word goes to the source word it attends to most."""
    if not src_pieces or not tgt_pieces:
        return []
    best = word_attention(attention, src_pieces, tgt_pieces).argmax(1).tolist()
    return [(s, t) for t, s in enumerate(best)]


def word_index(pieces: list[str]) -> list[int]:
    """The whitespace word each piece belongs to (a piece starting with "▁" starts a word)."""
    index, word = [], -1
    for p in pieces:
        if p.startswith("\u2581") or word < 0:
            word += 1
        index.append(word)
    return index


def words_of(pieces: list[str]) -> list[str]:
    """Whitespace words from SentencePiece pieces, grouped as word_index groups them."""
    words = [""] * (max(word_index(pieces)) + 1 if pieces else 0)
    for w, p in zip(word_index(pieces), pieces):
        words[w] += p
    return [w.lstrip("\u2581") for w in words]


def _line(text: str) -> str:
    """A line without its "\\n" (and a CRLF's "\\r"); lines end at "\\n" only."""
    text = text[:-1] if text.endswith("\n") else text
    return text[:-1] if text.endswith("\r") else text


def load_torch_translator(
    checkpoint: str | os.PathLike | Sequence[str | os.PathLike] | None = None,
    *,
    device: str = "auto",
    precision: str | None = None,
    beam: int | None = None,
    alpha: float | None = None,
    max_len: Sequence[float] | None = None,
) -> Translator:
    """Our engine's Translator for a checkpoint file or run directory (None: the newest run under
    ./runs/); several checkpoints decode as an ensemble (they must share one SentencePiece model).

    precision defaults to the one the run trained and validated in (trained_precision; int8: the
    linear layers quantized, on the CPU); beam, alpha and max_len (A, B: output at most A x source
    length + B tokens) override the run's decode settings. inference.load_translator is the API over
    both engines.
    """
    for c in (
        [checkpoint]
        if checkpoint is None or isinstance(checkpoint, (str, os.PathLike))
        else checkpoint
    ):
        if c is not None and is_export(c):
            raise ConfigError(f"{c} is a CTranslate2 export: decode it with --engine ctranslate2")
    if precision == "int8" and pick_device(device).type != "cpu":
        raise ConfigError(
            "--precision int8 (dynamic int8 quantization of the linear layers) runs on the CPU "
            "only: add --device cpu, or use bf16/fp16 on the GPU"
        )
    paths = [
        resolve_checkpoint(c)
        for c in (
            [checkpoint]
            if checkpoint is None or isinstance(checkpoint, (str, os.PathLike))
            else checkpoint
        )
    ]
    target = pick_device(device)
    loaded = [load_for_inference(p, target) for p in paths]
    model, tokenizer, cfg, ckpt = loaded[0]
    for path, (_, other, _, _) in zip(paths[1:], loaded[1:]):
        if other.digest != tokenizer.digest:
            raise CheckpointError(
                f"cannot ensemble {paths[0]} and {path}: their SentencePiece models differ "
                f"({tokenizer.digest} and {other.digest}); ensembles need one vocabulary"
            )
    if len(loaded) > 1:
        model = Ensemble([m for m, _, _, _ in loaded])
    cfg.decode = decode_overrides(cfg.decode, beam=beam, alpha=alpha, max_len=max_len)
    if precision is None:
        precision = trained_precision(ckpt, paths[0], cfg)
        if precision == "bf16" and target.type == "cpu" and not cpu_has_native_bf16():
            log.info(
                "the run trained in bf16, but bf16 is emulated on this CPU (%s): decoding in fp32 "
                "(--precision bf16 insists)",
                cpu_bf16_obstacle(),
            )
            precision = "fp32"
    translator = Translator(model, tokenizer, cfg.decode, device=target, precision=precision)
    translator.checkpoint, translator.config, translator.step = paths[0], cfg, ckpt.get("step")
    return translator


def trained_precision(ckpt: dict[str, Any], path: Path, cfg: Config) -> str:
    """The precision the run trained and validated in, which decoding follows by default (a
    bf16-output run decodes in fp32, as its validation did: runtime.inference_model). The
    checkpoint's train_state records it (precision auto's choice, e.g. bf16 or bf16-output on a
    CPU); a weights-only checkpoint (an average: best.pt after train.average_last, averaged.pt) has
    none, so the same run's checkpoints/last.pt is asked; without either, the saved train.precision
    stands (auto: resolved for the decoding device)."""
    recorded = (ckpt.get("train_state") or {}).get("precision")
    last = run_dir_of(path) / "checkpoints" / "last.pt"
    if not recorded and last.is_file() and last.resolve() != path.resolve():
        try:  # mmap: the tensors (weights, optimizer state) are not read, only the small dicts
            other = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001  an unreadable last.pt only loses the hint
            other = {}
        # the same run's
        if isinstance(other, dict) and other.get("tokenizer") == ckpt.get("tokenizer"):
            recorded = (other.get("train_state") or {}).get("precision")
    return recorded or cfg.train.precision


def decode_overrides(
    decode: DecodeConfig,
    *,
    beam: int | None = None,
    alpha: float | None = None,
    max_len: Sequence[float] | None = None,
) -> DecodeConfig:
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
