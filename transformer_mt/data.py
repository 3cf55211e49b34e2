"""Parallel corpora: read (text files, TSV/JSONL, Hugging Face hub) → tokenize once, cache → batch.

Batches are token-budgeted and length-bucketed; their order is a pure function of (seed, epoch),
so a run can resume mid-epoch and data-parallel ranks can take disjoint shards.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import itertools
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable, Iterator, Protocol, Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from .config import Config, DataConfig, TrainConfig
from .errors import UserError
from .fileio import temp_dir
from .tokenizer import Tokenizer, train_tokenizer
from .vocab import BOS, EOS, PAD, UNK

log = logging.getLogger("transformer_mt")


class DataError(UserError):
    """A corpus that cannot be read or used as it is."""


# --------------------------------------------------------------------------- reading


def read_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """Source and target sentences of one split (train/valid/test), line-aligned, in memory."""
    src, tgt = [], []
    for s, t in iter_split(cfg, split):
        src.append(s)
        tgt.append(t)
    return src, tgt


def iter_split(cfg: DataConfig, split: str) -> Iterator[tuple[str, str]]:
    """(source, target) pairs of one split, streamed: a corpus larger than memory can be read."""
    where = getattr(cfg, split)
    if where is None:
        raise DataError(
            f"data.{split} is not set in the config: give a "
            + ("split name" if cfg.format == "hf" else "path")
            + f" for the {split} split"
        )
    if cfg.format == "text":
        src_path, tgt_path = (text_file(where, lang) for lang in (cfg.src_lang, cfg.tgt_lang))
        yield from _iter_text_pairs(src_path, tgt_path, f"data.{split}", cfg.invalid_utf8)
    elif cfg.format == "tsv":
        yield from _iter_tsv_pairs(record_file(where, split), cfg.invalid_utf8)
    else:
        yield from _iter_records(cfg, split, where)


class _LineDecoder:
    """Decodes one file's lines: invalid UTF-8 stops at file:line (`error`) or is replaced and
    counted for one warning at the end (`replace`) — never a deep traceback."""

    def __init__(self, path: Path, invalid_utf8: str):
        self.path, self.replace = path, invalid_utf8 == "replace"
        self.replaced, self.first = 0, 0

    def __call__(self, raw: bytes, n: int) -> str:
        return self.decode(raw.rstrip(b"\n").rstrip(b"\r"), n)

    def decode(self, raw: bytes, n: int) -> str:
        """Line n's bytes (its ending kept, if any) as text."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if not self.replace:
                raise DataError(
                    f"{self.path}:{n}: invalid UTF-8 ({e.reason} at byte {e.start} of the line); "
                    "re-encode the file as UTF-8, or set data.invalid_utf8: replace"
                ) from None
            self.replaced += 1
            self.first = self.first or n
            return raw.decode("utf-8", errors="replace")

    def warn(self) -> None:
        if self.replaced:
            log.warning(
                "%s: %d line(s) with invalid UTF-8 (first: line %d); bytes replaced by U+FFFD",
                self.path,
                self.replaced,
                self.first,
            )


class TextLines:
    """The lines of a binary stream (stdin, a --input file) as text, each ending at "\\n" only and
    keeping it, the policy of every file a user decodes or scores: invalid UTF-8 becomes U+FFFD, and
    warn() says once, at the end, how many lines had any (never a traceback, never a silent
    replacement)."""

    def __init__(self, raw: BinaryIO, name: str):
        self.raw, self.n = raw, 0
        self._decode = _LineDecoder(Path(name), "replace")

    def isatty(self) -> bool:
        return self.raw.isatty()

    def readline(self) -> str:
        # returns as soon as a line is there: a person at a terminal gets answers
        raw = self.raw.readline()
        if not raw:
            return ""
        self.n += 1
        return self._decode.decode(raw, self.n)

    def __iter__(self) -> Iterator[str]:
        return iter(self.readline, "")

    def warn(self) -> None:
        self._decode.warn()


def pair_lines(src: str | os.PathLike, tgt: str | os.PathLike) -> Iterator[tuple[str, str]]:
    """Line N of each of two files (plain or .gz), streamed; a length mismatch is an error with both
    counts. Invalid UTF-8 is replaced and counted, as in every file given to translate, score or
    evaluate (TextLines)."""
    return _iter_text_pairs(Path(src), Path(tgt), "--src/--ref", "replace")


