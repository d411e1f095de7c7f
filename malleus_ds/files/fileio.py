"""One atomic file write for every file the package commits (checkpoints, run records, exports).

Write under a temporary name in the same folder, flush, ``fsync``, rename onto the final name,
then ``fsync`` the folder: a crash leaves either the old file or the new one under the name,
never half of one, and the rename itself survives a power loss. The temporary name carries the
process id, so two processes writing the same name never share a temporary file.

:func:`atomic_write_chunks` writes large, page-aligned memory (a checkpoint's rank file) with
``O_DIRECT`` where the file system takes it: the bytes go from our buffer to the disk without
the kernel copying them into its page cache and writing that back later, CPU that a background
save would otherwise take from training (bench/RESULTS.md, "Raw rank files").
"""
from __future__ import annotations

import mmap
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


#: O_DIRECT's alignment for buffer addresses, file offsets and lengths (the largest logical block
#: size of common disks; a page, so anonymous memory from :func:`aligned_buffer` meets it)
DIRECT_ALIGN = 4096
#: bytes per write call
_CHUNK = 64 * 2**20


def round_up(n: int, to: int = DIRECT_ALIGN) -> int:
    return -(-n // to) * to


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """Zeroed, page-aligned anonymous memory of ``nbytes`` rounded up to :data:`DIRECT_ALIGN`
    (at least one block), freed when the last reference (and every tensor viewing it) goes."""
    return mmap.mmap(-1, max(DIRECT_ALIGN, round_up(nbytes)))


def atomic_write_chunks(path, chunks: list[memoryview], direct: bool = True) -> bool:
    """Write ``chunks`` back to back onto ``path`` atomically (as :func:`atomic_write`). With
    ``direct`` and each chunk a multiple of :data:`DIRECT_ALIGN` long in page-aligned memory
    (:func:`aligned_buffer`), through ``O_DIRECT`` where the file system takes it; else (tmpfs,
    some network file systems, no ``O_DIRECT`` on this OS) buffered. Returns whether
    ``O_DIRECT`` wrote it."""
    path = Path(path)
    tmp = _tmp(path)
    flag = getattr(os, "O_DIRECT", 0) if direct else 0
    if flag and any(len(c) % DIRECT_ALIGN for c in chunks):
        flag = 0
    try:
        used = bool(flag) and _write_fd(tmp, chunks, flag)
        if not used:
            _write_fd(tmp, chunks, 0)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_dir(path.parent)
    return used


def _write_fd(tmp: Path, chunks: list[memoryview], flag: int) -> bool:
    """Write and fsync ``tmp``; False (nothing raised) when ``flag`` (O_DIRECT) is set and any
    step fails: the caller writes it again buffered, which raises a real error (a full disk, no
    permission) itself."""
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flag, 0o644)
    except OSError:
        if flag:            # EINVAL where O_DIRECT is refused; anything else fails buffered too
            return False
        raise
    try:
        for c in chunks:
            o = 0
            while o < len(c):
                o += os.write(fd, c[o:o + _CHUNK])
        os.fsync(fd)
    except OSError:
        if flag:            # opened, but this file system cannot write it so: try buffered
            return False
        raise
    finally:
        os.close(fd)
    return True
