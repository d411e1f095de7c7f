"""Pack benchmark: the live-migration pack against torch.cat and a plain device copy, side by side.

    .venv/bin/python bench/bench_pack.py [--mb 256] [--slices 64] [--device cuda|cpu]
                                         [--dtype float32|bfloat16] [--misalign] [--repeats N]
                                         [--json]

The slice list is what a migration sends to one peer, in equal thirds: TP column blocks of
row-parallel weights (``w.narrow(1, k*c, c)``: strided rows, 4 blocks a weight), row blocks of
column-parallel weights (contiguous, 4 a weight) and ZeRO ranges of flat buffers (4 a buffer);
every slice is ~``mb/slices`` MB and the slices tile their tensors, so ``--mb`` is both the
payload and the memory the sources take. ``--misalign`` starts every slice one element later
(one element shorter): no 16-byte alignment, the kernel's scalar path.

Measured in one run, after warm-up, median over ``--repeats`` (CUDA events around a loop of
back-to-back calls on GPU, wall clock on CPU):

* pack: ``malleus_ds_kernels.pack.pack`` into a preallocated buffer -- one Triton launch on CUDA (host
  metadata build and its host->device copy included), the plain-torch twin on CPU;
* cat: ``torch.cat([s.reshape(-1) for s in slices])`` (what pack replaces);
* copy: ``dst.copy_(src)`` of the same number of bytes, both contiguous (the ceiling);
* unpack: the inverse, into the same windows;
* on CUDA also the kernel alone (metadata prebuilt), to split launch overhead from bandwidth.

GB/s counts payload bytes (each is read once and written once). On CUDA it prints
``target: pack/copy >= 0.85 on GPU`` with PASS/FAIL; on CPU it runs the torch path and says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere

from malleus_ds_kernels import pack as P  # noqa: E402

TARGET = 0.85


def build_slices(mb: float, n_slices: int, dtype: torch.dtype, device: str, misalign: bool):
    """(tensors, views, windows): ~mb MB in n_slices slices, a third of each kind."""
    es = torch.empty(0, dtype=dtype).element_size()
    per = max(1, int(mb * 2**20 / es / n_slices))  # elements a slice
    shift = 1 if misalign else 0
    tensors: list[torch.Tensor] = []
    views: list[tuple[int, torch.Tensor]] = []
    gen = torch.Generator(device=device).manual_seed(0)

    def new(*shape: int) -> int:
        tensors.append(torch.randn(*shape, generator=gen, device=device).to(dtype))
        return len(tensors) - 1

    kinds = ["col", "row", "zero"]
    counts = {k: n_slices // 3 + (1 if i < n_slices % 3 else 0) for i, k in enumerate(kinds)}
    # row-parallel weight [out, 4*c]: a TP column block is c wide (the local in-features)
    c = 512
    rows = max(1, per // c)
    for b in range(counts["col"]):
        if b % 4 == 0:
            t = new(rows, 4 * c)
        w = tensors[t]
        views.append((t, w.narrow(1, (b % 4) * c + shift, c - shift)))
    # column-parallel weight [4*r, hidden]: a TP row block is r contiguous rows
    hidden = 4096
    r = max(1, per // hidden)
    for b in range(counts["row"]):
        if b % 4 == 0:
            t = new(4 * r, hidden)
        w = tensors[t]
        views.append((t, w.view(-1)[(b % 4) * r * hidden + shift:(b % 4 + 1) * r * hidden]))
    # flat fp32 (or --dtype) buffer: ZeRO partitions are ranges
    for b in range(counts["zero"]):
        if b % 4 == 0:
            t = new(4 * per)
        views.append((t, tensors[t][(b % 4) * per + shift:(b % 4 + 1) * per]))
    windows = [P.window_of(k, tensors[k], v) for k, v in views]
    return tensors, [v for _, v in views], windows, counts


def timed(fn: Callable[[], object], device: str, repeats: int, inner: int) -> float:
    """Median seconds per call."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(repeats):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def measure(mb: float = 256, n_slices: int = 64, device: str = "cuda",
            dtype: torch.dtype = torch.float32, misalign: bool = False,
            repeats: int | None = None) -> dict:
    """Check pack/unpack against cat, then time every row; returns ``{"secs", "gbs", "nbytes",
    "n_windows", "counts", "device_name", "pack_over_copy", "pack_over_cat", "kernel_over_copy"
    (CUDA only, else None)}``. Used by :func:`main` and ``scripts/gpu_check.py``."""
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError("bench_pack: device cuda but no CUDA device")
    repeats = repeats or (20 if cuda else 5)
    inner = 10 if cuda else 1

    tensors, views, windows, counts = build_slices(mb, n_slices, dtype, device, misalign)
    total = sum(w.numel for w in windows)
    nbytes = total * tensors[0].element_size()
    out = torch.empty(total, dtype=dtype, device=device)
    src = torch.empty(total, dtype=dtype, device=device).random_()
    dst = torch.empty_like(src)

    # correctness first: pack == cat, unpack(pack) restores every slice
    got = P.pack(tensors, windows, out)
    if not torch.equal(got, torch.cat([v.reshape(-1) for v in views])):
        raise AssertionError("pack != cat")
    targets = [torch.zeros_like(t) for t in tensors]
    P.unpack(got, targets, windows)
    if not torch.equal(P.pack(targets, windows), got):
        raise AssertionError("unpack(pack) does not round-trip")

    rows = [
        ("pack", lambda: P.pack(tensors, windows, out)),
        ("cat", lambda: torch.cat([v.reshape(-1) for v in views])),
        ("copy", lambda: dst.copy_(src)),
        ("unpack", lambda: P.unpack(out, targets, windows)),
    ]
    if cuda:
        es = out.element_size()
        block = P._default_block(es)
        meta, n_tiles = P._kernel_meta(tensors, P._window_table(tensors, windows), out, *block)
        meta = meta.to(device)
        flat = out.view(P._BITS[es])

        def kernel_only() -> None:
            P._window_copy_kernel[(n_tiles,)](
                flat, meta, meta.shape[0], (meta.shape[0] - 1).bit_length(), UNPACK=False,
                VEC=16 // es, BLOCK_R=block[0], BLOCK_C=block[1], num_warps=4)
        rows.append(("pack kernel only", kernel_only))

    secs = {name: timed(fn, device, repeats, inner) for name, fn in rows}
    gbs = {name: nbytes / s / 1e9 for name, s in secs.items()}
    return {"secs": secs, "gbs": gbs, "nbytes": nbytes, "n_windows": len(windows),
            "counts": counts, "device_name": torch.cuda.get_device_name() if cuda else "CPU",
            "pack_over_copy": gbs["pack"] / gbs["copy"], "pack_over_cat": gbs["pack"] / gbs["cat"],
            "kernel_over_copy": gbs["pack kernel only"] / gbs["copy"] if cuda else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=float, default=256)
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--device", choices=["cuda", "cpu"],
                    default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--misalign", action="store_true")
    ap.add_argument("--repeats", type=int, default=None, help="default 20 on CUDA, 5 on CPU")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object (measure()'s numbers) instead of the table")
    args = ap.parse_args(argv)
    device, dtype = args.device, getattr(torch, args.dtype)
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but no CUDA device")
    cuda = device == "cuda"
    r = measure(args.mb, args.slices, device, dtype, args.misalign, args.repeats)
    if args.json:
        print(json.dumps({**r, "device": device, "dtype": args.dtype, "misalign": args.misalign,
                          "target": TARGET}))
        return 0 if not cuda or r["pack_over_copy"] >= TARGET else 1
    secs, gbs, counts = r["secs"], r["gbs"], r["counts"]
    print(f"device {device} ({r['device_name']}), dtype {args.dtype}, {r['n_windows']} slices "
          f"({counts['col']} TP column blocks, {counts['row']} TP row blocks, "
          f"{counts['zero']} ZeRO ranges), {r['nbytes'] / 2**20:.1f} MiB payload"
          f"{', misaligned by one element' if args.misalign else ''}")
    if not cuda:
        print("note: on CPU pack/unpack run the plain-torch twin; the Triton kernel needs CUDA")
    for n in secs:
        print(f"  {n:<17} {secs[n] * 1e3:9.3f} ms  {gbs[n]:8.1f} GB/s")
    print(f"  pack/cat  {r['pack_over_cat']:.2f}x")
    print(f"  pack/copy {r['pack_over_copy']:.2f}")
    if cuda:
        ok = r["pack_over_copy"] >= TARGET
        print(f"  kernel only/copy {r['kernel_over_copy']:.2f}")
        print(f"target: pack/copy >= {TARGET} on GPU: {'PASS' if ok else 'FAIL'}")
        return 0 if ok else 1
    print(f"target: pack/copy >= {TARGET} on GPU: not measured on CPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