def _iter_text_pairs(
    src_path: Path, tgt_path: Path, where: str, invalid_utf8: str
) -> Iterator[tuple[str, str]]:
    """Line N of each file, decoded; a length mismatch is reported with both counts."""
    decode_src, decode_tgt = (
        _LineDecoder(src_path, invalid_utf8),
        _LineDecoder(tgt_path, invalid_utf8),
    )
    with _open_binary(src_path) as fs, _open_binary(tgt_path) as ft:
        n = 0
        try:
            for n, (bs, bt) in enumerate(itertools.zip_longest(fs, ft), 1):
                if bs is None or bt is None:
                    n_src = n - 1 + (bs is not None) + sum(1 for _ in fs)
                    n_tgt = n - 1 + (bt is not None) + sum(1 for _ in ft)
                    raise DataError(
                        f"{where}: {src_path} has {n_src} lines but {tgt_path} has {n_tgt}; line N "
                        "of one must translate line N of the other"
                    )
                yield decode_src(bs, n), decode_tgt(bt, n)
        except (OSError, EOFError) as e:
            raise DataError(
                f"cannot read corpus file {src_path} or {tgt_path} (line {n}): {e}"
            ) from None
    decode_src.warn()
    decode_tgt.warn()


def _iter_tsv_pairs(path: Path, invalid_utf8: str) -> Iterator[tuple[str, str]]:
    """Rows of exactly two tab-separated fields, taken verbatim (no quoting, no NA values). Any
    other number of fields stops at file:line: guessing would pair a sentence with the wrong
    translation."""
    decode = _LineDecoder(path, invalid_utf8)
    with _open_binary(path) as f:
        n = 0
        try:
            for n, raw in enumerate(f, 1):
                fields = decode(raw, n).split("\t")
                if len(fields) != 2:
                    raise DataError(
                        f"{path}:{n}: expected 2 tab-separated fields (source, target), found "
                        f"{len(fields)}; a tab inside a sentence must be replaced, and a blank "
                        "line removed"
                    )
                yield fields[0], fields[1]
        except (OSError, EOFError) as e:
            raise DataError(f"cannot read corpus file {path} (line {n}): {e}") from None
    decode.warn()


def _open_binary(path: Path):
    try:
        return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
    except FileNotFoundError:
        raise DataError(f"corpus file not found: {path}") from None
    except OSError as e:
        raise DataError(f"cannot read corpus file {path}: {e.strerror}") from None


