"""Parallel corpora: read (text files, TSV/JSONL, Hugging Face hub) → tokenize once, cache → batch.

Batches are token-budgeted and length-bucketed; their order is a pure function of (seed, epoch),
so a run can resume mid-epoch and data-parallel ranks can take disjoint shards.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence
from urllib.parse import urlparse

import numpy as np
import torch

from .config import DataConfig
from .errors import UserError
from .tokenizer import BOS, EOS, PAD, Tokenizer

log = logging.getLogger("transformer_mt")

SPLITS = ("train", "valid", "test")


class DataError(UserError):
    """A corpus that cannot be read or used as it is."""


# --------------------------------------------------------------------------- reading


def read_split(cfg: DataConfig, split: str) -> tuple[list[str], list[str]]:
    """Source and target sentences of one split (train/valid/test), line-aligned."""
    where = getattr(cfg, split)
    if where is None:
        raise DataError(f"data.{split} is not set in the config: give a "
                        + ("split name" if cfg.format == "hf" else "path") + f" for the {split} split")
    if cfg.format == "text":
        src_path, tgt_path = (text_file(where, lang) for lang in (cfg.src_lang, cfg.tgt_lang))
        src, tgt = read_lines(src_path, cfg.invalid_utf8), read_lines(tgt_path, cfg.invalid_utf8)
        if len(src) != len(tgt):
            raise DataError(f"data.{split}: {src_path} has {len(src)} lines but {tgt_path} has {len(tgt)}; "
                            "line N of one must translate line N of the other")
        return src, tgt
    return _read_records(cfg, split, where)


def text_file(prefix: str, lang: str) -> Path:
    """PREFIX.LANG, or PREFIX.LANG.gz when only that exists."""
    for candidate in (Path(f"{prefix}.{lang}"), Path(f"{prefix}.{lang}.gz")):
        if candidate.is_file():
            return candidate
    raise DataError(f"corpus file not found: {prefix}.{lang} (or {prefix}.{lang}.gz); "
                    f"check the data paths in the config (relative paths start at {os.getcwd()})")


def read_lines(path: str | os.PathLike, invalid_utf8: str = "error") -> list[str]:
    """All lines of a UTF-8 text file (optionally .gz), without line endings.

    Invalid UTF-8 is reported with file and line (`error`), or replaced by U+FFFD and counted
    in a warning (`replace`) — never a deep traceback.
    """
    path = Path(path)
    try:
        with (gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")) as f:
            raw = f.read()
    except FileNotFoundError:
        raise DataError(f"corpus file not found: {path}") from None
    except (OSError, EOFError) as e:
        raise DataError(f"cannot read corpus file {path}: {e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        if invalid_utf8 != "replace":
            raise DataError(f"{path}:{line}: invalid UTF-8 ({e.reason} at byte {e.start}); re-encode the file "
                            "as UTF-8, or set data.invalid_utf8: replace") from None
        text = raw.decode("utf-8", errors="replace")
        bad = sum(not _is_utf8(ln) for ln in raw.split(b"\n"))
        log.warning("%s: %d line(s) with invalid UTF-8 (first: line %d); bytes replaced by U+FFFD", path, bad, line)
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def _read_records(cfg: DataConfig, split: str, where: str) -> tuple[list[str], list[str]]:
    """TSV/JSONL through `datasets`' csv/json loaders, or a dataset from the Hugging Face hub."""
    src_field, tgt_field = cfg.fields
    if cfg.format == "tsv":
        if not Path(where).is_file():
            raise DataError(f"data.{split}: corpus file not found: {where}")
        ds = _datasets().load_dataset(
            "csv", data_files={split: where}, split=split, delimiter="\t", quoting=3,  # QUOTE_NONE
            column_names=[src_field, tgt_field], keep_default_na=False, na_filter=False)
    elif cfg.format == "jsonl":
        if not Path(where).is_file():
            raise DataError(f"data.{split}: corpus file not found: {where}")
        ds = _datasets().load_dataset("json", data_files={split: where}, split=split)
    else:
        ds = load_hub_dataset(cfg.dataset, cfg.dataset_config, where)
    src = [_field(row, src_field, f"data.{split}", "src_field") for row in ds]
    tgt = [_field(row, tgt_field, f"data.{split}", "tgt_field") for row in ds]
    return src, tgt


