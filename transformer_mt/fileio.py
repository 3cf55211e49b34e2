"""Atomic writes: a crash or a full disk never leaves a half-written file where a good one was."""

from __future__ import annotations

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