def text_file(prefix: str, lang: str) -> Path:
    """PREFIX.LANG, or PREFIX.LANG.gz when only that exists."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise DataError(
        f"corpus file not found: {prefix}.{lang} (or {prefix}.{lang}.gz); check the data paths in "
        f"the config (relative paths start at {os.getcwd()})"
    )


def record_file(where: str, split: str) -> Path:
    """The one file of a tsv/jsonl split."""
    if not Path(where).is_file():
        raise DataError(f"data.{split}: corpus file not found: {where}")
    return Path(where)


def read_lines(path: str | os.PathLike, invalid_utf8: str = "replace") -> list[str]:
    """All lines of a UTF-8 text file (optionally .gz), without line endings; invalid UTF-8 is
    replaced and counted in one warning (TextLines' policy), or with invalid_utf8="error" stops at
    file:line."""
    path = Path(path)
    decode = _LineDecoder(path, invalid_utf8)
    with _open_binary(path) as f:
        try:
            lines = [decode(raw, n) for n, raw in enumerate(f, 1)]
        except (OSError, EOFError) as e:
            raise DataError(f"cannot read corpus file {path}: {e}") from None
    decode.warn()
    return lines


def _iter_records(cfg: DataConfig, split: str, where: str) -> Iterator[tuple[str, str]]:
    """JSONL through `datasets`' json loader, or a dataset from the Hugging Face hub
    (rows come from memory-mapped Arrow files, not from RAM)."""
    src_field, tgt_field = cfg.fields
    if cfg.format == "jsonl":
        ds = _datasets().load_dataset(
            "json", data_files={split: str(record_file(where, split))}, split=split
        )
    else:
        ds = load_hub_dataset(cfg.dataset, cfg.dataset_config, where)
    for row in ds:
        yield (
            _field(row, src_field, f"data.{split}", "src_field"),
            _field(row, tgt_field, f"data.{split}", "tgt_field"),
        )


def _field(row: dict, dotted: str, where: str, key: str) -> str:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            fields = ", ".join(row.keys())
            raise DataError(
                f"{where}: records have no field {dotted!r} (fields: {fields}); set data.{key} "
                "(dots reach into nested fields, e.g. translation.en)"
            )
        value = value[part]
    return "" if value is None else str(value)


def _datasets():
    import datasets  # imported lazily: it is slow to import and only some corpora need it

    datasets.logging.set_verbosity_error()
    return datasets


def load_hub_dataset(name: str, config: str | None, split: str):
    """`datasets.load_dataset` for a hub name; offline it uses the local cache or fails fast."""
    datasets = _datasets()
    offline = (
        os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _hub_reachable()
    )
    if offline:
        # Without this the hub client retries for about half a minute before giving up.
        import huggingface_hub.constants

        datasets.config.HF_HUB_OFFLINE = True
        huggingface_hub.constants.HF_HUB_OFFLINE = True
    try:
        return datasets.load_dataset(name, config, split=split)
    except Exception as e:  # the hub client raises many types; all mean "could not load"
        if offline:
            raise DataError(
                f"data.dataset: cannot load {name!r} from the Hugging Face hub: the hub is not "
                "reachable from this machine (offline) and the dataset is not in the local cache. "
                "Download it once on a machine with internet, or point the config at local files "
                "(data.format: text)."
            ) from None
        raise DataError(
            f"data.dataset: cannot load {name!r} (config {config!r}, split {split!r}): {e}"
        ) from None


def _hub_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


# --------------------------------------------------------------------------- tokenized corpora


@dataclass
class TokenizedCorpus:
    """Token ids of one split, stored flat with offsets (ready for memory-mapping)."""

    src_ids: np.ndarray  # (total_src_tokens,) int32
    src_offsets: np.ndarray  # (n + 1,) int64
    tgt_ids: np.ndarray
    tgt_offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.src_offsets) - 1

    @property
    def src_lens(self) -> np.ndarray:
        return np.diff(self.src_offsets)

    @property
    def tgt_lens(self) -> np.ndarray:
        return np.diff(self.tgt_offsets)

    def src(self, i: int) -> np.ndarray:
        return self.src_ids[self.src_offsets[i] : self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i] : self.tgt_offsets[i + 1]]

    @classmethod
    def from_lists(
        cls, src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]]
    ) -> "TokenizedCorpus":
        (src_ids, src_lens), (tgt_ids, tgt_lens) = _flatten(src), _flatten(tgt)
        return cls(src_ids, _offsets(src_lens), tgt_ids, _offsets(tgt_lens))

    @classmethod
    def load(cls, folder: Path) -> "TokenizedCorpus":
        """Token ids stay on disk (memory-mapped): only the pages a batch touches are read."""

        def ids(name: str) -> np.ndarray:
            path = folder / f"{name}.bin"
            return (
                np.memmap(path, dtype=np.int32, mode="r")
                if path.stat().st_size
                else np.zeros(0, np.int32)
            )

        return cls(
            ids("src_ids"),
            np.load(folder / "src_offsets.npy"),
            ids("tgt_ids"),
            np.load(folder / "tgt_offsets.npy"),
        )


def both_ways(corpus: TokenizedCorpus) -> TokenizedCorpus:
    """`corpus` followed by its pairs reversed: pair len(corpus) + i is pair i from target to
    source (bidirectional training; both sides must share one vocabulary)."""

    def join(ids, offsets, more_ids, more_offsets) -> tuple[np.ndarray, np.ndarray]:
        """One side's ids and offsets, then another's (its offsets, which start at 0 like every
        corpus's, shifted past the first's)."""
        shifted = more_offsets[1:] + offsets[-1]
        return np.concatenate([ids, more_ids]), np.concatenate([offsets, shifted])

    c = corpus
    return TokenizedCorpus(
        *join(c.src_ids, c.src_offsets, c.tgt_ids, c.tgt_offsets),
        *join(c.tgt_ids, c.tgt_offsets, c.src_ids, c.src_offsets),
    )


class _CorpusWriter:
    """Appends tokenized chunks to raw int32 files in a folder of its own; offsets and the
    publishing rename come at the end (see _publish: two processes filling the same entry at once
    both succeed)."""

    def __init__(self, folder: Path):
        self.folder = folder

    def __enter__(self) -> "_CorpusWriter":
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        # Unique per writer (not per pid: threads, and a pid reused after a crash): nobody else
        # touches it.
        self.tmp = temp_dir(self.folder.parent, prefix=f"{self.folder.name}.tmp{os.getpid()}-")
        self.files = [open(self.tmp / "src_ids.bin", "wb"), open(self.tmp / "tgt_ids.bin", "wb")]
        self.lens: list[list[np.ndarray]] = [[], []]
        return self

    def add(
        self, src_ids: np.ndarray, src_lens: np.ndarray, tgt_ids: np.ndarray, tgt_lens: np.ndarray
    ) -> None:
        for side, (ids, lens) in enumerate(((src_ids, src_lens), (tgt_ids, tgt_lens))):
            self.files[side].write(np.ascontiguousarray(ids, dtype=np.int32).tobytes())
            self.lens[side].append(np.asarray(lens, dtype=np.int64))

    def __exit__(self, exc_type, *rest) -> None:
        for f in self.files:
            f.close()
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        for side, name in enumerate(("src", "tgt")):
            lens = np.concatenate(self.lens[side]) if self.lens[side] else np.zeros(0, np.int64)
            offsets = np.zeros(len(lens) + 1, dtype=np.int64)
            np.cumsum(lens, out=offsets[1:])
            np.save(self.tmp / f"{name}_offsets.npy", offsets)
        _publish(self.tmp, self.folder)


def _publish(tmp: Path, folder: Path) -> None:
    """Rename a finished cache entry into place. The rename is atomic, so a reader sees a whole
    entry or none; it never replaces a complete entry (a reader may be memory-mapping it): when
    another process published the same entry first, its copy holds the same ids and ours is
    dropped."""
    for attempt in range(2):
        try:
            os.rename(tmp, folder)  # onto an existing non-empty folder: OSError, whoever wrote it
            return
        except OSError:
            if not folder.is_dir():
                raise
        if (folder / "tgt_offsets.npy").exists():  # complete: another writer won
            shutil.rmtree(tmp, ignore_errors=True)
            return
        # incomplete: not written by this code, which publishes whole folders; move it aside
        if not attempt:
            aside = temp_dir(folder.parent, prefix=f"{folder.name}.stale-")
            with contextlib.suppress(OSError):  # another process may have moved it already
                os.replace(folder, aside / folder.name)
            shutil.rmtree(aside, ignore_errors=True)
    shutil.rmtree(tmp, ignore_errors=True)
    raise DataError(
        f"token cache entry {folder} exists but is incomplete and cannot be replaced: delete it"
    )


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (flat int32 ids, int64 lengths)."""
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(lens.sum()))
    return flat, lens


