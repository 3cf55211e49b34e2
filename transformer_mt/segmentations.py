"""Subword regularisation (`data.subword_sampling`, Kudo 2018): each epoch, every training
sentence is cut into subwords anew, its segmentation drawn from its n best under the unigram
model with probability proportional to P(segmentation)^alpha, on both sides.

SentencePiece finds the n best and their log-probabilities once, at start-up; the draws are ours,
from numpy seeded by (seed, epoch), because SentencePiece's own sampler cannot be seeded
reproducibly from Python (its generator is per thread; sentencepiece issue #609). So a resumed run
draws what the uninterrupted run would have, and every DDP rank draws the same, which keeps their
batches (cut by length) identical.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from .config import Config
from .data import TokenizedCorpus, chunks, iter_split
from .tokenizer import Tokenizer

log = logging.getLogger("transformer_mt")


@dataclass
class NBest:
    """One side's candidate segmentations, flat: candidate c is ids[offsets[c]:offsets[c + 1]],
    sentence i's candidates are first[i] .. first[i + 1] - 1 (best first), drawn with prob[c]."""

    ids: np.ndarray  # (all candidates' tokens,) int32
    offsets: np.ndarray  # (candidates + 1,) int64
    first: np.ndarray  # (sentences + 1,) int64
    prob: np.ndarray  # (candidates,) float64, summing to 1 over each sentence's candidates

    @classmethod
    def build(
        cls, per_line: list[list[list[int]]], log_probs: np.ndarray, alpha: float, max_len: int
    ) -> NBest:
        """From each line's candidates (ids, best first) and the pieces' log-probabilities.
        Candidates longer than `max_len` are left out (the best one always stays: data.max_len
        drops its pair)."""
        kept = [[c[0]] + [x for x in c[1:] if len(x) <= max_len] for c in per_line]
        counts = np.fromiter((len(c) for c in kept), np.int64, len(kept))
        cands = [x for c in kept for x in c]
        lens = np.fromiter((len(x) for x in cands), np.int64, len(cands))
        ids = np.fromiter((t for x in cands for t in x), np.int32, int(lens.sum()))
        offsets, first = _starts(lens), _starts(counts)
        # a segmentation's log P: its pieces' summed (0 for an empty line's empty one)
        owner = np.repeat(np.arange(len(cands)), lens)
        logit = alpha * np.bincount(owner, weights=log_probs[ids], minlength=len(cands))
        # softmax of alpha * log P within each sentence: P^alpha, normalised
        logit -= np.repeat(np.maximum.reduceat(logit, first[:-1]), counts)
        weight = np.exp(logit)
        prob = weight / np.repeat(np.add.reduceat(weight, first[:-1]), counts)
        return cls(ids, offsets, first, prob)

    @classmethod
    def concat(cls, parts: list[NBest]) -> NBest:
        """The chunks' candidates as one list of sentences."""
        ids = np.concatenate([p.ids for p in parts])
        offsets = _starts(np.concatenate([p.lens for p in parts]))
        first = _starts(np.concatenate([np.diff(p.first) for p in parts]))
        return cls(ids, offsets, first, np.concatenate([p.prob for p in parts]))

    @property
    def lens(self) -> np.ndarray:
        return np.diff(self.offsets)

    def draw(self, rng: np.random.Generator) -> np.ndarray:
        """(sentences,) the candidate drawn for each sentence: the first whose running probability
        within its sentence passes a uniform draw."""
        cum = np.cumsum(self.prob)
        below = np.concatenate([[0.0], cum])[self.first[:-1]]  # mass of the earlier sentences
        chosen = np.searchsorted(cum, below + rng.random(len(below)), side="right")
        return np.clip(chosen, self.first[:-1], self.first[1:] - 1)

    def gather(self, chosen: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The chosen candidates' ids, flat, and their offsets."""
        starts, lens = self.offsets[chosen], self.lens[chosen]
        offsets = np.concatenate([[0], np.cumsum(lens)])
        # position k of the output is token (k - offsets[row]) of the row's candidate
        index = np.arange(offsets[-1]) + np.repeat(starts - offsets[:-1], lens)
        return self.ids[index], offsets

    def best_share(self) -> float:
        """The mean probability that a sentence keeps its best segmentation."""
        return float(self.prob[self.first[:-1]].mean())

    def expected_tokens(self) -> float:
        """Expected tokens of an epoch over those of the best segmentations."""
        return float((self.prob * self.lens).sum() / self.lens[self.first[:-1]].sum())


def _starts(lens: np.ndarray) -> np.ndarray:
    """(n + 1,) where each of n consecutive runs of `lens` starts, and the end."""
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


class SampledSegmentations:
    """The training corpus of each epoch, re-segmented: what data.EpochBatches batches from."""

    def __init__(self, src: NBest, tgt: NBest, seed: int):
        self.src, self.tgt, self.seed = src, tgt, seed

    def corpus(self, epoch: int) -> TokenizedCorpus:
        """Epoch `epoch`'s segmentation of every training pair: a pure function of (seed, epoch)."""
        rng = np.random.default_rng([self.seed, epoch, 0x5E6])  # not make_batches' stream
        src_ids, src_offsets = self.src.gather(self.src.draw(rng))
        tgt_ids, tgt_offsets = self.tgt.gather(self.tgt.draw(rng))
        return TokenizedCorpus(src_ids, src_offsets, tgt_ids, tgt_offsets)


def sampled_segmentations(
    cfg: Config, tokenizer: Tokenizer, chunk_size: int = 20_000
) -> SampledSegmentations | None:
    """The n best segmentations of the training split when data.subword_sampling is on (held in
    memory: meant for corpora of up to some hundred thousand pairs); None when it is off."""
    sampling = cfg.data.subword_sampling
    if not sampling.nbest:
        return None
    start = time.perf_counter()
    log_probs = [tokenizer.piece_log_probs(side) for side in ("src", "tgt")]
    parts: list[list[NBest]] = [[], []]
    # chunk by chunk: only one chunk's candidates are ever Python lists
    for chunk in chunks(iter_split(cfg.data, "train"), chunk_size):
        for i, side in enumerate(("src", "tgt")):
            found = tokenizer.nbest([pair[i] for pair in chunk], sampling.nbest, side)
            parts[i].append(NBest.build(found, log_probs[i], sampling.alpha, cfg.data.max_len))
    sides = [NBest.concat(p) for p in parts]
    log.info(
        "subword sampling: the %d best segmentations of %d training pairs in %.1f s (%.0f MiB); an "
        "epoch keeps the best one for %.0f%% of source and %.0f%% of target sentences (alpha %g) "
        "and holds %.2fx and %.2fx their tokens",
        sampling.nbest,
        len(sides[0].first) - 1,
        time.perf_counter() - start,
        sum(s.ids.nbytes + s.offsets.nbytes + s.prob.nbytes for s in sides) / 2**20,
        100 * sides[0].best_share(),
        100 * sides[1].best_share(),
        sampling.alpha,
        sides[0].expected_tokens(),
        sides[1].expected_tokens(),
    )
    return SampledSegmentations(*sides, seed=cfg.train.seed)
