"""This rank's compute clock: times forward/backward with communication left out, and applies
the straggler emulation (``emulation.py``) after each timed piece.

The engine's measured rates (``straggler.py``) and the per-rank ``compute_s`` of metrics.jsonl
come from here. A runner passes its own clock to the engine (``set_compute_clock``); an engine
used on its own keeps one built from ``ds_config.malleus.straggler``.
"""
from __future__ import annotations

import time
from contextlib import contextmanager

from .emulation import Straggler
from .watchdog import HEARTBEAT, phase


class ComputeClock:
    """Times this rank's compute and applies the straggler emulation after each timed piece.

    ``compute_s`` (per step) includes the emulated sleep, as a slow GPU would show it;
    ``emulated_s`` is the sleep alone. Communication that happens *inside* a timed span
    (e.g. DeepSpeed reducing gradients in backward hooks) is left out: wrap it in
    :meth:`excluded` (``runners/common.py:exclude_calls``), so a healthy rank waiting for a slow peer
    does not look slow itself."""

    def __init__(self, straggler: Straggler | None = None, cuda: bool = False) -> None:
        self.straggler = straggler
        self.cuda = cuda
        self.step = 0
        self.compute_s = 0.0
        self.emulated_s = 0.0
        self._excluded = 0.0
        self._ex_depth = 0

    def start_step(self, step: int) -> None:
        self.step, self.compute_s, self.emulated_s = step, 0.0, 0.0
        HEARTBEAT.beat("step start", step)

    @contextmanager
    def compute(self):
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        t0, ex0 = time.perf_counter(), self._excluded
        with phase("forward/backward"):
            yield
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        self.add(max(0.0, time.perf_counter() - t0 - (self._excluded - ex0)))

    @contextmanager
    def excluded(self):
        """Time spent in here does not count as compute (re-entrant: outermost span counts)."""
        self._ex_depth += 1
        t0 = time.perf_counter()
        try:
            with phase("communication"):
                yield
        finally:
            self._ex_depth -= 1
            if self._ex_depth == 0:
                self._excluded += time.perf_counter() - t0

    def add(self, seconds: float) -> None:
        """Account ``seconds`` of measured compute, then emulate (sleep) if slowed."""
        slept = self.straggler.after_compute(self.step, seconds) if self.straggler else 0.0
        self.compute_s += seconds + slept
        self.emulated_s += slept
