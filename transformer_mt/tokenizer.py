"""SentencePiece subword models: trained once on the training split, saved in the run directory.

Special ids are fixed for every model (vocab.py) so that the rest of the code can name them as
constants.
"""

from __future__ import annotations

import hashlib
import io
import itertools
import os
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import numpy as np
import sentencepiece as spm

from .config import TokenizerConfig
from .errors import UserError
from .fileio import atomic_write
from .vocab import BOS, EOS, PAD, UNK

_THREADS = max(1, os.cpu_count() or 1)  # SentencePiece encodes batches in parallel C++ threads


class Tokenizer:
    """Source and target SentencePiece models (the same object when the vocabulary is joint)."""

    def __init__(self, src_model: bytes, tgt_model: bytes | None = None):
        self.src_bytes = src_model
        self.tgt_bytes = tgt_model if tgt_model is not None else src_model
        self.joint = tgt_model is None
        self.src = spm.SentencePieceProcessor(model_proto=self.src_bytes)
        self.tgt = (
            self.src if self.joint else spm.SentencePieceProcessor(model_proto=self.tgt_bytes)
        )

    @property
    def src_vocab_size(self) -> int:
        return self.src.get_piece_size()

    @property
    def tgt_vocab_size(self) -> int:
        return self.tgt.get_piece_size()

    def sizes(self) -> tuple[int, int, bool]:
        """(source vocabulary size, target vocabulary size, joint): what a Transformer is built
        from."""
        return self.src_vocab_size, self.tgt_vocab_size, self.joint

    @property
    def digest(self) -> str:
        """A short hash of the model files: checkpoints and caches record which tokenizer they
        used."""
        h = hashlib.sha256(self.src_bytes)
        if not self.joint:
            h.update(self.tgt_bytes)
        return h.hexdigest()[:16]

    def encode_src(self, lines: Sequence[str]) -> list[list[int]]:
        return self.src.encode(list(lines), num_threads=_THREADS)

    def encode_tgt(self, lines: Sequence[str]) -> list[list[int]]:
        return self.tgt.encode(list(lines), num_threads=_THREADS)

    def nbest(self, lines: Sequence[str], n: int, side: str = "src") -> list[list[list[int]]]:
        """The ids of the `n` best segmentations of each line under the unigram model of `side`
        ("src" or "tgt"), best first (an empty line: one empty segmentation)."""
        proc = self.src if side == "src" else self.tgt
        try:
            return [proc.nbest_encode_as_ids(line, nbest_size=n) or [[]] for line in lines]
        except RuntimeError as e:  # a BPE model: SentencePiece has no n-best for it
            raise UserError(
                "data.subword_sampling needs a unigram SentencePiece model, and this one has no "
                f"n-best segmentations (SentencePiece: {str(e).strip()}): set "
                "data.subword_sampling.nbest: 0"
            ) from None

    def piece_log_probs(self, side: str = "src") -> np.ndarray:
        """(vocabulary,) each piece's log-probability under the unigram model of `side`: a
        segmentation's is the sum over its pieces (0 for special and unknown pieces)."""
        proc = self.src if side == "src" else self.tgt
        return np.array([proc.get_score(i) for i in range(proc.get_piece_size())], np.float64)

    def decode_tgt(self, ids: Sequence[Sequence[int]]) -> list[str]:
        # SentencePiece gives "" for []
        return self.tgt.decode([list(x) for x in ids]) if len(ids) else []

    def save(self, run_dir: str | os.PathLike) -> None:
        """Write spm.model (joint) or spm.src.model + spm.tgt.model, each atomically."""
        run_dir = Path(run_dir)
        if self.joint:
            atomic_write(run_dir / "spm.model", self.src_bytes)
        else:
            atomic_write(run_dir / "spm.src.model", self.src_bytes)
            atomic_write(run_dir / "spm.tgt.model", self.tgt_bytes)

    @classmethod
    def load(cls, run_dir: str | os.PathLike) -> "Tokenizer":
        run_dir = Path(run_dir)
        if (run_dir / "spm.model").exists():
            return cls((run_dir / "spm.model").read_bytes())
        src, tgt = run_dir / "spm.src.model", run_dir / "spm.tgt.model"
        if src.exists() and tgt.exists():
            return cls(src.read_bytes(), tgt.read_bytes())
        # one half of a separate vocabulary: e.g. a copy that missed a file
        if src.exists() or tgt.exists():
            missing, present = (tgt, src.name) if src.exists() else (src, tgt.name)
            raise UserError(
                f"SentencePiece model not found: {missing} (a separate vocabulary needs "
                f"spm.src.model and spm.tgt.model; {present} is there): copy it back from the run "
                f"it came from, or remove {present} as well (translate then uses the models stored "
                "in the checkpoint, train trains new ones)"
            )
        raise UserError(
            f"no SentencePiece model in {run_dir}: it needs spm.model, or spm.src.model and "
            "spm.tgt.model (a separate vocabulary)"
        )

    @staticmethod
    def exists(run_dir: str | os.PathLike) -> bool:
        run_dir = Path(run_dir)
        return (run_dir / "spm.model").exists() or (run_dir / "spm.src.model").exists()


def train_tokenizer(
    cfg: TokenizerConfig, src_lines: Iterable[str], tgt_lines: Iterable[str], seed: int = 1
) -> Tokenizer:
    """Train SentencePiece on the training split: one joint model, or one per language.

    The lines may be streamed: SentencePiece keeps a random sample of at most
    `tokenizer.max_sentences` of them, so memory does not grow with the corpus.
    """
    if cfg.joint:
        return Tokenizer(_train_one(cfg, itertools.chain(src_lines, tgt_lines), seed))
    return Tokenizer(_train_one(cfg, src_lines, seed), _train_one(cfg, tgt_lines, seed))


def _train_one(cfg: TokenizerConfig, lines: Iterable[str], seed: int) -> bytes:
    buf = io.BytesIO()
    spm.set_random_generator_seed(seed)
    failed: list[BaseException] = []

    def guarded() -> Iterator[str]:
        """Feed SentencePiece; an error from reading the corpus is kept and raised as it is."""
        try:
            yield from (line for line in lines if line.strip())
        except Exception as e:  # noqa: BLE001  re-raised below, after SentencePiece returns
            failed.append(e)

    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=guarded(),
            model_writer=buf,
            model_type=cfg.type,
            vocab_size=cfg.vocab_size,
            hard_vocab_limit=False,  # a small corpus gets a smaller vocabulary instead of an error
            character_coverage=cfg.character_coverage
            if cfg.character_coverage is not None
            else 1.0,
            byte_fallback=cfg.byte_fallback,
            input_sentence_size=cfg.max_sentences,
            shuffle_input_sentence=True,
            pad_id=PAD,
            unk_id=UNK,
            bos_id=BOS,
            eos_id=EOS,
            num_threads=max(1, os.cpu_count() or 1),
            minloglevel=2,
        )
    except RuntimeError as e:  # e.g. a vocabulary smaller than the corpus's character set
        if failed:
            raise failed[0] from None
        raise UserError(
            f"config error: tokenizer.vocab_size={cfg.vocab_size} does not fit this corpus: "
            f"SentencePiece says: {str(e).strip().splitlines()[-1]}"
        ) from None
    if failed:
        raise failed[0]
    return buf.getvalue()