def _offsets(lens: np.ndarray) -> np.ndarray:
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return offsets


def corpus_key(cfg: DataConfig, split: str, tokenizer: Tokenizer) -> str:
    """Identifies a tokenized split by what it holds: the corpus files' contents (or the hub
    dataset's fingerprint) and the tokenizer. A rewrite that keeps size and mtime (cp -p, rsync -t)
    is seen."""
    where = getattr(cfg, split)
    ident: dict = {
        "cache_format": 3,
        "format": cfg.format,
        "split": where,
        "fields": cfg.fields,
        "tokenizer": tokenizer.digest,
    }
    if cfg.format == "text":
        files = [text_file(where, lang) for lang in (cfg.src_lang, cfg.tgt_lang)]
    elif cfg.format in ("tsv", "jsonl"):
        files = [record_file(where, split)]
    else:
        files = []
        ds = load_hub_dataset(cfg.dataset, cfg.dataset_config, where)
        # changes with the data's revision
        ident["dataset"] = [cfg.dataset, cfg.dataset_config, ds._fingerprint]
    ident["files"] = [_file_digest(f) for f in files]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _file_digest(path: Path) -> str:
    """BLAKE2b of a file's bytes, read in 1 MiB pieces (memory stays flat whatever the size)."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def cache_dir(cfg: DataConfig) -> Path:
    """data.cache_dir, else $TMT_CACHE, else ~/.cache/transformer_mt: shared by runs, keyed per
    corpus."""
    return Path(
        cfg.cache_dir or os.environ.get("TMT_CACHE") or Path.home() / ".cache" / "transformer_mt"
    )


def load_tokenized(
    cfg: DataConfig, split: str, tokenizer: Tokenizer, cache_dir: Path, chunk_size: int = 50_000
) -> TokenizedCorpus:
    """Tokenize a split once, in chunks, into a cache of token-id arrays that later calls (and later
    runs) memory-map; memory stays bounded by the chunk, whatever the corpus size."""
    folder = Path(cache_dir) / f"{split}-{corpus_key(cfg, split, tokenizer)}"
    if (folder / "tgt_offsets.npy").exists():
        return TokenizedCorpus.load(folder)
    n = 0
    with _CorpusWriter(folder) as writer:
        for chunk in chunks(iter_split(cfg, split), chunk_size):
            # SentencePiece encodes on all cores
            src_ids = tokenizer.encode_src([s for s, _ in chunk])
            tgt_ids = tokenizer.encode_tgt([t for _, t in chunk])
            writer.add(*_flatten(src_ids), *_flatten(tgt_ids))
            n += len(chunk)
        if n == 0:
            raise DataError(f"data.{split}: the corpus is empty")
    return TokenizedCorpus.load(folder)


def chunks(items: Iterable, size: int) -> Iterator[list]:
    """Lists of `size` items (the last one shorter), pulled from `items` as needed."""
    it = iter(items)
    while chunk := list(itertools.islice(it, size)):
        yield chunk


def usable_indices(corpus: TokenizedCorpus, max_len: int, split: str) -> np.ndarray:
    """Indices of pairs with both sides non-empty and at most max_len tokens; warns with counts."""
    src_lens, tgt_lens = corpus.src_lens, corpus.tgt_lens
    empty = (src_lens == 0) | (tgt_lens == 0)
    too_long = ~empty & ((src_lens > max_len) | (tgt_lens > max_len))
    if empty.any():
        log.warning("%s: dropped %d pairs with an empty side", split, int(empty.sum()))
    if too_long.any():
        log.warning(
            "%s: dropped %d pairs longer than data.max_len=%d tokens",
            split,
            int(too_long.sum()),
            max_len,
        )
    keep = np.flatnonzero(~(empty | too_long))
    if len(keep) == 0:
        raise DataError(
            f"data.{split}: no usable sentence pairs (all empty or longer than data.max_len)"
        )
    return keep


# --------------------------------------------------------------------------- a run's data


def prepare_tokenizer(cfg: Config, run_dir: Path) -> Tokenizer:
    """Reuse the run's SentencePiece model if there is one; otherwise train it on the train
    split."""
    if Tokenizer.exists(run_dir):
        return Tokenizer.load(run_dir)
    log.info(
        "training SentencePiece (%s, %d pieces, %s) on the training split",
        cfg.tokenizer.type,
        cfg.tokenizer.vocab_size,
        "joint" if cfg.tokenizer.joint else "separate",
    )
    pairs = lambda: iter_split(cfg.data, "train")  # noqa: E731  streamed, twice
    if next(pairs(), None) is None:
        raise DataError("data.train: the corpus is empty")
    tok = train_tokenizer(
        cfg.tokenizer, (s for s, _ in pairs()), (t for _, t in pairs()), seed=cfg.train.seed
    )
    tok.save(run_dir)
    return tok


class EpochSegmentations(Protocol):
    """The training corpus as one epoch sees it (segmentations.SampledSegmentations)."""

    def corpus(self, epoch: int) -> TokenizedCorpus: ...


@dataclass
class TrainingData:
    """The tokenized splits and the pairs of each that the loop uses; with subword sampling, the
    training pairs' segmentation of each epoch (`train` keeps the best one of each)."""

    train: TokenizedCorpus
    train_idx: np.ndarray
    valid: TokenizedCorpus | None = None
    valid_idx: np.ndarray | None = None
    segmentations: EpochSegmentations | None = None


