"""Shard pack/unpack for live migration: many strided 2-D windows <-> one contiguous buffer.

Live migration sends, per peer, a list of slices of many tensors: a TP column block of a
row-parallel weight (``w.narrow(1, k*n/g, n/g)``: ``rows`` strided rows), a row block of a
column-parallel weight (contiguous), a ZeRO range of a flat fp32 buffer (one contiguous run), a
whole replicated tensor. Every such slice is a :class:`Window` -- ``offset`` plus ``rows x cols``
elements with a row stride and a column stride -- of one tensor (``malleus_ds.layout`` keeps the
slice as an interval; the executor turns it back into a window with :func:`window_of`).
:func:`pack` copies the windows, each row-major, back to back into one flat buffer (one
send/recv instead of dozens), :func:`unpack` is its inverse.

Why one launch. A migration step moves hundreds of slices; ``torch.cat`` or per-slice ``copy_``
costs a launch and a pass per slice, and small slices never reach bandwidth. The Triton kernel
(:func:`pack_triton` / :func:`unpack_triton`) covers every window of every tensor in ONE launch:

* the host cuts each window into ``BLOCK_R x BLOCK_C`` tiles; program ``pid`` finds its window by
  a binary search over the windows' first-tile numbers (metadata stays O(windows): a few
  vectorised numpy ops, sent in ONE host->device copy), then copies its tile;
* a contiguous window (a ZeRO range, a row block, a whole tensor) is first re-cut into
  ``(n // BLOCK_C) x BLOCK_C`` rows plus a 1-row tail, so its tiles are full and coalesced
  whatever its original shape;
* every tensor is addressed relative to the flat buffer: element offset
  ``(t.data_ptr() - flat.data_ptr()) // element_size`` (exact: allocations are element-aligned;
  checked), so one pointer argument reaches all tensors -- this works both compiled on CUDA and
  under ``TRITON_INTERPRET=1`` on CPU, where pointers are plain host addresses;
* the kernel copies bits, not numbers: every dtype is viewed as the integer of its size, so one
  compiled kernel serves fp32/int32, bf16/fp16, ... (and NaN payloads survive);
* each window takes one of three copy paths (a runtime branch, uniform per program): rows whose
  starts, stride and width are 16-byte multiples move as 128-bit accesses (the norm for TP blocks
  and aligned ZeRO ranges), other unit-column-stride windows element by element (still
  coalesced), and anything else (a transposed block) through generic strides. Per window, so one
  odd slice does not slow the rest of the launch.

:func:`pack_torch` / :func:`unpack_torch` are the plain-torch twins (``as_strided`` views +
``copy_``): the CPU path and the test oracle. :func:`pack` / :func:`unpack` dispatch: CUDA
tensors -> Triton, anything else -> torch.

Windows passed to :func:`unpack` must not overlap (tiles would race); :func:`pack` reads
overlapping windows fine. ``out`` must not alias the windowed tensors.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

try:  # the torch path must work where triton is missing
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with torch on Linux
    triton = None


@dataclass(frozen=True)
class Window:
    """A 2-D strided window of ``tensors[tensor]``: element (i, j), 0 <= i < rows, 0 <= j < cols,
    is at element offset ``offset + i*row_stride + j*col_stride`` from ``tensors[tensor].data_ptr()``."""

    tensor: int
    offset: int
    rows: int
    cols: int
    row_stride: int
    col_stride: int

    @property
    def numel(self) -> int:
        return self.rows * self.cols


def window_of(tensor_index: int, base: torch.Tensor, view: torch.Tensor) -> Window:
    """The Window of ``view`` (a 0-, 1- or 2-D view sharing storage with ``base``), e.g.
    ``base.narrow(1, 8, 8)`` or ``base.view(-1)[100:200]`` or ``base.narrow(1,8,8).t()``; a 1-D view is one row.
    ValueError if it does not share base's storage or has more than 2 dims that cannot be merged."""
    if (view.device != base.device
            or view.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()):
        raise ValueError("window_of: view does not share base's storage")
    if view.element_size() != base.element_size():
        raise ValueError(f"window_of: view has {view.element_size()}-byte elements, "
                         f"base {base.element_size()}-byte")
    offset = view.storage_offset() - base.storage_offset()
    sizes, strides = list(view.shape), list(view.stride())
    if len(sizes) > 2:
        sizes, strides = _merge_dims(sizes, strides)
        if view.numel() == 0:
            return Window(tensor_index, offset, 0, 0, 0, 1)
        if len(sizes) > 2:
            raise ValueError(f"window_of: view of shape {tuple(view.shape)} and strides "
                             f"{view.stride()} does not merge into 2 dims")
    if len(sizes) == 0:
        return Window(tensor_index, offset, 1, 1, 1, 1)
    if len(sizes) == 1:
        # one row; row_stride = cols*col_stride marks it a contiguous run like any 1-row window
        return Window(tensor_index, offset, 1, sizes[0], sizes[0] * strides[0], strides[0])
    return Window(tensor_index, offset, sizes[0], sizes[1], strides[0], strides[1])