def _field(row: dict, dotted: str, where: str, key: str) -> str:
    value = row
    for part in dotted.split("."):
        if not isinstance(value, dict) or part not in value:
            fields = ", ".join(row.keys())
            raise DataError(f"{where}: records have no field {dotted!r} (fields: {fields}); "
                            f"set data.{key} (dots reach into nested fields, e.g. translation.en)")
        value = value[part]
    return "" if value is None else str(value)


def _datasets():
    import datasets  # imported lazily: it is slow to import and only some corpora need it

    datasets.logging.set_verbosity_error()
    return datasets


def load_hub_dataset(name: str, config: str | None, split: str):
    """`datasets.load_dataset` for a hub name; offline it uses the local cache or fails fast."""
    datasets = _datasets()
    offline = os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false") or not _hub_reachable()
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
                f"data.dataset: cannot load {name!r} from the Hugging Face hub: the hub is not reachable "
                "from this machine (offline) and the dataset is not in the local cache. Download it once "
                "on a machine with internet, or point the config at local files (data.format: text)."
            ) from None
        raise DataError(f"data.dataset: cannot load {name!r} (config {config!r}, split {split!r}): {e}") from None


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
        return self.src_ids[self.src_offsets[i]:self.src_offsets[i + 1]]

    def tgt(self, i: int) -> np.ndarray:
        return self.tgt_ids[self.tgt_offsets[i]:self.tgt_offsets[i + 1]]

    @classmethod
    def from_lists(cls, src: Sequence[Sequence[int]], tgt: Sequence[Sequence[int]]) -> "TokenizedCorpus":
        return cls(*_flatten(src), *_flatten(tgt))

    def save(self, folder: Path) -> None:
        """Write the four arrays into a new folder, renamed into place when complete."""
        tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        for name in ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets"):
            np.save(tmp / f"{name}.npy", getattr(self, name))
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)

    @classmethod
    def load(cls, folder: Path) -> "TokenizedCorpus":
        return cls(*(np.load(folder / f"{name}.npy", mmap_mode="r")
                     for name in ("src_ids", "src_offsets", "tgt_ids", "tgt_offsets")))


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    flat = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


def corpus_key(cfg: DataConfig, split: str, tokenizer: Tokenizer) -> str:
    """Identifies a tokenized split: the corpus (files with size and mtime, or hub name) + tokenizer."""
    ident: dict = {"format": cfg.format, "split": getattr(cfg, split), "fields": cfg.fields,
                   "tokenizer": tokenizer.digest}
    if cfg.format == "text":
        files = [text_file(getattr(cfg, split), lang) for lang in (cfg.src_lang, cfg.tgt_lang)]
    elif cfg.format in ("tsv", "jsonl"):
        files = [Path(getattr(cfg, split))]
    else:
        files = []
        ident["dataset"] = [cfg.dataset, cfg.dataset_config]
    ident["files"] = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def load_tokenized(cfg: DataConfig, split: str, tokenizer: Tokenizer, cache_dir: Path) -> TokenizedCorpus:
    """Tokenize a split once and cache it; later calls (and later runs) read the cache."""
    folder = Path(cache_dir) / f"{split}-{corpus_key(cfg, split, tokenizer)}"
    if (folder / "tgt_offsets.npy").exists():
        return TokenizedCorpus.load(folder)
    src, tgt = read_split(cfg, split)
    if not src:
        raise DataError(f"data.{split}: the corpus is empty")
    corpus = TokenizedCorpus.from_lists(tokenizer.encode_src(src), tokenizer.encode_tgt(tgt))
    corpus.save(folder)
    return TokenizedCorpus.load(folder)


def usable_indices(corpus: TokenizedCorpus, max_len: int, split: str) -> np.ndarray:
    """Indices of pairs with both sides non-empty and at most max_len tokens; warns with counts."""
    src_lens, tgt_lens = corpus.src_lens, corpus.tgt_lens
    empty = (src_lens == 0) | (tgt_lens == 0)
    too_long = ~empty & ((src_lens > max_len) | (tgt_lens > max_len))
    if empty.any():
        log.warning("%s: dropped %d pairs with an empty side", split, int(empty.sum()))
    if too_long.any():
        log.warning("%s: dropped %d pairs longer than data.max_len=%d tokens", split, int(too_long.sum()), max_len)
    keep = np.flatnonzero(~(empty | too_long))
    if len(keep) == 0:
        raise DataError(f"data.{split}: no usable sentence pairs (all empty or longer than data.max_len)")
    return keep


