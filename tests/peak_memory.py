"""Peak tensor memory of a piece of work, measured (for tests and ``bench/bench_engine.py``).

On CUDA this is ``torch.cuda.max_memory_allocated``. On CPU torch keeps no allocator statistics,
and neither ``tracemalloc`` (Python's allocator only; tensors come from c10's) nor the process's
RSS high-water mark (glibc keeps freed heap memory resident, and the mark is the process's whole
life) measures tensors; torch's profiler with ``profile_memory=True`` records every allocation
and free of the CPU allocator with its size, and their running sum in time order is the tensor
memory held at each moment.
"""
from __future__ import annotations

from typing import Callable

import torch


def peak_tensor_mb(fn: Callable[[], object], device: str | torch.device = "cpu") -> float:
    """MB of tensor memory ``fn()`` held at its peak above what was allocated when it started
    (what it allocated and had not freed yet: activations, gradients, temporaries)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - base) / 2 ** 20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    # the allocator's events (kineto's "[memory]" records: + on allocation, - on free)
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]" and str(e.device_type()).endswith("CPU"))
    held = peak = 0
    for _, nbytes in events:
        held += nbytes
        peak = max(peak, held)
    return peak / 2 ** 20
