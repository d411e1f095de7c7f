"""The TP slowdown measured on the job's own device, not assumed (DESIGN.md §6).

A rank in a TP group of ``g`` GPUs computes ``1/g`` of each layer. Cost units
(``work.cost_units``) and the planner's stage times count that work as
``tp_slowdown[tp // g]`` layers of a full nominal-TP group: ideal scaling says ``tp/g``, but a
narrow shard runs its matmuls at a different efficiency than a wide one (a GPU is under-filled
by a thin shard; a CPU cache holds a small one), so an ideal table makes a rank moved to a
smaller TP group read slow or fast by the error, and the planner mis-prices such groups.

At start-up every rank times one decoder layer's forward + backward on one micro-batch, sharded
as TP rank 0 of ``g`` for every group size ``g`` dividing the nominal ``tp`` (local compute only:
no hooks, no collective). Sizes are interleaved over ``repeats`` rounds and the fastest reading
per size is kept (noise only adds time). :func:`slowdown_table` turns the times into the table;
:func:`measure` takes every rank's times and uses their per-size median, so all ranks hold the
same table (rates and the planner must agree) and one slow rank does not skew it.

torch only (no deepspeed, no config): the engine passes the model config, device and dtype.
"""
from __future__ import annotations

import time
import warnings
from typing import Callable, Mapping

import torch
from torch import nn

from .tensor_parallel import _shard_linear

#: timed rounds per group size (each runs all sizes once); the fastest reading is kept
REPEATS = 3


def group_sizes(tp: int) -> list[int]:
    """Every TP group size a plan with nominal ``tp`` may use: the divisors of ``tp``."""
    return [g for g in range(1, tp + 1) if tp % g == 0]


def slowdown_table(times: Mapping[int, float], tp: int) -> dict[int, float]:
    """``{tp/g: t(g) / t(tp)}`` from per-group-size seconds ``times`` (a ``g`` missing from
    ``times`` gets the ideal ``tp/g``). Kept physical: key 1 is 1.0, and a larger key (a wider
    shard of the same layer) never costs less than a smaller one, nor less than 1.0. Raises
    ``ValueError`` for a non-positive or non-finite time."""
    for g, t in times.items():
        if not (t > 0 and t < float("inf")):
            raise ValueError(f"tp_cost: time for TP group size {g} is {t!r}; expected seconds > 0")
    base = times.get(tp)
    out: dict[int, float] = {}
    prev = 1.0
    for g in sorted(group_sizes(tp), reverse=True):          # key tp/g ascending: 1, 2, 4, ...
        k = tp // g
        v = times[g] / base if (base and g in times) else float(k)
        prev = max(prev, v) if k > 1 else 1.0
        out[k] = prev
    return out


def _sharded_layer(model_cfg, g: int, device, dtype) -> nn.Module:
    """Layer 0 (fixed seed, caller's RNG untouched), sharded as TP rank 0 of ``g``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        blk = model_cfg.build_layer(0, 0)
    if g > 1:
        for name, sub in blk.named_modules():
            if isinstance(sub, nn.Linear):
                _shard_linear(sub, model_cfg.tp_plan, name, 0, g)
    return blk.to(device=device, dtype=dtype)


def time_shards(model_cfg, sizes, micro_batch_size: int, seq_len: int, device, dtype,
                repeats: int = REPEATS,
                timer: Callable[[], float] = time.perf_counter) -> dict[int, float]:
    """Seconds of one layer's forward + backward on one micro-batch for each TP group size in
    ``sizes`` (the fastest of ``repeats`` interleaved rounds, after one untimed warm-up each).
    A size the model cannot be split by (``check_tp``) is left out."""
    dev = torch.device(device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    blocks = {}
    for g in sizes:
        try:
            model_cfg.check_tp(g)
        except Exception:       # noqa: BLE001 - a size this model cannot use is not timed
            continue
        blocks[g] = _sharded_layer(model_cfg, g, dev, dtype)
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(0)
        x0 = torch.randn(micro_batch_size, seq_len, model_cfg.hidden_size, device=dev, dtype=dtype)

    def run(blk):
        x = x0.detach().requires_grad_()
        model_cfg.run_block(blk, x, model_cfg.block_context(x)).float().sum().backward()

    for g in list(blocks):
        try:
            run(blocks[g])                         # warm-up: allocation, kernel selection
        except Exception as e:  # noqa: BLE001 - the engine still runs; this size gets tp/g
            warnings.warn(f"tp_cost: timing a layer sharded {g} ways failed ({e}); the TP "
                          f"slowdown for group size {g} stays ideal", RuntimeWarning)
            del blocks[g]
    sync()
    best = {g: float("inf") for g in blocks}
    for _ in range(repeats):
        for g, blk in blocks.items():
            t0 = timer()
            run(blk)
            sync()
            best[g] = min(best[g], timer() - t0)
    return best


def measure(model_cfg, tp: int, micro_batch_size: int, seq_len: int, device, dtype,
            group=None, repeats: int = REPEATS) -> dict[int, float]:
    """Every rank: time the shards (:func:`time_shards`), all-gather the times over ``group``
    (default: the world), and return :func:`slowdown_table` of the per-size median. A
    collective: call it on every rank, in the same order relative to other collectives."""
    import torch.distributed as dist

    sizes = group_sizes(tp)
    if tp == 1:
        return {1: 1.0}
    mine = time_shards(model_cfg, sizes, micro_batch_size, seq_len, device, dtype, repeats)
    vec = torch.tensor([mine.get(g, 0.0) for g in sizes], dtype=torch.float64, device=device)
    if dist.is_available() and dist.is_initialized():
        n = dist.get_world_size(group)
        out = torch.zeros(n * len(sizes), dtype=torch.float64, device=device)
        dist.all_gather_into_tensor(out, vec, group=group)
        rows = out.view(n, len(sizes)).cpu()
    else:
        rows = vec.view(1, -1).cpu()
    med = rows.median(dim=0).values.tolist()
    return slowdown_table({g: t for g, t in zip(sizes, med) if t > 0}, tp)