def _merge_dims(sizes: list[int], strides: list[int]) -> tuple[list[int], list[int]]:
    """Drop size-1 dims; merge neighbours that are one run (stride[k] == size[k+1]*stride[k+1])."""
    out_sz: list[int] = []
    out_st: list[int] = []
    for n, s in zip(sizes, strides):
        if n == 1:
            continue
        if out_sz and out_st[-1] == n * s:
            out_sz[-1] *= n
            out_st[-1] = s
        else:
            out_sz.append(n)
            out_st.append(s)
    return out_sz, out_st


# ------------------------------------------------------------------------------ validation

# columns of the window table built from a list of Windows
_T, _OFF, _ROWS, _COLS, _RS, _CS = range(6)


def _check_tensors(tensors: Sequence[torch.Tensor], flat: torch.Tensor | None,
                   flat_name: str) -> tuple[torch.dtype, torch.device]:
    """One dtype and device for all tensors and the flat buffer; returns them."""
    ref = tensors[0] if len(tensors) else flat
    if ref is None:
        return torch.float32, torch.device("cpu")
    for k, t in enumerate(tensors):
        if t.dtype != ref.dtype:
            raise ValueError(f"tensor {k} has dtype {t.dtype}, tensor 0 has {ref.dtype}")
        if t.device != ref.device:
            raise ValueError(f"tensor {k} is on {t.device}, tensor 0 on {ref.device}")
    if flat is not None:
        if flat.dtype != ref.dtype:
            raise ValueError(f"{flat_name} has dtype {flat.dtype}, tensor 0 has {ref.dtype}")
        if flat.device != ref.device:
            raise ValueError(f"{flat_name} is on {flat.device}, tensor 0 on {ref.device}")
        if flat.dim() != 1 or (flat.numel() > 1 and flat.stride(0) != 1):
            raise ValueError(f"{flat_name} must be a contiguous 1-D tensor, "
                             f"got shape {tuple(flat.shape)} strides {flat.stride()}")
    return ref.dtype, ref.device