def prepare_data(cfg: Config, tokenizer: Tokenizer) -> TrainingData:
    """Tokenize (or memory-map from the cache) the train and valid splits; drop unusable pairs."""
    cache = cache_dir(cfg.data)
    train = load_tokenized(cfg.data, "train", tokenizer, cache)
    data = TrainingData(train, usable_indices(train, cfg.data.max_len, "train"))
    if cfg.data.valid is not None:
        data.valid = load_tokenized(cfg.data, "valid", tokenizer, cache)
        data.valid_idx = usable_indices(data.valid, cfg.model.max_positions - 1, "valid")
    return data


# --------------------------------------------------------------------------- batching


def make_batches(
    src_lens: np.ndarray,
    tgt_lens: np.ndarray,
    max_tokens: int,
    *,
    seed: int,
    epoch: int,
    shuffle: bool = True,
) -> list[np.ndarray]:
    """Token-budget batches of similar-length pairs; a pure function of (lengths, seed, epoch).

    Each batch holds at most `max_tokens` = n_sentences x longest side (+1 for EOS/BOS).
    Pairs are sorted by their longer side, then by source length (ties broken by an epoch-seeded
    shuffle), cut greedily, and the batch order is shuffled; BENCHMARKS.md gives the padding this
    leaves. Returns positions into the length arrays.
    """
    n = len(src_lens)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    longer = np.maximum(src_lens, tgt_lens)
    # stable: last key is the primary one
    order = order[np.lexsort((src_lens[order], longer[order]))]
    batches = cut_batches(order, longer[order] + 1, max_tokens)
    if shuffle:
        rng.shuffle(batches)
    return batches


