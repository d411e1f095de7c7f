#!/usr/bin/env python
"""The one prepared GPU check: a markdown report, ready to paste into bench/RESULTS.md.

    python scripts/gpu_check.py                 # on a CUDA machine (scripts/gpu_check.sh runs it)
    python scripts/gpu_check.py --cpu-dry-run   # every part that can run on CPU, small sizes

Contract. Each part runs in a subprocess of its own (``--part NAME``) under its own timeout, so
a hang or a crash costs that part only: its rows then say FAIL with the reason. A part prints
one ``ROWS <json>`` line: rows of ``{section, what, number, unit, target, result}``; ``result``
is PASS, FAIL, ``skipped: <why>`` or ``not measured (no GPU)``. The report has one table per
section (SECTIONS, always all of them) and a summary line; the exit status is 1 if any row
FAILs, else 0. Without a GPU (and without ``--cpu-dry-run``) it refuses to run: exit 2.

Parts (GPU / dry run):

* ``triton``: pack/unpack (``malleus_ds_kernels.pack``, kernels/pack.py) bit-exact against the
  torch twin for bf16/fp16/fp32, aligned, unaligned and transposed windows / the same under
  ``TRITON_INTERPRET=1`` on small tensors;
* ``big``: one window of more than 2**31 elements (64-bit addressing), memory permitting / the
  same code on a small window, reported as not measured;
* ``compile``: first-call compile time in a fresh Triton cache, ``warm_up``'s time, and that a
  pack after ``warm_up`` compiles nothing / ``warm_up`` on CPU launches nothing;
* ``comm``: the compute clock's CUDA events around a timed communication, read a step later
  with no host synchronisation, against the same op timed synchronised / not measured;
* ``bench``: ``bench/bench_pack.py``'s pack/copy bandwidth ratio (target >= 0.85) / its
  plumbing on CPU, reported as not measured;
* ``malleus``: a 1-rank ``MalleusEngine`` in bf16 over NCCL: finite loss, peak memory against
  the planner's memory model (``malleus_ds/adaptive/replan.py`` memory_model, ``malleus_ds/cost.py``
  stage_memory_terms), step time against a plain torch bf16 loop, and that engine start-up
  called ``warm_up`` / the same over gloo on CPU with the GPU numbers not measured;
* ``multi`` (>= 2 GPUs, one rank each): the 3-stage plan (>= 3 GPUs), TP=2 with a slowed rank,
  a plan switch's peak memory / on one GPU ``skipped: 1 GPU``; in the dry run not measured,
  or with ``--multi-cpu-ranks 3`` the same worker on 3 gloo CPU ranks (~1.5 min on 2 cores);
* ``trainer``: the stock Hugging Face ``Trainer`` and ``malleus_ds.hf.MalleusTrainer`` on one GPU
  under ZeRO-3 in bf16, the same model, data and arguments: equal logged losses, and the step
  time ratio (target <= 1.05) / the losses in fp32 over gloo, the time not measured.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NO_GPU = "not measured (no GPU)"
SECTIONS = {
    "triton": "1. Triton pack/unpack against the torch twin",
    "big": "2. A window over 2^31 elements",
    "compile": "3. First-call compile and the start-up warm-up",
    "bench": "4. Pack bandwidth (bench/bench_pack.py)",
    "malleus": "5. 1-rank engine=malleus, bf16",
    "multi": "6. Several GPUs",
    "comm": "7. Communication timed by CUDA events (link rates)",
    "trainer": "8. 1-GPU Hugging Face Trainer: MalleusTrainer against the stock one, ZeRO-3",
}
# seconds each part may take (GPU run; the dry run's are the same, its sizes small)
TIMEOUTS = {"triton": 90, "big": 60, "compile": 60, "bench": 60, "malleus": 120, "multi": 120,
            "comm": 60, "trainer": 120}


def row(section: str, what: str, number, unit: str, target: str, result: str) -> dict:
    return {"section": section, "what": what, "number": number, "unit": unit, "target": target,
            "result": result}


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# ------------------------------------------------------------------------------------ parts


def part_triton(gpu: bool) -> list[dict]:
    import torch
    import malleus_ds_kernels.pack as P
    dev = "cuda" if gpu else "cpu"
    if not gpu and not P._INTERPRETED:
        raise RuntimeError("the dry run needs TRITON_INTERPRET=1 (set by the parent)")
    rows = []
    R, C = (1024, 4096) if gpu else (16, 128)
    gen = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        w_row = torch.randn(R, C, device=dev, generator=gen).to(dtype)       # row-parallel
        w_col = torch.randn(C, R, device=dev, generator=gen).to(dtype)       # column-parallel
        flat = torch.randn(R * C + 7, device=dev, generator=gen).to(dtype)   # a ZeRO buffer
        ts = [w_row, w_col, flat]
        q = C // 8
        layouts = {
            "aligned": [(0, w_row.narrow(1, q * k, q)) for k in range(4)]
            + [(1, w_col.narrow(0, q * k, q)) for k in range(4)]
            + [(2, flat[q * R * k:q * R * (k + 1)]) for k in range(4)],
            "unaligned": [(0, w_row.narrow(1, q * k + 1, q - 1)) for k in range(4)]
            + [(1, w_col.narrow(0, q * k, q).view(-1)[3:-2]) for k in range(4)]
            + [(2, flat[q * R * k + 1:q * R * (k + 1)]) for k in range(4)],
            "transposed": [(0, w_row.narrow(0, 4 * k, 4).narrow(1, q * k, q).t())
                           for k in range(4)] + [(1, w_col.narrow(0, 3, 5).t())],
        }
        for name, views in layouts.items():
            wins = [P.window_of(k, ts[k], v) for k, v in views]
            want = torch.cat([v.reshape(-1) for _, v in views])
            got = P.pack_triton(ts, wins)
            twin = P.pack_torch(ts, wins)
            bad = int((got.view(P._BITS[got.element_size()])
                       != twin.view(P._BITS[got.element_size()])).sum())
            bad += int(not torch.equal(twin, want))
            # unpack into zeros (disjoint windows only: the transposed blocks are disjoint too)
            a = [torch.zeros_like(t) for t in ts]
            b = [torch.zeros_like(t) for t in ts]
            P.unpack_triton(got, a, wins)
            P.unpack_torch(twin, b, wins)
            bad += sum(int((x != y).sum()) for x, y in zip(a, b))
            rows.append(row("triton", f"{str(dtype)[6:]} {name}: pack + unpack, elements that "
                            f"differ from the torch twin ({want.numel()} packed)", bad,
                            "elements", "0 (bit-exact)", verdict(bad == 0)))
    return rows


def part_big(gpu: bool) -> list[dict]:
    import torch
    import malleus_ds_kernels.pack as P
    what = "pack + unpack of one window over 2^31 elements (bf16), elements that differ"
    if gpu:
        cols, rows_, block = 2048, 2 ** 21 + 8, 1024     # a column block of 2^31 + 8192 elements
    else:
        cols, rows_, block = 64, 8, 32                    # the same code, small (interpreter)
    n = rows_ * block
    need = (rows_ * cols + 5 * n) * 2
    if gpu:
        free, _ = torch.cuda.mem_get_info()
        if free < need:
            return [row("big", what, "—", "elements", "0", f"skipped: needs "
                        f"{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free")]
    dev = "cuda" if gpu else "cpu"
    # random bits, compared as int16 (a bf16 NaN pattern must compare equal to itself)
    bits = torch.randint(-2**15, 2**15, (rows_, cols), dtype=torch.int16, device=dev)
    w = bits.view(torch.bfloat16)
    view = w.narrow(1, cols - block, block)              # the last elements: offsets > 2^31
    want = bits.narrow(1, cols - block, block).reshape(-1)
    win = [P.window_of(0, w, view)]
    got = P.pack_triton([w], win)
    bad = int((got.view(torch.int16) != want).sum())
    P.unpack_triton(got.flip(0), [w], win)               # write back reversed, then compare
    bad += int((bits.narrow(1, cols - block, block).reshape(-1) != want.flip(0)).sum())
    del got
    if gpu:
        torch.cuda.synchronize()
        return [row("big", what + f" ({n} elements)", bad, "elements", "0", verdict(bad == 0))]
    if bad:
        raise AssertionError(f"the big-window code differs on {bad} elements at small size")
    return [row("big", what, "—", "elements", "0", NO_GPU)]


def _compiled_variants(fn) -> int | None:
    caches = getattr(fn, "device_caches", None)          # triton >= 3.1
    return None if caches is None else sum(len(c[0]) for c in caches.values())


def part_compile(gpu: bool) -> list[dict]:
    import torch
    import malleus_ds_kernels.pack as P
    if not gpu:
        n = P.warm_up("cpu", [torch.bfloat16, torch.float32])
        return [row("compile", "first pack call in a fresh Triton cache (compile)", "—", "ms",
                    "< 30000", NO_GPU),
                row("compile", "warm_up(cuda, [fp32, fp16])", "—", "ms", "< 30000", NO_GPU),
                row("compile", "kernel compiles in the first fp32 pack + unpack after warm_up",
                    "—", "compiles", "0", NO_GPU),
                row("compile", "first call after warm_up / steady-state call", "—", "x", "<= 10",
                    NO_GPU),
                row("compile", "warm_up on CPU: launches (a no-op there)", n, "launches", "0",
                    verdict(n == 0))]
    dev = "cuda"
    x = torch.randn(4096, 512, device=dev)
    torch.cuda.synchronize()
    xb = x.to(torch.bfloat16)
    wb = [P.window_of(0, xb, xb.narrow(1, 128, 256))]
    t0 = time.perf_counter()
    P.pack([xb], wb)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    P.warm_up(dev, [torch.float32, torch.float16])
    warm_ms = (time.perf_counter() - t0) * 1e3
    before = _compiled_variants(P._window_copy_kernel)
    # migration-shaped: 300 windows (TP column blocks and ZeRO ranges) of fp32
    f = torch.randn(300 * 1000, device=dev)
    views = [x.narrow(1, 8 * (k % 64), 8) for k in range(150)]
    ts = [x, f]
    wins = [P.window_of(0, x, v) for v in views] + \
        [P.window_of(1, f, f[1000 * k:1000 * k + 999]) for k in range(150)]
    out = torch.empty(sum(w.numel for w in wins), device=dev)
    torch.cuda.synchronize()

    def call() -> float:
        t = time.perf_counter()
        P.pack(ts, wins, out)
        P.unpack(out, ts, wins)
        torch.cuda.synchronize()
        return time.perf_counter() - t
    first = call()
    steady = statistics.median(call() for _ in range(20))
    after = _compiled_variants(P._window_copy_kernel)
    new = None if before is None else after - before
    ratio = first / steady
    return [row("compile", "first pack call in a fresh Triton cache (bf16; compile)",
                round(first_ms, 1), "ms", "< 30000", verdict(first_ms < 30000)),
            row("compile", "warm_up(cuda, [fp32, fp16]) in the same fresh cache",
                round(warm_ms, 1), "ms", "< 30000", verdict(warm_ms < 30000)),
            row("compile", "kernel compiles in the first fp32 pack + unpack after warm_up",
                "—" if new is None else new, "compiles", "0",
                "skipped: this triton has no device_caches" if new is None else verdict(new == 0)),
            row("compile", "first call after warm_up / steady-state call (300 windows)",
                round(ratio, 2), "x", "<= 10", verdict(ratio <= 10))]


def part_bench(gpu: bool) -> list[dict]:
    import torch
    sys.path.insert(0, str(ROOT / "bench"))
    import bench_pack
    rows = []
    configs = ((torch.float32, False), (torch.bfloat16, False), (torch.float32, True))
    for dtype, misalign in configs if gpu else configs[:1]:     # the dry run: plumbing only
        r = bench_pack.measure(256 if gpu else 1, 64, "cuda" if gpu else "cpu", dtype, misalign,
                               None if gpu else 1)
        what = (f"pack/copy bandwidth, {str(dtype)[6:]}, {r['n_windows']} slices"
                f"{', misaligned (informational)' if misalign else ''}")
        if not gpu:
            rows.append(row("bench", what, "—", "ratio", ">= 0.85", NO_GPU))
            continue
        ratio = r["pack_over_copy"]
        rows.append(row("bench", what + f", {r['nbytes'] / 2**20:.0f} MiB; pack "
                        f"{r['gbs']['pack']:.0f} GB/s", round(ratio, 3), "ratio",
                        "none" if misalign else ">= 0.85",
                        "PASS" if misalign else verdict(ratio >= 0.85)))
    return rows


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plan(pipes, G, mbs, L, suspended=()):
    return {"version": 1, "num_layers": L, "global_batch_size": G, "micro_batch_size": mbs,
            "pipelines": [{"micro_batches": m, "stages": [{"ranks": list(r), "layers": list(l)}
                                                          for r, l in st]} for m, st in pipes],
            "suspended": list(suspended)}


def part_malleus(gpu: bool) -> list[dict]:
    import torch
    import torch.distributed as dist
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    if gpu:
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)
    import malleus_ds
    import malleus_ds.engine.engine as E
    from malleus_ds.cost import stage_memory_terms
    from malleus_ds.models.llama import build_model, lm_loss, model_config
    from malleus_ds.plan import Plan
    from malleus_ds.adaptive.replan import memory_model
    from malleus_ds.app.loop import device_memory_mb

    calls = []
    real = E.warm_up_pack

    def spy(device, dtypes):
        calls.append(sorted(str(d)[6:] for d in dtypes))
        return real(device, dtypes)
    E.warm_up_pack = spy
    cfg = model_config("medium") if gpu else model_config("tiny", max_seq_len=16)
    G, mbs, steps = (16, 4, 6) if gpu else (4, 1, 3)
    plan = _plan([(G // mbs, [([0], (0, cfg.num_layers))])], G, mbs, cfg.num_layers)
    ds = {"zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "malleus": {"adaptive": False}}
    if gpu:
        torch.cuda.reset_peak_memory_stats()
    eng, *_ = malleus_ds.initialize(model=cfg, config=ds, plan=Plan.from_json(plan))
    losses, secs = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        losses.append(eng.train_batch())
        if gpu:
            torch.cuda.synchronize()
        secs.append(time.perf_counter() - t0)
    finite = all(math.isfinite(x) for x in losses)
    rows = [row("malleus", f"loss of {steps} steps finite ({cfg.name} model, global batch {G}, "
                f"micro-batch {mbs}, {'NCCL' if gpu else 'gloo'}); last loss",
                round(losses[-1], 4), "loss", "finite", verdict(finite)),
            row("malleus", "engine start-up called warm_up (kernels/pack.py) with the job's "
                f"dtypes {calls[0] if calls else []}", len(calls), "calls",
                "1 call, [bfloat16, float32]",
                verdict(calls == [["bfloat16", "float32"]]))]
    mem = memory_model(eng.param_table, eng.model_cfg, mbs, eng.seq_len, True,
                       device_memory_mb(eng.device, 1))
    per_layer, fixed = stage_memory_terms(mem, 1, 1, 0, 1, G // mbs)
    model_mb = cfg.num_layers * per_layer + fixed
    step = statistics.median(secs[2:])
    if not gpu:
        return rows + [
            row("malleus", f"peak memory / the planner's memory model ({model_mb:.0f} MB)", "—",
                "ratio", "<= 1.0", NO_GPU),
            row("malleus", "step time / a plain torch bf16 loop", "—", "ratio", "<= 1.5",
                NO_GPU)]
    peak_mb = torch.cuda.max_memory_allocated() / 2**20
    # the same model and batches in a plain torch bf16 loop (no fp32 masters): a sanity bound
    ref = build_model(cfg, 0).to("cuda", torch.bfloat16)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-4)
    ref_secs = []
    for s in range(steps):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for ids in eng.my_micro_batches(s):
            x, y = (t.to("cuda") for t in eng.data.batch(ids))
            (lm_loss(ref(x), y) * (mbs / G)).backward()
        opt.step()
        torch.cuda.synchronize()
        ref_secs.append(time.perf_counter() - t0)
    ref_step = statistics.median(ref_secs[2:])
    return rows + [
        row("malleus", f"peak memory {peak_mb:.0f} MB / the planner's memory model "
            f"({model_mb:.0f} MB)", round(peak_mb / model_mb, 3), "ratio", "<= 1.0",
            verdict(peak_mb <= model_mb)),
        row("malleus", f"step time {step * 1e3:.1f} ms / a plain torch bf16 loop "
            f"({ref_step * 1e3:.1f} ms)", round(step / ref_step, 3), "ratio", "<= 1.5",
            verdict(step / ref_step <= 1.5))]


def _multi_worker(rank: int, world: int, gpu: bool, port: int, q) -> None:
    """One rank of the multi part: three scenarios in turn, results to ``q`` from rank 0."""
    try:
        import torch
        import torch.distributed as dist
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        if gpu:
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
        dist.init_process_group("nccl" if gpu else "gloo", rank=rank, world_size=world)
        import malleus_ds
        from malleus_ds.models.llama import model_config
        from malleus_ds.plan import Plan
        from malleus_ds.app.reference import OptimConfig, reference_run

        cfg = model_config("tiny", max_seq_len=16)
        steps = 4
        # Adam's eps 1e-5 as in tests/cases.py: fp32 re-ordering noise is
        # not amplified by lr/eps, so 1e-4 checks the engine's math
        ref, _ = reference_run(cfg, seed=0, steps=steps, global_batch_size=8,
                               micro_batch_size=1, optim=OptimConfig(lr=1e-3, eps=1e-5))
        rest = list(range(3, world))

        def ds(extra=None):
            return {"zero_optimization": {"stage": 1}, "gradient_clipping": 0.0,
                    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "eps": 1e-5}},
                    "malleus": {"adaptive": False, **(extra or {})}}

        def err(losses):
            return max(abs(a - b) / abs(b) for a, b in zip(losses, ref))
        rows = []
        if world >= 3:
            p3 = _plan([(8, [([0], (0, 1)), ([1], (1, 3)), ([2], (3, 4))])], 8, 1, 4, rest)
            eng, *_ = malleus_ds.initialize(model=cfg, config=ds(), plan=Plan.from_json(p3))
            e = err([eng.train_batch() for _ in range(steps)])
            rows.append(("3-stage plan: loss vs the one-process reference, max rel error", e,
                         "<= 1e-4", e <= 1e-4))
        else:
            rows.append(("3-stage plan", None, "<= 1e-4", f"skipped: {world} GPUs (needs 3)"))
        tp2 = _plan([(8, [([0, 1], (0, 4))])], 8, 1, 4, list(range(2, world)))
        strag = {"straggler": [{"rank": 1, "rate": 3.0}]}
        eng, *_ = malleus_ds.initialize(model=cfg, config=ds(strag), plan=Plan.from_json(tp2))
        e = err([eng.train_batch() for _ in range(steps)])
        rows.append(("TP=2, rank 1 slowed 3x: loss vs the reference, max rel error", e,
                     "<= 1e-4", e <= 1e-4))
        dp2 = _plan([(4, [([0], (0, 4))]), (4, [([1], (0, 4))])], 8, 1, 4,
                    list(range(2, world)))
        eng, *_ = malleus_ds.initialize(model=cfg, config=ds(), plan=Plan.from_json(dp2))
        losses = [eng.train_batch()]
        if gpu:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        rep = eng.switch_plan(Plan.from_json(tp2))
        if gpu:
            extra = torch.cuda.max_memory_allocated() - base
            t = torch.tensor([float(extra)], device="cuda")
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            extra = float(t[0])
        losses += [eng.train_batch() for _ in range(steps - 1)]
        e = err(losses)
        rows.append(("DP=2 -> TP=2 switch: loss vs the reference, max rel error", e, "<= 1e-4",
                     e <= 1e-4))
        if gpu:
            r = extra / max(1, rep.peak_extra_bytes)
            rows.append((f"switch peak memory {extra / 2**20:.1f} MiB / the switch's own "
                         f"estimate ({rep.peak_extra_bytes / 2**20:.1f} MiB)", r, "<= 1.25",
                         r <= 1.25))
        else:
            rows.append(("switch peak memory / the switch's own estimate", None, "<= 1.25",
                         NO_GPU))
        if rank == 0:
            q.put(("ok", rows))
        dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - the parent reports it
        import traceback
        q.put(("error", f"rank {rank}: {traceback.format_exc()[-2000:]}"))


def part_multi(gpu: bool) -> list[dict]:
    import torch
    import torch.multiprocessing as mp
    n = torch.cuda.device_count() if gpu else int(os.environ.get("GPU_CHECK_CPU_RANKS", "0"))
    names = ["3-stage plan", "TP=2 with a slowed rank", "switch peak memory"]
    if gpu and n < 2:
        return [row("multi", w, "—", "", "needs >= 2 GPUs", f"skipped: {n} GPU") for w in names]
    if not gpu and n < 2:     # ~1.5 min on 2 cores: only with --multi-cpu-ranks N
        return [row("multi", w, "—", "", "needs >= 2 GPUs", NO_GPU) for w in names]
    n = min(n, 4)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_multi_worker, args=(r, n, gpu, port, q), daemon=True)
             for r in range(n)]
    for p in procs:
        p.start()
    status, payload = q.get(timeout=TIMEOUTS["multi"] - 10)
    for p in procs:
        p.join(timeout=10)
    if status != "ok":
        raise RuntimeError(payload)
    out = []
    for what, num, target, res in payload:
        if isinstance(res, bool):
            res = verdict(res)
        out.append(row("multi", what, "—" if num is None else float(f"{num:.3g}"), "", target,
                       res))
    return out


def part_comm(gpu: bool) -> list[dict]:
    """The compute clock's CUDA path for communication (``ComputeClock.comm``, issue 35): a
    timed op (a 512 MB device copy standing for a receive's wait) is a pair of events, the host
    never waits for it while the step runs, and its time, read at the next step's start, matches
    the same op timed with the host synchronised around it."""
    what = ("a timed op's seconds per MB read from CUDA events at the next step / the same op "
            "synchronised on the host (the least of 5 each)")
    what_sync = "host synchronisations while the ops were timed"
    if not gpu:
        return [row("comm", what, "—", "ratio", "0.8-1.25", NO_GPU),
                row("comm", what_sync, "—", "calls", "0", NO_GPU)]
    import torch
    from malleus_ds.engine.clock import ComputeClock
    from malleus_ds.engine.comm_log import CommLog

    x = torch.randn(128 * 2**20, device="cuda")             # 512 MB of fp32
    y = torch.empty_like(x)
    mb = x.numel() * 4 / 1e6
    y.copy_(x)
    torch.cuda.synchronize()
    ref = []
    for _ in range(5):
        t0 = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        ref.append((time.perf_counter() - t0) / mb)
    clock = ComputeClock(None, cuda=True)
    clock.comm_log = CommLog(lambda r: 0)
    real, calls = torch.cuda.synchronize, []
    torch.cuda.synchronize = lambda *a: (calls.append(1), real(*a))[1]
    try:
        clock.start_step(0)
        for _ in range(5):
            with clock.comm((0, 1), mb, "p2p"):
                y.copy_(x)
        synced = len(calls)
    finally:
        torch.cuda.synchronize = real
    clock.start_step(1)
    spm = clock.comm_log.values()[2]
    ratio = spm / min(ref)
    return [row("comm", what, round(ratio, 3), "ratio", "0.8-1.25",
                verdict(0.8 <= ratio <= 1.25)),
            row("comm", what_sync, synced, "calls", "0", verdict(synced == 0))]


def part_trainer(gpu: bool) -> list[dict]:
    """The stock ``transformers.Trainer`` and ``malleus_ds.hf.MalleusTrainer`` on one GPU under
    ZeRO-3 (bf16; on CPU fp32 over gloo), the same small Llama, data and arguments, in turns."""
    import torch
    from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                              TrainingArguments)

    from malleus_ds.hf import MalleusTrainer

    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    hidden, layers, seq, vocab, batch, steps = ((1024, 8, 512, 32000, 8, 8) if gpu
                                                else (32, 2, 16, 64, 4, 3))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch * steps, seq), generator=g)

    class Tokens(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    class Clock(TrainerCallback):
        def __init__(self):
            self.secs, self.losses = [], []

        def on_step_begin(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if gpu:
                torch.cuda.synchronize()
            self.secs.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses.append(logs["loss"])

    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto",
                                                    "torch_adam": True}}}
    runs = {}
    for name, cls in (("stock", Trainer), ("malleus", MalleusTrainer)):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
            num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
            num_key_value_heads=max(1, hidden // 64), max_position_embeddings=seq))
        clock = Clock()
        with tempfile.TemporaryDirectory() as out:
            args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch,
                                     max_steps=steps, logging_steps=1, learning_rate=1e-4,
                                     bf16=gpu, deepspeed=ds, save_strategy="no", report_to=[],
                                     disable_tqdm=True, use_cpu=not gpu, seed=0)
            cls(model=model, args=args, train_dataset=Tokens(), callbacks=[clock]).train()
        runs[name] = clock
    diff = max(abs(a - b) / abs(b) for a, b in zip(runs["malleus"].losses,
                                                    runs["stock"].losses))
    tol = 1e-3 if gpu else 1e-5
    rows = [row("trainer", f"MalleusTrainer's logged losses / the stock Trainer's, "
                f"{steps} steps ({'bf16' if gpu else 'fp32'}, ZeRO-3, Llama {layers} layers x "
                f"{hidden}): largest relative difference", f"{diff:.2e}", "relative",
                f"<= {tol:g}", verdict(len(runs["stock"].losses) == steps and diff <= tol))]
    if not gpu:
        return rows + [row("trainer", "step time MalleusTrainer / the stock Trainer", "—",
                           "ratio", "<= 1.05", NO_GPU)]
    ours, stock = (statistics.median(runs[k].secs[2:]) for k in ("malleus", "stock"))
    return rows + [row("trainer", f"step time MalleusTrainer {ours * 1e3:.0f} ms / the stock "
                       f"Trainer {stock * 1e3:.0f} ms", round(ours / stock, 3), "ratio",
                       "<= 1.05", verdict(ours / stock <= 1.05))]


PARTS = {"triton": part_triton, "big": part_big, "compile": part_compile, "bench": part_bench,
         "malleus": part_malleus, "multi": part_multi, "comm": part_comm,
         "trainer": part_trainer}


# ---------------------------------------------------------------------------------- driver


def run_part(name: str, dry: bool, limit: float) -> list[dict]:
    """``name`` in a subprocess under ``limit`` seconds; on failure one FAIL row with the
    reason."""
    if limit < 5:
        return [row(name, f"part '{name}' not run", "—", "s", "within --budget-s",
                    "FAIL (no time left in the budget)")]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if dry:
        env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        if name in ("triton", "big"):
            env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as cache:
        if name == "compile":
            env["TRITON_CACHE_DIR"] = cache          # a cold cache: the compile is measured
        cmd = [sys.executable, __file__, "--part", name] + (["--cpu-dry-run"] if dry else [])
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                               timeout=limit)
        except subprocess.TimeoutExpired:
            return [row(name, f"part '{name}' did not finish", "—", "s",
                        f"<= {limit:.0f}", f"FAIL (timed out after {limit:.0f} s)")]
    secs = time.perf_counter() - t0
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("ROWS ")]
    if p.returncode != 0 or not lines:
        tail = (p.stderr.strip().splitlines() or p.stdout.strip().splitlines() or ["?"])
        why = " / ".join(x.strip() for x in tail[-3:])[:400].replace("|", "/")
        return [row(name, f"part '{name}' failed (exit {p.returncode})", "—", "", "runs",
                    f"FAIL: {why}")]
    sys.stderr.write(f"[gpu_check] {name}: {secs:.1f} s\n")
    return json.loads(lines[-1][5:])


def report(rows: list[dict], header: str) -> str:
    out = [header, ""]
    for key, title in SECTIONS.items():
        out += [f"### {title}", "", "| what | number | unit | target | result |",
                "| --- | ---: | --- | --- | --- |"]
        for r in (r for r in rows if r["section"] == key):
            out.append(f"| {r['what']} | {r['number']} | {r['unit']} | {r['target']} | "
                       f"{r['result']} |")
        out.append("")
    res = [r["result"] for r in rows]
    n_pass = sum(x == "PASS" for x in res)
    n_fail = sum(x.startswith("FAIL") for x in res)
    n_nm = sum(x == NO_GPU for x in res)
    n_skip = sum(x.startswith("skipped") for x in res)
    out.append(f"**Summary: {n_pass} PASS, {n_fail} FAIL, {n_nm} not measured, "
               f"{n_skip} skipped**")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="run what can run on CPU, small sizes; GPU numbers say not measured")
    ap.add_argument("--part", choices=sorted(PARTS), help=argparse.SUPPRESS)
    ap.add_argument("--only", default="", help="comma-separated parts (default: all)")
    ap.add_argument("--budget-s", type=float, default=480,
                    help="seconds for all parts together (each also has its own timeout)")
    ap.add_argument("--multi-cpu-ranks", type=int, default=0,
                    help="dry run: run the multi part on this many gloo CPU ranks (2..4)")
    args = ap.parse_args(argv)
    dry = args.cpu_dry_run
    if args.multi_cpu_ranks:
        if not dry or not 2 <= args.multi_cpu_ranks <= 4:
            ap.error(f"--multi-cpu-ranks={args.multi_cpu_ranks}: needs --cpu-dry-run and 2..4")
        os.environ["GPU_CHECK_CPU_RANKS"] = str(args.multi_cpu_ranks)
    if args.part:                                   # child: one part, one ROWS line
        import torch
        if not dry and not torch.cuda.is_available():
            raise SystemExit("gpu_check: no CUDA device (use --cpu-dry-run without a GPU)")
        print("ROWS " + json.dumps(PARTS[args.part](not dry)), flush=True)
        return 0
    import torch
    if not dry and not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}, CUDA build {torch.version.cuda}); on a machine "
              "without a GPU run --cpu-dry-run", file=sys.stderr)
        return 2
    only = [p for p in args.only.split(",") if p] or list(PARTS)
    bad = sorted(set(only) - set(PARTS))
    if bad:
        ap.error(f"--only: unknown parts {bad}; choose from {sorted(PARTS)}")
    import triton
    dev = torch.cuda.get_device_name(0) if not dry else "CPU (dry run)"
    header = (f"## GPU check: {dev}, {'' if dry else f'{torch.cuda.device_count()} GPU(s), '}"
              f"torch {torch.__version__}, triton {triton.__version__}, "
              f"{time.strftime('%Y-%m-%d')}\n\n"
              f"Mode: {'CPU dry run (--cpu-dry-run)' if dry else 'GPU'}; "
              f"produced by `bash scripts/gpu_check.sh` (scripts/gpu_check.py).")
    rows = []
    deadline = time.monotonic() + args.budget_s
    for name in only:
        rows += run_part(name, dry, min(TIMEOUTS[name], deadline - time.monotonic()))
    text = report(rows, header)
    print(text, end="")
    return 1 if any(r["result"].startswith("FAIL") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
