"""Atomic writes: a crash or a full disk never leaves a half-written file where a good one was."""

from __future__ import annotations

import os
import tempfile
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


def temp_dir(parent: str | os.PathLike, prefix: str, suffix: str = "") -> Path:
    """A new private folder in `parent` to fill and then rename into place, with the permissions a
    plain mkdir gives (mkdtemp's are 0700: a cache entry or an export renamed from it would be its
    owner's alone)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, suffix=suffix, dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o777 & ~umask)
    return path
