"""malleus_ds_kernels.pack (kernels/pack.py): windows of many (often non-contiguous) tensors
<-> one flat buffer.

* the torch twin against independent oracles (``view.reshape(-1)`` of the torch view a window came
  from; python loops over the raw storage for hand-made windows), unpack round trips that must
  leave every element outside the windows untouched, window_of, and the errors;
* the Triton kernel under ``TRITON_INTERPRET=1`` in a subprocess (the flag is read when
  ``malleus_ds_kernels.pack`` is imported, so it must not leak into this process), bit-exact against the twin;
* the Triton kernel on CUDA (skipped without a GPU).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch

from malleus_ds_kernels.pack import (Window, pack, pack_torch, pack_triton, unpack, unpack_torch,
                          unpack_triton, window_of)

ROOT = Path(__file__).resolve().parents[3]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
Recipe = Callable[[torch.Tensor], torch.Tensor]


# -------------------------------------------------------------------------------- case maker


def values(n: int, dtype: torch.dtype, gen: torch.Generator, device: str = "cpu") -> torch.Tensor:
    if dtype.is_floating_point:
        return torch.randn(n, generator=gen).to(dtype).to(device)
    hi = 2 ** 62 if dtype == torch.int64 else 2 ** 30
    return torch.randint(-hi, hi, (n,), generator=gen, dtype=torch.int64).to(dtype).to(device)


def make_tensor(rng: random.Random, gen: torch.Generator, dtype: torch.dtype,
                device: str) -> torch.Tensor:
    """A random 2-D or 1-D tensor, usually a non-contiguous view inside a larger storage."""
    a, b, pad = rng.randint(1, 24), rng.randint(1, 40), rng.randint(0, 7)
    store = values(pad + 2 * a * b + 8, dtype, gen, device)
    kind = rng.randrange(5)
    if kind == 0:  # contiguous, with a storage offset
        return store[pad:pad + a * b].view(a, b)
    if kind == 1:  # transposed
        return store[pad:pad + a * b].view(b, a).t()
    if kind == 2:  # every other column
        return store[pad:pad + 2 * a * b].view(a, 2 * b)[:, ::2]
    if kind == 3:  # a column block of a wider matrix (a TP column block of a row-parallel weight)
        return store[pad:pad + 2 * a * b].view(a, 2 * b).narrow(1, rng.randint(0, b), b)
    return store[pad:pad + a * b]  # 1-D, a flat (ZeRO-like) buffer


def _cut(rng: random.Random, n: int) -> tuple[int, int]:
    s = rng.randint(0, n)
    return s, rng.randint(0, n - s)


def random_recipe(rng: random.Random, t: torch.Tensor) -> Recipe:
    """A random 0-, 1- or 2-D view of ``t`` (may overlap other recipes' views)."""
    if t.dim() == 1:
        n = t.shape[0]
        s, w = _cut(rng, n)
        return rng.choice([
            lambda x: x[s:s + w],                      # a ZeRO range
            lambda x: x[s:s + w:2],                    # strided 1-D
            lambda x: x[min(s, n - 1)],                # one element (0-D)
            lambda x: x,                               # the whole buffer
            lambda x: x[s:s],                          # empty
            lambda x: x[s:s + w].view(1, w),           # a 1-row 2-D view
        ])
    a, b = t.shape
    r, h = _cut(rng, a)
    c, w = _cut(rng, b)
    return rng.choice([
        lambda x: x.narrow(1, c, w),                   # TP column block
        lambda x: x.narrow(0, r, h),                   # TP row block
        lambda x: x.narrow(0, r, h).narrow(1, c, w),   # a sub-block
        lambda x: x.narrow(0, r, h).narrow(1, c, w).t(),  # transposed block
        lambda x: x[min(r, a - 1)],                    # a row
        lambda x: x[:, min(c, b - 1)],                 # a column (strided 1-D)
        lambda x: x[min(r, a - 1), min(c, b - 1)],     # one element (0-D)
        lambda x: x,                                   # the whole tensor
        lambda x: x.narrow(1, c, 0),                   # empty
    ])


def disjoint_recipes(rng: random.Random, t: torch.Tensor) -> list[Recipe]:
    """Views of ``t`` that do not overlap (unpack targets): pieces of a random 2x2 / 3-way cut."""
    out: list[Recipe] = []
    if t.dim() == 1:
        n = t.shape[0]
        i, j = sorted((rng.randint(0, n), rng.randint(0, n)))
        for s, e in ((0, i), (i, j), (j, n)):
            if rng.random() < 0.8:
                out.append(lambda x, s=s, e=e: x[s:e])
        return out
    a, b = t.shape
    r, c = rng.randint(0, a), rng.randint(0, b)
    for rs, rl in ((0, r), (r, a - r)):
        for cs, cl in ((0, c), (c, b - c)):
            if rng.random() < 0.8:
                transpose = rng.random() < 0.3
                out.append(lambda x, rs=rs, rl=rl, cs=cs, cl=cl, tr=transpose:
                           (lambda v: v.t() if tr else v)(x.narrow(0, rs, rl).narrow(1, cs, cl)))
    return out


def storage_of(t: torch.Tensor) -> torch.Tensor:
    """The whole storage of ``t`` as a 1-D tensor (independent of as_strided)."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def raw_window(rng: random.Random, k: int, t: torch.Tensor) -> Window:
    """A hand-made in-bounds window in storage coordinates (offset may be negative: before
    t's first element), with arbitrary strides."""
    n = storage_of(t).numel()
    rows, cols = rng.randint(1, 5), rng.randint(1, 5)
    rs, cs = rng.randint(0, 9), rng.randint(0, 4)
    span = (rows - 1) * rs + (cols - 1) * cs
    if span >= n:
        rows, cols, span = 1, 1, 0
    start = rng.randint(0, n - 1 - span)
    return Window(k, start - t.storage_offset(), rows, cols, rs, cs)


def raw_oracle(t: torch.Tensor, w: Window) -> torch.Tensor:
    s = storage_of(t).cpu()
    base = t.storage_offset() + w.offset
    return torch.stack([s[base + i * w.row_stride + j * w.col_stride]
                        for i in range(w.rows) for j in range(w.cols)])


@dataclass
class Case:
    tensors: list[torch.Tensor]
    windows: list[Window] = field(default_factory=list)
    expected: list[torch.Tensor] = field(default_factory=list)  # per window, row-major
    recipes: list[tuple[int, Recipe]] = field(default_factory=list)  # disjoint cases only

    @property
    def packed(self) -> torch.Tensor:
        t = self.tensors[0]
        return torch.cat([e.reshape(-1) for e in self.expected]) if self.expected else \
            torch.empty(0, dtype=t.dtype, device=t.device)


def random_case(seed: int, dtype: torch.dtype, device: str = "cpu", disjoint: bool = False,
                max_tensors: int = 5, max_windows: int = 12) -> Case:
    """Random tensors and windows. ``disjoint``: non-overlapping views only (for unpack), with
    their recipes; otherwise overlapping views and hand-made raw windows too."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    case = Case([make_tensor(rng, gen, dtype, device) for _ in range(rng.randint(1, max_tensors))])
    if disjoint:
        picks = [(k, f) for k, t in enumerate(case.tensors) for f in disjoint_recipes(rng, t)]
        rng.shuffle(picks)
        case.recipes = picks
    else:
        picks = []
        for _ in range(rng.randint(0, max_windows)):
            k = rng.randrange(len(case.tensors))
            t = case.tensors[k]
            if rng.random() < 0.2:
                w = raw_window(rng, k, t)
                case.windows.append(w)
                case.expected.append(raw_oracle(t, w).to(device))
            else:
                picks.append((k, random_recipe(rng, t)))
    for k, f in picks:
        v = f(case.tensors[k])
        case.windows.append(window_of(k, case.tensors[k], v))
        case.expected.append(v.reshape(-1))
    return case


def sentinel_like(tensors: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Same geometry (shape, strides, storage offset) in fresh storages of random values."""
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for t in tensors:
        s = values(storage_of(t).numel(), t.dtype, gen, str(t.device))
        out.append(torch.as_strided(s, t.shape, t.stride(), t.storage_offset()))
    return out


def check_unpack(case: Case, seed: int, unpack_fn, packed: torch.Tensor) -> None:
    """unpack into sentinel copies: exactly the windowed elements change, to the source's."""
    got = sentinel_like(case.tensors, seed)
    want = [storage_of(t).clone() for t in got]
    want = [torch.as_strided(s, t.shape, t.stride(), t.storage_offset()) for s, t in zip(want, got)]
    for k, f in case.recipes:
        f(want[k]).copy_(f(case.tensors[k]))
    unpack_fn(packed, got, case.windows)
    for k, (g, w) in enumerate(zip(got, want)):
        assert torch.equal(storage_of(g), storage_of(w)), f"tensor {k}"


# -------------------------------------------------------------------------------- torch twin


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_pack_torch_matches_oracle(dtype):
    for seed in range(40):
        case = random_case(seed, dtype)
        got = pack_torch(case.tensors, case.windows)
        assert got.shape == (sum(w.numel for w in case.windows),)
        assert torch.equal(got, case.packed), seed
        assert torch.equal(pack(case.tensors, case.windows), case.packed), seed  # CPU dispatch


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unpack_torch_round_trip(dtype):
    for seed in range(40):
        case = random_case(seed, dtype, disjoint=True)
        packed = pack_torch(case.tensors, case.windows)
        check_unpack(case, seed, unpack_torch, packed)
        check_unpack(case, seed, unpack, packed)


def test_pack_into_given_out():
    case = next(c for c in map(lambda s: random_case(s, torch.float32), range(100))
                if c.packed.numel() > 0)
    total = case.packed.numel()
    buf = torch.full((total + 20,), -7.0)
    out = buf[5:]  # a view with a storage offset
    got = pack_torch(case.tensors, case.windows, out=out)
    assert got.data_ptr() == out.data_ptr() and got.numel() == total
    assert torch.equal(got, case.packed)
    assert (buf[:5] == -7).all() and (buf[5 + total:] == -7).all()


def test_unpack_into_parameters():
    # migration writes into nn.Parameters; autograd must not object
    w = torch.nn.Parameter(torch.zeros(6, 8))
    src = torch.arange(48.0).view(6, 8)
    win = [window_of(0, w, w.narrow(1, 2, 4))]
    unpack_torch(pack_torch([src], win), [w], win)
    assert torch.equal(w.data[:, 2:6], src[:, 2:6]) and (w.data[:, :2] == 0).all()
    assert pack_torch([w], win).requires_grad is False


def test_empty_windows_and_lists():
    t = torch.arange(10.0)
    assert pack_torch([t], []).numel() == 0
    assert pack_torch([t], [Window(0, 3, 0, 5, 1, 1), Window(0, 0, 4, 0, 1, 1)]).numel() == 0
    got = pack_torch([t], [Window(0, 3, 0, 5, 1, 1), Window(0, 2, 1, 3, 3, 1)])
    assert torch.equal(got, t[2:5])
    unpack_torch(torch.empty(0), [t], [])


# ------------------------------------------------------------------------------- window_of


def test_window_of_fields():
    base = torch.zeros(16, 32)
    assert window_of(0, base, base.narrow(1, 8, 8)) == Window(0, 8, 16, 8, 32, 1)
    assert window_of(1, base, base.narrow(1, 8, 8).t()) == Window(1, 8, 8, 16, 1, 32)
    assert window_of(0, base, base.view(-1)[100:200]) == Window(0, 100, 1, 100, 100, 1)
    assert window_of(0, base, base[2, 3]) == Window(0, 67, 1, 1, 1, 1)
    # offsets are relative to base's first element, even when base is itself a view
    sub = base[1:]
    assert window_of(0, sub, base[0]).offset == -32
    # more than 2 dims: merged when they form runs
    cube = torch.zeros(4, 5, 6)
    assert window_of(0, cube, cube[:, 1:3, :]) == Window(0, 6, 4, 12, 30, 1)
    assert window_of(0, cube, cube[1:2, :, 2:3]) == Window(0, 32, 1, 5, 30, 6)
    assert window_of(0, cube, cube) == Window(0, 0, 1, 120, 120, 1)


def test_window_of_round_trip():
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        t = make_tensor(rng, gen, torch.float32, "cpu")
        v = random_recipe(rng, t)(t)
        w = window_of(0, t, v)
        assert w.numel == v.numel()
        got = torch.as_strided(t, (w.rows, w.cols), (w.row_stride, w.col_stride),
                               t.storage_offset() + w.offset)
        assert torch.equal(got.reshape(-1), v.reshape(-1))


def test_window_of_errors():
    base = torch.zeros(4, 5, 6)
    with pytest.raises(ValueError, match="storage"):
        window_of(0, base, torch.zeros(3))
    with pytest.raises(ValueError, match="merge into 2 dims"):
        window_of(0, base, base[:, 1:3, 1:3])
    with pytest.raises(ValueError, match="byte elements"):
        window_of(0, base, base.view(torch.int16))


# ---------------------------------------------------------------------------------- errors


def test_errors_dtypes_and_buffers():
    a, b = torch.zeros(10), torch.zeros(10, dtype=torch.float64)
    w = [Window(0, 0, 1, 4, 4, 1)]
    for fn in (pack_torch, pack, pack_triton):
        with pytest.raises(ValueError,
                           match=r"tensor 1 has dtype torch.float64, tensor 0 has torch.float32"):
            fn([a, b], w)
        with pytest.raises(ValueError, match=r"out has dtype torch.float64"):
            fn([a], w, out=torch.zeros(8, dtype=torch.float64))
        with pytest.raises(ValueError, match=r"out has 3 elements, the windows need 4"):
            fn([a], w, out=torch.zeros(3))
        with pytest.raises(ValueError, match="contiguous 1-D"):
            fn([a], w, out=torch.zeros(8, 2)[:, 0])
    for fn in (unpack_torch, unpack, unpack_triton):
        with pytest.raises(ValueError, match=r"packed has dtype torch.float64"):
            fn(torch.zeros(4, dtype=torch.float64), [a], w)
        with pytest.raises(ValueError, match=r"packed has 2 elements, the windows need 4"):
            fn(torch.zeros(2), [a], w)


def test_errors_windows():
    t = torch.zeros(20)[4:]  # storage of 20 elements, data_ptr at element 4
    ok = Window(0, 0, 1, 2, 2, 1)
    cases = [
        (Window(1, 0, 1, 2, 2, 1), r"window 1: tensor index 1 out of range for 1 tensors"),
        (Window(0, 0, -1, 2, 2, 1), r"window 1: negative size or stride \(rows=-1"),
        (Window(0, 0, 2, 2, -3, 1), r"window 1: negative size or stride .*row_stride=-3"),
        (Window(0, 10, 2, 3, 4, 1),
         r"window 1: elements 14\.\.20 of tensor 0's storage, which has 20"),
        (Window(0, -5, 1, 3, 3, 1), r"window 1: elements -1\.\.1 of tensor 0's storage"),
        (Window(0, 0, 3, 2, 1, 8), r"window 1: elements 4\.\.14"),  # in range: no error
    ]
    for bad, msg in cases[:-1]:
        for fn in (pack_torch, pack_triton):
            with pytest.raises(ValueError, match=msg):
                fn([t], [ok, bad])
        with pytest.raises(ValueError, match=msg):
            unpack_torch(torch.zeros(100), [t], [ok, bad])
    # the last one is fine; an empty window may point anywhere
    pack_torch([t], [ok, cases[-1][0], Window(0, 10**6, 0, 3, 1, 1)])
    # in range of the storage, though outside the view itself: allowed (storage coordinates)
    assert torch.equal(pack_torch([t], [Window(0, -4, 1, 4, 4, 1)]), torch.zeros(4))


# ------------------------------------------------------------------- Triton (interpreter, CPU)

_INTERP_SCRIPT = r"""
import json, sys, torch
import malleus_ds_kernels.pack as P
from tests.unit.kernels.test_pack import DTYPES, random_case, check_unpack
assert P._INTERPRETED, "TRITON_INTERPRET=1 did not take"

launches = [0]
kernel = P._window_copy_kernel
class Counting:  # every pack_triton / unpack_triton must be ONE launch
    def __getitem__(self, grid):
        launches[0] += 1
        return kernel[grid]
P._window_copy_kernel = Counting()

SEEDS = 8
BLOCKS = [None, (4, 16), (1, 32), (16, 8)]  # default (large) and small tiles: many tiles a window
results = {}
for dtype in DTYPES:
    # probe: a dtype the interpreter cannot run at all is reported as a skip, not a failure
    try:
        t = torch.arange(12).to(dtype)
        P.pack_triton([t], [P.window_of(0, t, t)])
    except Exception as e:
        results[str(dtype)] = {"skip": f"{type(e).__name__}: {e}"}
        continue
    try:
        n = 0
        for seed in range(SEEDS):
            block = BLOCKS[seed % len(BLOCKS)]
            case = random_case(seed, dtype, max_windows=16)
            before = launches[0]
            got = P.pack_triton(case.tensors, case.windows, block=block)
            want = P.pack_torch(case.tensors, case.windows)
            assert torch.equal(got, want), (seed, block)
            assert torch.equal(got, case.packed), (seed, block)
            assert launches[0] - before == (1 if got.numel() else 0)
            case = random_case(seed, dtype, disjoint=True)
            packed = P.pack_triton(case.tensors, case.windows, block=block)
            before = launches[0]
            check_unpack(case, seed, lambda p, t, w: P.unpack_triton(p, t, w, block=block), packed)
            assert launches[0] - before == (1 if packed.numel() else 0)
            n += 1
        # all three copy paths in one launch: 16-byte aligned rows, unaligned, strided
        w = torch.arange(64 * 512).to(dtype).view(64, 512)
        f = torch.arange(5000).to(dtype)
        views = [(0, w.narrow(1, 128, 128)), (1, f[800:4000]), (0, w.narrow(1, 3, 61)),
                 (1, f[4001:4999]), (0, w.narrow(0, 5, 9).narrow(1, 256, 64).t())]
        ts = [w, f]
        ws = [P.window_of(k, ts[k], v) for k, v in views]
        want = torch.cat([v.reshape(-1) for _, v in views])
        meta, _ = P._kernel_meta(ts, P._window_table(ts, ws), want, 8, 64)
        assert set(meta[:, 1].tolist()) == {P._STRIDED, P._UNIT, P._VECTOR}, meta[:, 1]
        for block in (None, (8, 64)):
            assert torch.equal(P.pack_triton(ts, ws, block=block), want)
            got = [torch.zeros_like(t) for t in ts]
            P.unpack_triton(want, got, ws[:4], block=block)  # the transposed block overlaps
            assert torch.equal(P.pack_torch(got, ws[:4]), want[:-9 * 64])
        # many windows of many tensors in one launch (a deep binary search)
        case = random_case(99, dtype, max_tensors=12, max_windows=300)
        assert torch.equal(P.pack_triton(case.tensors, case.windows), case.packed)
        results[str(dtype)] = {"ok": n}
    except Exception:
        import traceback
        results[str(dtype)] = {"error": traceback.format_exc()}
# warm-up: on CUDA only (a CPU device is a no-op even here); its launches, run by the
# interpreter, are one pack + one unpack per element size and leave nothing changed
try:
    before = launches[0]
    assert P.warm_up("cpu", [torch.float32]) == 0 and launches[0] == before
    n = P._warm_up_on(torch.device("cpu"), [torch.bfloat16, torch.float16, torch.float32])
    results["warm_up"] = {"launches": n, "counted": launches[0] - before}
except Exception:
    import traceback
    results["warm_up"] = {"error": traceback.format_exc()}
print("RESULTS " + json.dumps(results))
"""


@pytest.fixture(scope="module")
def interpreter_results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _INTERP_SCRIPT], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULTS "):])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_interpreter_matches_torch(interpreter_results, dtype):
    r = interpreter_results[str(dtype)]
    if "skip" in r:
        pytest.skip(f"the Triton interpreter cannot run {dtype}: {r['skip']}")
    assert "error" not in r, r["error"]
    assert r["ok"] == 8          # SEEDS in _INTERP_SCRIPT


def test_warm_up_launches_under_interpreter(interpreter_results):
    # bf16 and fp16 share the 2-byte kernel: 2 element sizes x (pack + unpack)
    r = interpreter_results["warm_up"]
    assert "error" not in r, r["error"]
    assert r == {"launches": 4, "counted": 4}


def test_warm_up_is_a_no_op_on_cpu():
    from malleus_ds_kernels.pack import warm_up
    t = torch.arange(12.0)
    assert warm_up("cpu", DTYPES) == 0
    assert warm_up(torch.device("cpu"), [torch.bfloat16]) == 0
    assert warm_up(None, [torch.float32]) == 0
    assert warm_up("cpu", []) == 0
    assert torch.equal(pack([t], [window_of(0, t, t[2:9])]), t[2:9])   # still packs


def test_triton_needs_cuda_without_interpreter():
    import malleus_ds_kernels.pack as P
    if P._INTERPRETED:
        pytest.skip("this process runs the interpreter")
    t = torch.zeros(8)
    with pytest.raises(ValueError, match="need CUDA tensors"):
        pack_triton([t], [Window(0, 0, 1, 8, 8, 1)])


# ------------------------------------------------------------------------------ Triton (CUDA)

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_triton_cuda_matches_torch(dtype):
    for seed in range(30):
        case = random_case(seed, dtype, device="cuda", max_windows=24)
        got = pack(case.tensors, case.windows)  # dispatches to Triton on CUDA
        assert torch.equal(got, pack_torch(case.tensors, case.windows)), seed
        assert torch.equal(got, case.packed), seed
        for block in (None, (4, 16)):
            assert torch.equal(pack_triton(case.tensors, case.windows, block=block), case.packed)
        case = random_case(seed, dtype, device="cuda", disjoint=True)
        packed = pack(case.tensors, case.windows)
        check_unpack(case, seed, unpack, packed)
        check_unpack(case, seed, unpack_triton, packed)


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_triton_cuda_large_aligned_and_unaligned(dtype):
    # TP column blocks, row blocks and ZeRO ranges of realistic size; the aligned (vectorised)
    # launch and an unaligned one (odd offsets) must both be exact
    gen = torch.Generator(device="cuda").manual_seed(0)
    w_row = torch.randn(1024, 4096, device="cuda", generator=gen).to(dtype)
    w_col = torch.randn(4096, 1024, device="cuda", generator=gen).to(dtype)
    flat = torch.randn(3_000_001, device="cuda", generator=gen).to(dtype)
    ts = [w_row, w_col, flat]
    for shift in (0, 1):
        views = [(0, w_row.narrow(1, 512 * k + shift, 512)) for k in range(7)]
        views += [(1, w_col.narrow(0, 512 * k + shift, 512)) for k in range(7)]
        views += [(2, flat[shift + 400_000 * k: shift + 400_000 * (k + 1)]) for k in range(7)]
        views += [(0, w_row.narrow(1, 8 + shift, 64).t())]
        windows = [window_of(k, ts[k], v) for k, v in views]
        want = torch.cat([v.reshape(-1) for _, v in views])
        got = pack(ts, windows)  # the transposed block makes this launch a generic-stride one
        assert torch.equal(got, want), shift
        n_last = windows[-1].numel
        got = pack(ts, windows[:-1])  # unit column stride: the vectorised launch when shift=0
        assert torch.equal(got, want[:-n_last]), shift
        targets = [torch.zeros_like(t) for t in ts]
        unpack(got, targets, windows[:-1])  # the transposed block overlaps column block 0
        for (k, v), w in zip(views[:-1], windows[:-1]):
            tv = torch.as_strided(targets[k], (w.rows, w.cols), (w.row_stride, w.col_stride),
                                  targets[k].storage_offset() + w.offset)
            assert torch.equal(tv.reshape(-1), v.reshape(-1))


def _compiled_variants(fn) -> int:
    """Kernels Triton compiled for ``fn`` in this process, all devices (triton >= 3.1)."""
    return sum(len(c[0]) for c in fn.device_caches.values())


@cuda
def test_triton_cuda_warm_up_leaves_nothing_to_compile():
    import malleus_ds_kernels.pack as P
    P.warm_up("cuda", [torch.bfloat16, torch.float32])
    n = _compiled_variants(P._window_copy_kernel)
    for dtype in (torch.bfloat16, torch.float32):
        for count in (1, 2, 17, 300):        # window counts Triton would otherwise specialise
            case = random_case(count, dtype, device="cuda", max_windows=count)
            packed = pack(case.tensors, case.windows)
            unpack(packed, [t.clone() for t in case.tensors], case.windows)
    assert _compiled_variants(P._window_copy_kernel) == n
