"""Small file helpers shared by every module: atomic writes and gzip-aware text reading."""

from __future__ import annotations

import gzip
import os
from pathlib import Path
from typing import IO, Callable


def atomic_write(path: str | os.PathLike, data: bytes | Callable[[IO[bytes]], None]) -> None:
    """Write bytes (or let `data(f)` write) to a temp file in the same folder, fsync, rename.

    A crash or a full disk mid-write leaves the previous file intact.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def open_text(path: str | os.PathLike, errors: str = "strict") -> IO[str]:
    """Open a UTF-8 text file for reading, transparently gunzipping `.gz` files."""
    path = str(path)
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors=errors, newline="\n")
    return open(path, "r", encoding="utf-8", errors=errors, newline="\n")