def _window_table(tensors: Sequence[torch.Tensor], windows: Sequence[Window]) -> np.ndarray:
    """The windows as an int64 [W, 6] table, validated. numpy, not torch: on tables of tens to
    hundreds of rows a numpy op costs a fraction of a torch CPU op's dispatch, and this runs
    on every call. A ValueError names the first bad window and its numbers."""
    tab = np.array([(w.tensor, w.offset, w.rows, w.cols, w.row_stride, w.col_stride)
                    for w in windows], dtype=np.int64).reshape(-1, 6)
    if tab.shape[0] == 0:
        return tab

    def first(bad: np.ndarray) -> int | None:
        idx = np.flatnonzero(bad)
        return int(idx[0]) if idx.size else None

    t = tab[:, _T]
    k = first((t < 0) | (t >= len(tensors)))
    if k is not None:
        raise ValueError(f"window {k}: tensor index {int(t[k])} out of range "
                         f"for {len(tensors)} tensors")
    k = first((tab[:, _ROWS:] < 0).any(axis=1))
    if k is not None:
        w = windows[k]
        raise ValueError(f"window {k}: negative size or stride (rows={w.rows}, cols={w.cols}, "
                         f"row_stride={w.row_stride}, col_stride={w.col_stride})")
    # bounds, in storage elements (strides are >= 0, so the extremes are the first/last element)
    info = np.array([(x.storage_offset(), x.untyped_storage().nbytes() // x.element_size())
                     for x in tensors], dtype=np.int64).reshape(-1, 2)
    lo = info[t, 0] + tab[:, _OFF]
    hi = lo + (tab[:, _ROWS] - 1) * tab[:, _RS] + (tab[:, _COLS] - 1) * tab[:, _CS]
    size = info[t, 1]
    nonempty = (tab[:, _ROWS] > 0) & (tab[:, _COLS] > 0)
    k = first(nonempty & ((lo < 0) | (hi >= size)))
    if k is not None:
        raise ValueError(f"window {k}: elements {int(lo[k])}..{int(hi[k])} of tensor "
                         f"{int(t[k])}'s storage, which has {int(size[k])} elements")
    return tab


def _total(tab: np.ndarray) -> int:
    return int((tab[:, _ROWS] * tab[:, _COLS]).sum())


def _flat_buffer(flat: torch.Tensor | None, total: int, dtype: torch.dtype,
                 device: torch.device, name: str) -> torch.Tensor:
    if flat is None:
        return torch.empty(total, dtype=dtype, device=device)
    if flat.numel() < total:
        raise ValueError(f"{name} has {flat.numel()} elements, the windows need {total}")
    return flat


# ------------------------------------------------------------------------------ torch twin


def _views(tensors: Sequence[torch.Tensor], windows: Sequence[Window]):
    """(window view, its offset in the flat buffer) of every non-empty window."""
    pos = 0
    for w in windows:
        n = w.rows * w.cols
        if n:
            t = tensors[w.tensor].detach()
            yield torch.as_strided(t, (w.rows, w.cols), (w.row_stride, w.col_stride),
                                   t.storage_offset() + w.offset), pos
        pos += n


def pack_torch(tensors: Sequence[torch.Tensor], windows: Sequence[Window],
               out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`pack` in plain torch (the CPU path and the test oracle)."""
    dtype, device = _check_tensors(tensors, out, "out")
    total = _total(_window_table(tensors, windows))
    out = _flat_buffer(out, total, dtype, device, "out")
    with torch.no_grad():
        for v, pos in _views(tensors, windows):
            out[pos:pos + v.numel()].view(v.shape).copy_(v)
    return out[:total]


def unpack_torch(packed: torch.Tensor, tensors: Sequence[torch.Tensor],
                 windows: Sequence[Window]) -> None:
    """:func:`unpack` in plain torch."""
    dtype, device = _check_tensors(tensors, packed, "packed")
    total = _total(_window_table(tensors, windows))
    _flat_buffer(packed, total, dtype, device, "packed")
    with torch.no_grad():
        for v, pos in _views(tensors, windows):
            v.copy_(packed[pos:pos + v.numel()].view(v.shape))


# ---------------------------------------------------------------------------------- triton

# the kernel copies bits: any dtype is viewed as the integer of its size
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_TILE_BYTES = 16384  # per program on GPU: 16 KiB in flight keeps HBM busy with 4 warps
_BLOCK_C = 256       # tile width in elements (>= 1 KiB rows for 4-byte types: full coalescing)
# per-window copy paths (meta field 1)
_STRIDED, _UNIT, _VECTOR = 0, 1, 2

if triton is not None:

    @triton.jit
    def _copy_tile(flat_ptr, win_base, flat_base, rows_left, cols_left, cols, row_stride,
                   col_stride, UNPACK: tl.constexpr, UNIT_COL: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        i = tl.arange(0, BLOCK_R)[:, None]
        j = tl.arange(0, BLOCK_C)[None, :]
        mask = (i < rows_left) & (j < cols_left)
        if UNIT_COL:  # a literal stride 1 lets the compiler see contiguous rows
            win = flat_ptr + win_base + i * row_stride + j
        else:
            win = flat_ptr + win_base + i * row_stride + j * col_stride
        flat = flat_ptr + flat_base + i * cols + j
        if UNPACK:
            tl.store(win, tl.load(flat, mask=mask), mask=mask)
        else:
            tl.store(flat, tl.load(win, mask=mask), mask=mask)

    # n_windows / n_steps are not specialised (Triton would compile a variant for a value of 1
    # and one for multiples of 16): one compiled kernel per element size and direction serves
    # every window count, so :func:`warm_up` can compile all of them on a tiny buffer
    @triton.jit(do_not_specialize=["n_windows", "n_steps"])
    def _window_copy_kernel(flat_ptr, meta_ptr, n_windows, n_steps, UNPACK: tl.constexpr,
                            VEC: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        """One BLOCK_R x BLOCK_C tile of one window. Windows are addressed in elements relative
        to ``flat_ptr`` (the packed buffer). ``meta`` is [n_windows, 8] int64: first tile, copy
        path, window offset, rows, cols, row stride, column stride, offset in the flat buffer."""
        pid = tl.program_id(0).to(tl.int64)
        # binary search: the last window whose first tile is <= pid (n_steps = ceil(log2 W))
        lo = pid * 0
        hi = lo + n_windows
        for _ in range(n_steps):
            mid = (lo + hi) // 2
            go = tl.load(meta_ptr + mid * 8) <= pid
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
        m = meta_ptr + lo * 8
        tile = pid - tl.load(m)
        path = tl.load(m + 1)
        win_off = tl.load(m + 2)
        rows = tl.load(m + 3)
        cols = tl.load(m + 4)
        row_stride = tl.load(m + 5)
        col_stride = tl.load(m + 6)
        flat_off = tl.load(m + 7)

        col_tiles = (cols + BLOCK_C - 1) // BLOCK_C
        r0 = (tile // col_tiles) * BLOCK_R
        c0 = (tile % col_tiles) * BLOCK_C
        win_base = win_off + r0 * row_stride + c0 * col_stride
        flat_base = flat_off + r0 * cols + c0
        if path == 2:  # _VECTOR
            # the host checked that starts, row stride and width are multiples of VEC elements
            # (16 bytes): (x // VEC) * VEC == x then, and the compiler can prove the alignment
            # from it, so rows move as 128-bit accesses. (A tl.multiple_of hint would mark the
            # shared loads above and leak into the other paths.)
            cols_v = (cols // VEC) * VEC
            _copy_tile(flat_ptr, (win_base // VEC) * VEC, (flat_base // VEC) * VEC, rows - r0,
                       cols_v - c0, cols_v, (row_stride // VEC) * VEC, 1,
                       UNPACK, True, BLOCK_R, BLOCK_C)
        elif path == 1:  # _UNIT: column stride 1, unaligned
            _copy_tile(flat_ptr, win_base, flat_base, rows - r0, cols - c0, cols, row_stride, 1,
                       UNPACK, True, BLOCK_R, BLOCK_C)
        else:  # _STRIDED: e.g. a transposed block
            _copy_tile(flat_ptr, win_base, flat_base, rows - r0, cols - c0, cols, row_stride,
                       col_stride, UNPACK, False, BLOCK_R, BLOCK_C)

    # under TRITON_INTERPRET=1 (read when this module is imported) jit gives an interpreted one
    _INTERPRETED = type(_window_copy_kernel).__name__ == "InterpretedFunction"
else:  # pragma: no cover
    _INTERPRETED = False


def _default_block(element_size: int) -> tuple[int, int]:
    if _INTERPRETED:
        return 64, _BLOCK_C  # the interpreter pays per program: few, large tiles
    return max(1, _TILE_BYTES // (element_size * _BLOCK_C)), _BLOCK_C


def _kernel_meta(tensors: Sequence[torch.Tensor], tab: np.ndarray, flat: torch.Tensor,
                 block_r: int, block_c: int) -> tuple[torch.Tensor, int] | None:
    """(meta [W', 8] int64 on the CPU, number of tiles) for the kernel; None if nothing to copy.

    Empty windows are dropped; contiguous windows are re-cut into full-width rows + a tail;
    tiles may run in any order since every window carries its own flat offset."""
    es = flat.element_size()
    numel = tab[:, _ROWS] * tab[:, _COLS]
    flat_off = np.cumsum(numel) - numel
    keep = numel > 0
    tab, numel, flat_off = tab[keep], numel[keep], flat_off[keep]
    if tab.shape[0] == 0:
        return None
    # every tensor addressed from the flat buffer's pointer: exact when the byte distance is a
    # whole number of elements (always, for element-aligned allocations; checked)
    ptrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64) - flat.data_ptr()
    bad = np.flatnonzero(ptrs % es)
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"tensor {k} is not element-aligned relative to the flat buffer "
                         f"(address difference {int(ptrs[k])} bytes, element size {es})")
    win_off = ptrs[tab[:, _T]] // es + tab[:, _OFF]
    rows, cols, rs, cs = tab[:, _ROWS], tab[:, _COLS], tab[:, _RS], tab[:, _CS]

    # contiguous runs (one row, or rows that follow each other) -> (n // C) x C + a 1-row tail
    run = (rows == 1) | (rs == cols * cs)
    full = numel // block_c
    tail = numel - full * block_c
    bc = np.full_like(full, block_c)
    w = np.concatenate([
        # strided windows as they are
        np.stack([win_off, rows, cols, rs, cs, flat_off], 1)[~run],
        np.stack([win_off, full, bc, bc * cs, cs, flat_off], 1)[run & (full > 0)],
        # tail: row_stride = C*cs like the body (any value does for one row; this one aligns)
        np.stack([win_off + full * block_c * cs, np.ones_like(full), tail, bc * cs, cs,
                  flat_off + full * block_c], 1)[run & (tail > 0)],
    ])  # [W', 6]: win_off, rows, cols, row_stride, col_stride, flat_off
    tiles = ((w[:, 1] + block_r - 1) // block_r) * ((w[:, 2] + block_c - 1) // block_c)
    first_tile = np.cumsum(tiles) - tiles

    # copy path per window: 128-bit accesses need every row start of both sides 16-byte aligned
    vec = 16 // es
    path = np.where(w[:, 4] == 1, _UNIT, _STRIDED)
    if flat.data_ptr() % 16 == 0:
        aligned = ((w[:, 4] == 1) & (w[:, 0] % vec == 0) & (w[:, 5] % vec == 0)
                   & (w[:, 3] % vec == 0) & (w[:, 2] % vec == 0))
        path = np.where(aligned, _VECTOR, path)
    meta = np.concatenate([first_tile[:, None], path[:, None], w], 1).astype(np.int64)
    return torch.from_numpy(np.ascontiguousarray(meta)), int(tiles.sum())


def _launch(tensors: Sequence[torch.Tensor], tab: np.ndarray, flat: torch.Tensor,
            unpack: bool, block: tuple[int, int] | None) -> None:
    if triton is None:  # pragma: no cover
        raise RuntimeError("the Triton path needs triton")
    device = flat.device
    if device.type != "cuda" and not _INTERPRETED:
        raise ValueError(f"pack_triton/unpack_triton need CUDA tensors (got {device}); set "
                         "TRITON_INTERPRET=1 before importing malleus_ds_kernels.pack to run on CPU")
    es = flat.element_size()
    if es not in _BITS:
        raise ValueError(f"the Triton path copies 1/2/4/8-byte elements, not {flat.dtype}")
    block_r, block_c = block or _default_block(es)
    plan = _kernel_meta(tensors, tab, flat, block_r, block_c)
    if plan is None:
        return
    meta, n_tiles = plan
    n_windows = meta.shape[0]
    # the one host->device copy; non_blocking: from pageable memory CUDA stages the bytes before
    # returning without waiting for the stream, so the host runs ahead (a blocking .to() syncs)
    meta = meta.to(device, non_blocking=True)
    # Triton launches on the current device: make it the tensors' one
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        _window_copy_kernel[(n_tiles,)](
            flat.detach().view(_BITS[es]), meta, n_windows, (n_windows - 1).bit_length(),
            UNPACK=unpack, VEC=16 // es, BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4)


def pack_triton(tensors: Sequence[torch.Tensor], windows: Sequence[Window],
                out: torch.Tensor | None = None, *,
                block: tuple[int, int] | None = None) -> torch.Tensor:
    """:func:`pack` as ONE Triton launch. ``block`` = (BLOCK_R, BLOCK_C) overrides the tile
    (powers of two; for tests)."""
    dtype, device = _check_tensors(tensors, out, "out")
    tab = _window_table(tensors, windows)
    total = _total(tab)
    out = _flat_buffer(out, total, dtype, device, "out")
    if total:
        _launch(tensors, tab, out, unpack=False, block=block)
    return out[:total]


def unpack_triton(packed: torch.Tensor, tensors: Sequence[torch.Tensor],
                  windows: Sequence[Window], *, block: tuple[int, int] | None = None) -> None:
    """:func:`unpack` as ONE Triton launch (windows must not overlap)."""
    dtype, device = _check_tensors(tensors, packed, "packed")
    tab = _window_table(tensors, windows)
    total = _total(tab)
    _flat_buffer(packed, total, dtype, device, "packed")
    if total:
        _launch(tensors, tab, packed, unpack=True, block=block)


# -------------------------------------------------------------------------------- dispatch


def _use_triton(tensors: Sequence[torch.Tensor], flat: torch.Tensor | None) -> bool:
    ref = tensors[0] if len(tensors) else flat
    return (triton is not None and ref is not None and ref.device.type == "cuda"
            and ref.element_size() in _BITS)


def pack(tensors: Sequence[torch.Tensor], windows: Sequence[Window],
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy every window, in order and each row-major, back to back into one contiguous 1-D buffer
    ``out`` (allocated if None; length >= total numel). All tensors and out share one dtype and device
    (ValueError naming the index and dtypes otherwise). CUDA tensors -> one Triton launch; otherwise the
    plain-torch path. Returns out[:total]."""
    if _use_triton(tensors, out):
        return pack_triton(tensors, windows, out)
    return pack_torch(tensors, windows, out)


def unpack(packed: torch.Tensor, tensors: Sequence[torch.Tensor],
           windows: Sequence[Window]) -> None:
    """Inverse of pack: write packed's consecutive segments into the windows of tensors."""
    if _use_triton(tensors, packed):
        unpack_triton(packed, tensors, windows)
    else:
        unpack_torch(packed, tensors, windows)


# --------------------------------------------------------------------------------- warm-up


def warm_up(device, dtypes) -> int:
    """Compile (or load from Triton's on-disk cache) every kernel variant :func:`pack` and
    :func:`unpack` launch for tensors of ``dtypes`` on ``device``, on a tiny buffer, so no later
    call pays a compile. Call once at start-up, outside any timing: the adaptive loop
    calibrates migration cost from the first migration's seconds
    (``malleus_ds/engine/switch.py``, ``malleus_ds/adaptive/control.py``).

    A variant is fixed by the element size (the kernel copies bits: bf16 and fp16 share one),
    the direction, and the packed buffer's 16-byte alignment, on which Triton specialises
    pointers; migration's buffers are fresh allocations, hence aligned, and so are the ones
    used here. Window counts are not specialised (``do_not_specialize`` above).

    Returns the number of launches: 0 where pack/unpack take the torch path (a non-CUDA
    device, no triton, an element size the kernel does not copy) -- a no-op there."""
    dev = torch.device(device) if device is not None else None
    if triton is None or dev is None or dev.type != "cuda":
        return 0
    launches = _warm_up_on(dev, dtypes)
    if launches:
        torch.cuda.synchronize(dev)
    return launches


def _warm_up_on(dev: torch.device, dtypes) -> int:
    """:func:`warm_up`'s launches, on any device pack_triton runs on (CUDA; the CPU under
    ``TRITON_INTERPRET=1``, for tests): one pack and one unpack per element size."""
    by_size: dict[int, torch.dtype] = {}
    for dt in dtypes:
        es = torch.empty(0, dtype=dt).element_size()
        if es in _BITS:
            by_size.setdefault(es, dt)
    launches = 0
    for es, dt in sorted(by_size.items()):
        src = torch.zeros(64, dtype=dt, device=dev)
        # a strided 2-row window and a contiguous run, packed and written back in place
        wins = [Window(0, 0, 2, 8, 16, 1), Window(0, 40, 1, 8, 8, 1)]
        packed = pack_triton([src], wins)
        unpack_triton(packed, [src], wins)
        launches += 2
    return launches
