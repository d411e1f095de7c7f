"""One atomic file write for every file the package commits (checkpoints, run records, exports).

Write under a temporary name in the same folder, flush, ``fsync``, rename onto the final name,
then ``fsync`` the folder: a crash leaves either the old file or the new one under the name,
never half of one, and the rename itself survives a power loss. The temporary name carries the
process id, so two processes writing the same name never share a temporary file.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp{os.getpid()}")


def _sync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:             # a folder that cannot be opened (some filesystems): best effort
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path, write: Callable[[Any], None], mode: str = "wb") -> None:
    """Write through ``write(file)`` (a file opened with ``mode``) atomically onto ``path``."""
    path = Path(path)
    tmp = _tmp(path)
    try:
        with open(tmp, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def atomic_write_path(path, write: Callable[[Path], None]) -> None:
    """Like :func:`atomic_write` for a writer that takes a file name (``safetensors``'
    ``save_file``): ``write(tmp)``, then the temporary file is fsync'ed and renamed."""
    path = Path(path)
    tmp = _tmp(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)


def atomic_write_text(path, text: str) -> None:
    """``text`` onto ``path`` atomically (UTF-8)."""
    atomic_write(path, lambda f: f.write(text), mode="w")