# --------------------------------------------------------------------------- batching


def make_batches(src_lens: np.ndarray, tgt_lens: np.ndarray, max_tokens: int, *, seed: int, epoch: int,
                 shuffle: bool = True) -> list[np.ndarray]:
    """Token-budget batches of similar-length pairs; a pure function of (lengths, seed, epoch).

    Each batch holds at most `max_tokens` = n_sentences x longest side (+1 for EOS/BOS).
    Pairs are sorted by their longer side, then by source length (ties broken by an epoch-seeded
    shuffle), cut greedily, and the batch order is shuffled. On Multi30k this pads ~5% of source
    and ~6% of target positions, against 13% + 1% when sorting by target then source.
    Returns positions into the length arrays.
    """
    n = len(src_lens)
    rng = np.random.default_rng([seed, epoch])
    order = rng.permutation(n) if shuffle else np.arange(n)
    longer = np.maximum(src_lens, tgt_lens)
    order = order[np.lexsort((src_lens[order], longer[order]))]  # stable: last key is the primary one
    width = longer[order] + 1
    batches, start, longest = [], 0, 0
    for i in range(n):
        longest_i = max(longest, int(width[i]))
        if i > start and longest_i * (i - start + 1) > max_tokens:
            batches.append(order[start:i])
            start, longest_i = i, int(width[i])
        longest = longest_i
    batches.append(order[start:n])
    if shuffle:
        rng.shuffle(batches)
    return batches


@dataclass
class Batch:
    """Padded tensors for one batch; token counts are known on the host (no device sync)."""

    src: torch.Tensor  # (B, S) source ids + EOS, PAD-padded
    tgt_in: torch.Tensor  # (B, T) BOS + target ids
    tgt_out: torch.Tensor  # (B, T) target ids + EOS
    positions: torch.Tensor  # (N,) flat indices b*T + t of the real (non-pad) target tokens
    n_tgt_tokens: int  # N
    n_src_tokens: int

    @property
    def targets(self) -> torch.Tensor:
        """(N,) the real target tokens, in the order of `positions`."""
        return self.tgt_out.view(-1).index_select(0, self.positions)

    def to(self, device: torch.device) -> "Batch":
        nb = device.type == "cuda"
        return Batch(*(t.to(device, non_blocking=nb) for t in (self.src, self.tgt_in, self.tgt_out, self.positions)),
                     self.n_tgt_tokens, self.n_src_tokens)


def collate(corpus: TokenizedCorpus, indices: Sequence[int]) -> Batch:
    """Pad one batch of pairs: sources end in EOS; targets are shifted (BOS ... / ... EOS)."""
    srcs = [corpus.src(i) for i in indices]
    tgts = [corpus.tgt(i) for i in indices]
    B = len(indices)
    S = max(len(s) for s in srcs) + 1
    T = max(len(t) for t in tgts) + 1
    src = np.full((B, S), PAD, dtype=np.int64)
    tgt_in = np.full((B, T), PAD, dtype=np.int64)
    tgt_out = np.full((B, T), PAD, dtype=np.int64)
    for b, (s, t) in enumerate(zip(srcs, tgts)):
        src[b, :len(s)] = s
        src[b, len(s)] = EOS
        tgt_in[b, 0] = BOS
        tgt_in[b, 1:len(t) + 1] = t
        tgt_out[b, :len(t)] = t
        tgt_out[b, len(t)] = EOS
    positions = np.concatenate([b * T + np.arange(len(t) + 1) for b, t in enumerate(tgts)])
    n_src = sum(len(s) for s in srcs) + B
    return Batch(torch.from_numpy(src), torch.from_numpy(tgt_in), torch.from_numpy(tgt_out),
                 torch.from_numpy(positions), len(positions), n_src)


def pad_sources(seqs: Sequence[Sequence[int]], max_len: int) -> torch.Tensor:
    """(B, S) source batch for decoding: ids truncated to max_len - 1, then EOS, PAD-padded."""
    seqs = [list(s)[: max_len - 1] for s in seqs]
    S = max(len(s) for s in seqs) + 1
    out = torch.full((len(seqs), S), PAD, dtype=torch.long)
    for b, s in enumerate(seqs):
        out[b, :len(s)] = torch.tensor(s, dtype=torch.long)
        out[b, len(s)] = EOS
    return out
