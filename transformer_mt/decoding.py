"""What sits below the two engines: the decoding options of one call, the engine interface, and
the results (`Translation`, `Scored`) with their word alignment.

translate.py (ours, PyTorch) and ct2.py (CTranslate2) implement `Engine`; inference.py, above them,
turns text into ids and back, truncates, batches and picks the engine. Neither engine imports the
other.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from .config import Config, ConfigError, DecodeConfig
from .search import Hypothesis, Sampling, StopCheck
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class DecodeOptions:
    """How to decode, per call: a run's `decode:` section gives the defaults (`from_config`), each
    call may override them (`replace`)."""

    beam: int = 4  # 1: greedy search
    nbest: int = 1  # hypotheses returned per sentence (<= beam)
    alpha: float = 0.6  # GNMT length penalty exponent (beam search)
    max_len_a: float = 1.5  # output budget: a x |source| + b tokens, EOS included
    max_len_b: int = 10
    sampling: Sampling | None = None  # draw tokens instead of searching (one hypothesis)
    # A batch's cost: sentences x beam x (longest source + 1), the source positions its hypotheses
    # attend to; the same unit for both engines, for sampling (counted at the call's beam, as
    # before) and for scoring (beam 1).
    max_src_tokens: int = 8192

    @classmethod
    def from_config(cls, decode: DecodeConfig) -> DecodeOptions:
        return cls(
            beam=decode.beam,
            alpha=decode.alpha,
            max_len_a=decode.max_len_a,
            max_len_b=decode.max_len_b,
            max_src_tokens=decode.max_src_tokens,
        )

    def replace(
        self,
        *,
        beam: int | None = None,
        nbest: int | None = None,
        alpha: float | None = None,
        max_len: Sequence[float] | None = None,
        sampling: Sampling | None = None,
    ) -> DecodeOptions:
        """These options with the given (not None) overrides, checked like the config's own."""
        changes: dict[str, Any] = {"sampling": sampling}
        if beam is not None:
            _check(beam >= 1, f"--beam must be >= 1, got {beam}")
            changes["beam"] = beam
        if alpha is not None:
            _check(alpha >= 0, f"--alpha must be >= 0, got {alpha:g}")
            changes["alpha"] = alpha
        if max_len is not None:
            a, b = max_len
            _check(b == int(b), f"--max-len: B must be a whole number of tokens, got {b}")
            _check(a >= 0 and b >= 1, f"--max-len A B needs A >= 0 and B >= 1, got {a:g} {b:g}")
            changes.update(max_len_a=float(a), max_len_b=int(b))
        out = dataclasses.replace(self, **changes, nbest=nbest or 1)
        if out.nbest > out.beam and sampling is None:
            raise ConfigError(
                f"--nbest {out.nbest} is more than the beam ({out.beam}): beam search keeps "
                f"{out.beam} hypotheses"
            )
        return out

    @property
    def searches(self) -> bool:
        """Beam search ranks by log P / length penalty; greedy search and sampling by log P."""
        return self.beam > 1 and self.sampling is None


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class Engine:
    """A model that decodes and scores batches of token ids: `translate.TorchEngine` (ours) or
    `ct2.CT2Engine` (CTranslate2). Sources come non-empty, truncated to max_positions - 1, without
    EOS (each engine adds it as its model expects), in one batch that inference.py cut."""

    name: str  # "torch" or "ctranslate2"
    tokenizer: Tokenizer
    device: Any
    precision: str
    max_positions: int
    parameters: int  # number of model parameters (tied matrices once)
    # Where it came from, when loaded from disk (None for a model in memory)
    checkpoint: Path | None = None
    members: tuple[Path, ...] = ()  # an ensemble's checkpoints (checkpoint is the first)
    config: Config | None = None
    step: int | None = None

    def search(
        self,
        ids: list[list[int]],
        options: DecodeOptions,
        *,
        generator: torch.Generator | None = None,
        should_stop: StopCheck = None,
        token_scores: bool = True,
        prefix: list[list[int]] | None = None,
    ) -> list[list[Hypothesis]]:
        """The options.nbest best hypotheses of each source (one when sampling), best first.
        token_scores=False may leave token_logprobs empty when that saves work. prefix: target ids
        each source's hypotheses start with ([]: none; at most max_positions - 1), the rest
        searched from there, within a budget of at least |prefix| + 1 tokens."""
        raise NotImplementedError

    def score(self, src_ids: list[list[int]], tgt_ids: list[list[int]]) -> list[list[float]]:
        """Forced decoding: each target token's log-probability given its source and the tokens
        before it, then EOS's."""
        raise NotImplementedError

    def cross_attention(self, src_ids: list[int], tgt_ids: list[int]) -> torch.Tensor:
        """Cross-attention of every layer and head while reading `tgt_ids` (layers, heads, |tgt|
        + 1, |src| + 1), EOS last on both sides."""
        raise ConfigError("attention and alignment need our engine: drop --engine ctranslate2")

    def seeded_generator(self, sampling: Sampling) -> torch.Generator | None:
        """The random generator a whole sampled call or stream draws from, seeded once."""
        return sampling.generator(self.device)


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


def empty_hypothesis(prefix: list[int] | None = None) -> Hypothesis:
    """What an empty source line translates to: nothing, or its target prefix (unscored)."""
    return Hypothesis(list(prefix or []), 0.0, 0.0, [])


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
