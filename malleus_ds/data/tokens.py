"""Local token-id files (``data=tokens``): a ``.bin`` of raw ids (nanoGPT style) or a ``.npy``.

The file is memory-mapped, never read whole: ``.bin`` through ``np.memmap`` with ``data.dtype``
(uint16 or uint32, default uint16), ``.npy`` through ``np.load(mmap_mode="r")`` with the dtype
of its header (uint16 or uint32, 1-D). Samples follow the same scheme as the byte corpus:
windows of ``seq_len + 1`` tokens starting every ``seq_len // 2`` tokens, visited in a fixed
permutation seeded by ``train.corpus_seed``, so sample ``i`` is the same tensor on every rank,
engine and layout (and a byte file written as uint16 ids gives exactly the byte corpus).

:func:`check_token_file` is the start-up check (``build_run_config``): every problem a run would
hit later (missing file, wrong dtype, truncated file, ids outside the vocabulary, a file too
short for one global batch) is a :class:`DataError` naming the field and the numbers.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

#: dtypes a token file may hold
DTYPES = ("uint16", "uint32")
#: file suffixes ``data=tokens`` reads
SUFFIXES = (".bin", ".npy")
#: tokens per chunk of the vocabulary scan (16M: 32-64 MB of memory at a time)
SCAN_CHUNK = 16 * 1024 * 1024


class DataError(ValueError):
    """A data file or ``data.*`` setting is unusable. ``build_run_config`` re-raises it as a
    ``ConfigError`` (every rank fails before any process group)."""


def stride_of(seq_len: int) -> int:
    """Windows start every ``seq_len // 2`` tokens (at least 1): the byte corpus' scheme."""
    return max(1, seq_len // 2)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """Windows of ``seq_len + 1`` tokens in ``num_tokens`` tokens (0 when it is too short)."""
    if num_tokens < seq_len + 1:
        return 0
    return (num_tokens - seq_len - 1) // stride_of(seq_len) + 1


def tokens_needed(windows: int, seq_len: int) -> int:
    """Fewest tokens that hold ``windows`` windows (>= 1) of ``seq_len + 1`` tokens."""
    return (max(1, windows) - 1) * stride_of(seq_len) + seq_len + 1


@dataclass(frozen=True)
class TokenFile:
    """What the header / size of a token file says: its dtype and token count."""

    path: Path
    dtype: np.dtype
    num_tokens: int
    offset: int = 0                     # bytes before the first token (.npy header)
    npy: bool = False


def inspect_token_file(path: str | os.PathLike, dtype: str | None = None) -> TokenFile:
    """Header and size checks of ``data.path`` (no token is read). ``dtype``: ``data.dtype``
    (None = uint16 for ``.bin``, the header's for ``.npy``, where a set one must match)."""
    p = Path(path)
    if p.suffix not in SUFFIXES:
        raise DataError(f"data.path={str(p)!r}: data=tokens reads a .bin file (raw token ids, "
                        f"data.dtype=uint16|uint32) or a .npy file (uint16/uint32, 1-D); got "
                        f"suffix {p.suffix!r}")
    if not p.is_file():
        raise DataError(f"data.path={str(p)!r}: file not found (a relative path is resolved "
                        f"against the directory the run starts in)")
    if dtype is not None and str(dtype) not in DTYPES:
        raise DataError(f"data.dtype={dtype!r} must be one of {list(DTYPES)} (or null: uint16 "
                        f"for .bin, the header's dtype for .npy)")
    size = p.stat().st_size
    if p.suffix == ".bin":
        dt = np.dtype(dtype or "uint16")
        if size % dt.itemsize:
            raise DataError(f"data.path={str(p)!r} has {size} bytes, not a multiple of "
                            f"{dt.itemsize} (data.dtype={dt.name}): a truncated file, or the "
                            f"wrong data.dtype")
        return TokenFile(p, dt, size // dt.itemsize)
    try:
        with open(p, "rb") as f:
            version = np.lib.format.read_magic(f)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _fortran, dt = read(f)
            offset = f.tell()
    except (ValueError, OSError) as e:
        raise DataError(f"data.path={str(p)!r} is not a readable .npy file ({e})") from None
    if dt.kind != "u" or dt.name not in DTYPES:
        raise DataError(f"data.path={str(p)!r} holds dtype {dt.str} ({dt}); data=tokens needs "
                        f"{' or '.join(DTYPES)} token ids (convert with "
                        f"a.astype(np.uint16) when every id < 65536, else np.uint32)")
    if len(shape) != 1:
        raise DataError(f"data.path={str(p)!r} holds an array of shape {tuple(shape)}; data=tokens "
                        f"needs a 1-D array of token ids (use a.reshape(-1))")
    if dtype is not None and str(dtype) != dt.name:
        raise DataError(f"data.dtype={dtype} but data.path={str(p)!r} holds {dt.name} (a .npy "
                        f"file's header sets its dtype); set data.dtype={dt.name} or null")
    n = int(shape[0])
    if size - offset != n * dt.itemsize:
        raise DataError(f"data.path={str(p)!r}: the header promises {n} tokens of {dt.name} "
                        f"({n * dt.itemsize} bytes) but {size - offset} bytes follow it: a "
                        f"truncated or damaged file")
    return TokenFile(p, dt, n, offset, npy=True)


def open_tokens(tf: TokenFile) -> np.ndarray:
    """The file's tokens, memory-mapped read-only (an empty array for an empty file)."""
    if tf.num_tokens == 0:
        return np.empty(0, dtype=tf.dtype)
    if tf.npy:
        return np.load(tf.path, mmap_mode="r")
    return np.memmap(tf.path, dtype=tf.dtype, mode="r", shape=(tf.num_tokens,))


def check_token_file(path: str | os.PathLike, dtype: str | None, *, seq_len: int,
                     vocab_size: int, global_batch_size: int,
                     chunk: int = SCAN_CHUNK) -> TokenFile:
    """Every start-up check of a token file; returns its :class:`TokenFile`. The vocabulary
    scan reads the memmap ``chunk`` tokens at a time (never the whole file at once)."""
    tf = inspect_token_file(path, dtype)
    p, n = str(tf.path), tf.num_tokens
    windows = num_windows(n, seq_len)
    if windows < global_batch_size:
        need = tokens_needed(global_batch_size, seq_len)
        raise DataError(f"data.path={p!r} holds {n} tokens: {windows} windows of seq_len+1="
                        f"{seq_len + 1} tokens (one every {stride_of(seq_len)} tokens), fewer than "
                        f"one global batch (train.global_batch_size={global_batch_size}); it "
                        f"needs >= {need} tokens (or a smaller data.seq_len / "
                        f"train.global_batch_size)")
    toks = open_tokens(tf)
    top, top_at, bad, first_bad = -1, -1, 0, -1
    for lo in range(0, n, max(1, int(chunk))):
        c = np.asarray(toks[lo:lo + chunk])
        i = int(c.argmax())
        if int(c[i]) > top:
            top, top_at = int(c[i]), lo + i
        if top >= vocab_size:
            over = c >= vocab_size
            k = int(over.sum())
            if k and first_bad < 0:
                first_bad = lo + int(over.argmax())
            bad += k
    del toks
    if top >= vocab_size:
        raise DataError(f"data.path={p!r}: token id {top} (at token index {top_at}) is >= "
                        f"model.vocab_size={vocab_size}; {bad} of {n} tokens are out of range, "
                        f"the first at index {first_bad}; set model.vocab_size >= {top + 1} or "
                        f"re-tokenize")
    return tf


class TokenDataset:
    """Windows of ``seq_len + 1`` tokens of a memory-mapped token file; sample ``i`` ->
    (input (T,), target (T,)) int64. The same interface as :class:`ByteCorpus`."""

    def __init__(self, path: str | os.PathLike, seq_len: int, seed: int = 0,
                 dtype: str | None = None) -> None:
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            raise DataError(f"data.seq_len={seq_len!r} must be an integer >= 1")
        self.file = inspect_token_file(path, dtype)
        n = num_windows(self.file.num_tokens, seq_len)
        if n < 1:
            raise DataError(f"data.path={str(self.file.path)!r} holds {self.file.num_tokens} "
                            f"tokens, fewer than one window of seq_len+1={seq_len + 1}")
        self.tokens = open_tokens(self.file)
        self.seq_len = seq_len
        self.stride = stride_of(seq_len)
        self.order = np.random.default_rng(seed).permutation(n)

    @property
    def path(self) -> Path:
        return self.file.path

    def __len__(self) -> int:
        return len(self.order)

    def sample(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = int(self.order[i % len(self.order)]) * self.stride
        w = torch.from_numpy(self.tokens[start:start + self.seq_len + 1].astype(np.int64))
        return w[:-1], w[1:]

    def batch(self, ids) -> tuple[torch.Tensor, torch.Tensor]:
        """Stack samples ``ids`` -> inputs (B, T), targets (B, T)."""
        xs, ys = zip(*(self.sample(int(i)) for i in ids))
        return torch.stack(xs), torch.stack(ys)
