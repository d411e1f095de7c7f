"""A run's guards: the hung-rank watchdog (``malleus_ds/watchdog.py``) and clean stops on
SIGTERM / SIGINT.

Signals: the first SIGTERM or SIGINT a rank receives only raises a flag (:data:`STOP`). The flag
rides in the per-step all-gather every runner already does (``StepReporter.step_done``), so all
ranks agree on the same step boundary; there, with ``checkpoint.dir`` set, they save a
checkpoint (what SLURM and Kubernetes expect after SIGTERM), metrics.jsonl is flushed and
closed, and :class:`Stopped` unwinds the run: the app prints one line and exits with 128 + the
signal number. A second signal acts at once (SIGINT: KeyboardInterrupt; SIGTERM: exit).
"""
from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from ..metrics import METRICS_FILE
from ..watchdog import Watchdog, watchdog_store


class Stopped(Exception):
    """Every rank stopped at the same step boundary after a signal."""

    def __init__(self, signum: int, step: int, checkpoint: str | None = None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = f"; checkpoint {checkpoint}" if checkpoint else ""
        super().__init__(f"stopped by {name} after step {step}{where}; metrics.jsonl is "
                         f"complete up to there")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StopSignals:
    """SIGTERM / SIGINT -> a flag read at step boundaries (main thread only)."""

    def __init__(self) -> None:
        self.signum = 0
        self._old: dict[int, object] = {}

    def install(self) -> None:
        import threading

        self.signum = 0
        if threading.current_thread() is not threading.main_thread():
            return              # signal handlers live in the main thread (tests call from others)
        for s in (signal.SIGTERM, signal.SIGINT):
            self._old[s] = signal.signal(s, self._handle)

    def uninstall(self) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)
        self._old.clear()

    def _handle(self, signum, frame) -> None:
        if self.signum:             # the second signal: stop now
            self.uninstall()
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            sys.exit(128 + signum)
        self.signum = signum


STOP = StopSignals()


def start_watchdog(cfg, env) -> Watchdog | None:
    """The hung-rank watchdog of this rank (multi-rank runs with ``hang_timeout_s`` > 0)."""
    if env.world_size < 2 or not cfg.hang_timeout_s:
        return None
    store = watchdog_store(timeout_s=min(30.0, max(5.0, cfg.hang_timeout_s / 2)))
    if store is None:
        return None
    metrics = Path(cfg.run_dir) / METRICS_FILE if (env.is_rank0 and cfg.run_dir) else None

    def log(report: dict) -> None:
        if metrics is not None:     # the main thread is blocked: nothing else writes now
            with open(metrics, "a") as f:
                f.write(json.dumps(report) + "\n")

    prefix = f"malleus_wd/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return Watchdog(store, env.rank, env.world_size, cfg.hang_timeout_s, on_hang=log,
                    prefix=prefix).start()