def cut_batches(order: np.ndarray, widths: np.ndarray, max_tokens: int) -> list[np.ndarray]:
    """Cut `order` greedily into consecutive batches of at most `max_tokens` = rows x widest row.

    widths[i] is the padded width of item order[i]; sort by width first, or padding grows. A single
    item wider than the budget still makes a batch of its own.
    """
    batches, start, widest = [], 0, 0
    for i in range(len(order)):
        widest_i = max(widest, int(widths[i]))
        if i > start and widest_i * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, widest_i = i, int(widths[i])
        widest = widest_i
    if len(order):
        batches.append(order[start:])
    return batches


@dataclass
class Batch:
    """Padded tensors for one batch; token counts are known on the host (no device sync)."""

    src: torch.Tensor  # (B, S) source ids + EOS, PAD-padded
    tgt_in: torch.Tensor  # (B, T) BOS + target ids
    tgt_out: torch.Tensor  # (B, T) target ids + EOS
    n_tgt_tokens: int  # real (non-pad) tokens of tgt_out
    n_src_tokens: int

    def to(self, device: torch.device) -> "Batch":
        nb = device.type == "cuda"
        return Batch(
            *(t.to(device, non_blocking=nb) for t in (self.src, self.tgt_in, self.tgt_out)),
            self.n_tgt_tokens,
            self.n_src_tokens,
        )


def word_dropout(ids: torch.Tensor, rate: float) -> torch.Tensor:
    """`ids` with each ordinary token (not PAD, UNK, BOS or EOS) replaced by UNK with probability
    `rate`, from torch's global generator (seeded and checkpointed like the rest of training)."""
    if rate == 0.0:
        return ids
    ordinary = ids > EOS  # (B, L); the specials are ids 0-3 (vocab.py)
    drop = torch.rand(ids.shape, device=ids.device) < rate  # (B, L)
    return ids.masked_fill(ordinary & drop, UNK)


