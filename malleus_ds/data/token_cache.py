"""A keyed cache of token files, built once however many processes ask for it at once.

``data=text`` tokenizes its corpus before any process group exists: every rank of every node
parses the config on its own, and all of them need the same token file. The first process to
take the key's file lock builds it; the others block on the lock, then find the finished file and
memory-map it. A file lock (``fcntl.flock``) rather than a collective, because there is no
process group yet; the kernel drops the lock when its holder dies, so a killed builder never
leaves the others waiting for ever.

Files in the cache folder, for a key ``K`` (a content hash: the same key means the same tokens):

- ``K.npy``: the tokens, a 1-D uint16/uint32 array. It appears only by an atomic rename of a
  complete, fsync'ed file, so a reader sees the whole file or none (never half of one);
- ``K.json``: what the tokens were made from (files, hashes, tokenizer, counts), written before
  ``K.npy``; the cache entry counts as present only when both exist;
- ``K.error``: a build that found bad input (a :class:`DataError`) leaves its message here, so
  the processes waiting behind it fail at once with the same message instead of each
  re-reading the corpus to find it again. The key covers the input, so fixed input has another
  key and never sees this file;
- ``K.lock``: the lock file (kept: removing a lock file races with processes opening it);
- ``.K.*.tmp<pid>``: a build in progress (a dead builder's are removed by the next builder).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable

import numpy as np

from ..files.fileio import atomic_write, atomic_write_text
from .tokens import DataError

#: bytes per read when copying the built tokens under their .npy header
COPY_CHUNK = 16 * 1024 * 1024


@dataclass(frozen=True)
class CacheEntry:
    """A finished cache entry: the token file and its record (``K.json``)."""

    path: Path
    meta: dict
    built: bool = False            # True when this process built it (False: found it)


def cache_paths(folder: Path, key: str) -> dict[str, Path]:
    return {k: folder / f"{key}.{k}" for k in ("npy", "json", "error", "lock")}


def lookup(folder: Path, key: str) -> CacheEntry | None:
    """The finished entry of ``key`` in ``folder``, or None. A recorded build error is raised
    as the :class:`DataError` it was."""
    p = cache_paths(folder, key)
    if p["npy"].is_file() and p["json"].is_file():
        try:
            meta = json.loads(p["json"].read_text())
        except (OSError, ValueError) as e:
            raise DataError(f"token cache {p['json']} is unreadable ({e}); delete "
                            f"{p['npy']} and {p['json']} to rebuild it") from None
        return CacheEntry(p["npy"], meta)
    if p["error"].is_file():
        raise DataError(p["error"].read_text())
    return None


def get_or_build(folder: Path, key: str, dtype: np.dtype,
                 build: Callable[[BinaryIO], dict], *, what: str,
                 announce: Callable[[str], None] | None = None) -> CacheEntry:
    """The entry of ``key``: found, or built here by ``build(f)`` under the key's lock.

    ``build`` writes raw ``dtype`` token ids to the binary file ``f`` and returns the record to
    keep beside them (JSON-able; ``tokens``, the count, is checked against what it wrote). A
    :class:`DataError` it raises is recorded (``K.error``) and raised on. ``what`` names the
    data in messages (``data.path=...``); ``announce`` gets one line when this process has to
    wait for another one's build."""
    found = lookup(folder, key)
    if found is not None:
        return found
    folder = Path(folder)
    p = cache_paths(folder, key)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(p["lock"], os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise DataError(f"{what}: cannot write the token cache in {folder} ({e.strerror or e}); "
                        f"set data.cache_dir=DIR to a writable folder (every rank must see the "
                        f"same folder)") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if announce is not None:
                announce(f"waiting for another process to finish tokenizing ({p['lock']})")
            fcntl.flock(fd, fcntl.LOCK_EX)
        found = lookup(folder, key)             # built while we waited
        if found is not None:
            return found
        return _build(folder, key, np.dtype(dtype), build)
    finally:
        os.close(fd)                            # releases the lock


def _build(folder: Path, key: str, dtype: np.dtype, build: Callable[[BinaryIO], dict]) -> CacheEntry:
    p = cache_paths(folder, key)
    for stale in folder.glob(f".{key}.*.tmp*"):   # a dead builder's leftovers (we hold the lock)
        stale.unlink(missing_ok=True)
    raw = folder / f".{key}.raw.tmp{os.getpid()}"
    try:
        try:
            with open(raw, "wb") as f:
                meta = dict(build(f))
        except DataError as e:
            atomic_write_text(p["error"], str(e))
            raise
        size = raw.stat().st_size
        n = size // dtype.itemsize
        if n * dtype.itemsize != size or meta.get("tokens") != n:
            raise RuntimeError(f"token cache build wrote {size} bytes of {dtype.name}, its "
                               f"record says {meta.get('tokens')} tokens")

        def write_npy(out) -> None:
            np.lib.format.write_array_header_1_0(out, {
                "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                "shape": (n,)})
            with open(raw, "rb") as src:
                shutil.copyfileobj(src, out, COPY_CHUNK)

        meta.update(key=key, dtype=dtype.name)
        atomic_write_text(p["json"], json.dumps(meta, indent=1, sort_keys=True) + "\n")
        atomic_write(p["npy"], write_npy)      # the commit point: K.npy is whole or absent
    finally:
        raw.unlink(missing_ok=True)
    return CacheEntry(p["npy"], meta, built=True)


def say(line: str, *, always: bool = False) -> None:
    """A start-up line on stderr. Lines every process would print (a cache found) come from the
    first local process only (rank 0, or a process no launcher started), so N ranks print them
    once; ``always``: this process alone has something to say (it builds the cache)."""
    if always or os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(f"[malleus_ds] data: {line}", file=sys.stderr, flush=True)