def collate(corpus: TokenizedCorpus, indices: Sequence[int]) -> Batch:
    """Pad one batch of pairs: sources end in EOS; targets are shifted (BOS ... / ... EOS)."""
    srcs = [corpus.src(i) for i in indices]
    tgts = [corpus.tgt(i) for i in indices]
    B, T = len(indices), max(len(t) for t in tgts) + 1
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    for b, t in enumerate(tgts):
        tgt_in[b, 0] = BOS
        tgt_in[b, 1 : len(t) + 1] = t
        tgt_out[b, : len(t)] = t
        tgt_out[b, len(t)] = EOS
    n_tgt = sum(len(t) for t in tgts) + B
    n_src = sum(len(s) for s in srcs) + B
    return Batch(
        pad_sources(srcs), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out), n_tgt, n_src
    )


class EpochPosition(Protocol):
    """Where a stream of training batches stands (the training loop's state has these)."""

    epoch: int
    batch_in_epoch: int  # this rank's batches of the epoch already consumed


class EpochBatches:
    """The training batches of each epoch, and one rank's share of them from any point on."""

    def __init__(self, data: TrainingData, tc: TrainConfig, rank: int = 0, world: int = 1):
        self.data, self.tc, self.rank, self.world = data, tc, rank, world
        self._cached: tuple[int, TokenizedCorpus] | None = None  # (epoch, its corpus)
        # The last epoch that trains both directions: train.bidirectional_epochs; under
        # bidirectional_share every epoch, until the trainer sees the share reached and sets it.
        self.bidirectional_until = tc.bidirectional_epochs or (
            tc.max_epochs if tc.bidirectional_share else 0
        )

    def corpus(self, epoch: int) -> TokenizedCorpus:
        """The training corpus of one epoch: segmented anew each epoch under subword sampling, and
        followed by its pairs reversed in the epochs of bidirectional training."""
        if self._cached is None or self._cached[0] != epoch:
            corpus = self.data.train
            if self.data.segmentations is not None:
                corpus = self.data.segmentations.corpus(epoch)
            if self.bidirectional(epoch):  # a copy of both sides' ids, in memory
                corpus = both_ways(corpus)
            self._cached = (epoch, corpus)
        return self._cached[1]

    def bidirectional(self, epoch: int) -> bool:
        """Whether this epoch trains on both directions (bidirectional training)."""
        return epoch <= self.bidirectional_until

    def epoch(self, epoch: int) -> list[np.ndarray]:
        """All ranks' batches of one epoch (indices into the training corpus), cut to a multiple of
        the world size; rank r takes batches r, r + world, r + 2*world, ..."""
        idx, world, corpus = self.data.train_idx, self.world, self.corpus(epoch)
        if self.bidirectional(epoch):  # pair n + i is pair i reversed
            idx = np.concatenate([idx, idx + len(corpus) // 2])
        batches = make_batches(
            corpus.src_lens[idx],
            corpus.tgt_lens[idx],
            self.tc.max_tokens,
            seed=self.tc.seed,
            epoch=epoch,
        )
        return [idx[b] for b in batches[: len(batches) // world * world]]

    def stream(self, position: EpochPosition) -> Iterator[tuple[Batch, int]]:
        """Endless stream of (this rank's batch, target tokens of that batch summed over all ranks)
        from `position`, which it advances (batch_in_epoch counts this rank's batches)."""
        world = self.world
        while position.epoch <= self.tc.max_epochs:
            batches = self.epoch(position.epoch)
            corpus = self.corpus(position.epoch)
            tgt_lens = corpus.tgt_lens
            while position.batch_in_epoch < len(batches) // world:
                j = position.batch_in_epoch * world
                group = batches[j : j + world]  # this step's batches of every rank
                position.batch_in_epoch += 1
                yield (
                    collate(corpus, group[self.rank]),
                    sum(int(tgt_lens[b].sum()) + len(b) for b in group),
                )
            position.epoch += 1
            position.batch_in_epoch = 0


def pad_sources(seqs: Sequence[Sequence[int]], max_len: int | None = None) -> torch.Tensor:
    """(B, S) source batch: ids (cut to max_len - 1 when given), then EOS, PAD-padded."""
    if max_len is not None:
        seqs = [s[: max_len - 1] for s in seqs]
    S = max(len(s) for s in seqs) + 1
    out = np.full((len(seqs), S), PAD, dtype=np.int64)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
        out[b, len(s)] = EOS
    return torch.from_numpy(out)
