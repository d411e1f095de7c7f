"""Logs that stream while a run trains (rank 0), for output that is not a terminal.

- **Progress lines.** When rank 0's stdout is not a terminal (nohup, SLURM, CI, a pipe), one line
  every ``log_every`` steps and on the run's last step goes to stdout, flushed::

      [malleus_ds] step 20/100 loss 5.8123 | 41.2 samples/s | step 0.194 s | slowest rank 3 (compute 0.151 s)

  ``step 20/100``: optimizer steps done / ``train.steps``; ``loss``: that step's global-batch
  mean; samples/s, step time and the slowest rank's compute seconds are over the steps since the
  previous line (warm-up included: nothing else left out), compute seconds as in metrics.jsonl's
  ``compute_s`` (emulated slowdown included). On a terminal the tqdm bar shows progress instead
  and these lines are not printed. ``progress=false`` turns the bar off, nothing else: the lines
  are for output that is not a terminal, with or without the bar.
- **train.log.** Every line (terminal or not) also goes to the run's ``train.log``: through
  Hydra's job-log file handler(s) on the root logger (only those: not its console handler), or,
  when there is none (a run without Hydra's job logging), appended to ``<run_dir>/train.log``.
- **DeepSpeed monitor events.** Each step, a monitor enabled in the ds_config (``tensorboard``,
  ``csv_monitor``, ``wandb``, ``comet``) gets ``Train/Samples/samples_per_s``,
  ``Train/Samples/step_time_s`` and ``Train/Samples/compute_s_rank{d}`` per rank, next to the
  engine's own ``Train/Samples/train_loss``, at the same x (samples seen so far).
- **Monitor packages.** :func:`check_monitor_packages` makes a monitor enabled in the ds_config
  whose package is not installed a ConfigError at start-up (``runners.validate``), not an
  ImportError deep inside ``deepspeed.initialize`` on every rank.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from ..run_config import ConfigError, RunConfig

PREFIX = "[malleus_ds]"

#: ds_config monitor section -> (module DeepSpeed imports for it, what to ``pip install``).
#: ``csv_monitor`` needs nothing beyond the standard library.
MONITOR_PACKAGES: dict[str, tuple[str, str]] = {
    "tensorboard": ("tensorboard", "tensorboard"),
    "wandb": ("wandb", "wandb"),
    "comet": ("comet_ml", '"comet_ml>=3.41.0"'),
}

#: engines that build a DeepSpeed monitor from the ds_config (engine=torch ignores it)
MONITOR_ENGINES = ("deepspeed", "malleus")


def _enabled(v: Any) -> bool:
    return v is True or (isinstance(v, str) and v.strip().lower() == "true")


def check_monitor_packages(cfg: RunConfig,
                           find_spec: Callable[[str], Any] | None = None) -> None:
    """Raise ConfigError naming the pip package when a monitor enabled in the ds_config needs a
    package that is not installed (looked up with ``find_spec``, by default
    ``importlib.util.find_spec``: nothing is imported)."""
    if cfg.engine not in MONITOR_ENGINES:
        return
    find_spec = find_spec or importlib.util.find_spec
    ds = cfg.deepspeed.config or {}
    for section, (module, pip) in MONITOR_PACKAGES.items():
        m = ds.get(section)
        if not (isinstance(m, dict) and _enabled(m.get("enabled"))):
            continue
        try:
            found = find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"ds_config {section}.enabled=true needs the {module!r} package: "
                              f"pip install {pip} (or set {section}.enabled=false)")


def should_log(done: int, total: int, every: int) -> bool:
    """A progress line after ``done`` steps: every ``every`` steps and at the last one."""
    return done == total or (every > 0 and done % every == 0)


def format_progress(done: int, total: int, loss: float, samples_per_s: float, step_s: float,
                    slowest_rank: int, slowest_compute_s: float) -> str:
    return (f"{PREFIX} step {done}/{total} loss {loss:.4f} | {samples_per_s:.1f} samples/s | "
            f"step {step_s:.3f} s | slowest rank {slowest_rank} (compute {slowest_compute_s:.3f} s)")


def monitor_events(step: int, samples: int, step_time_s: float,
                   compute_s: Sequence[float]) -> list[tuple[str, float, int]]:
    """DeepSpeed ``MonitorMaster.write_events`` tuples for step ``step`` (0-based) of ``samples``
    samples; x = samples seen after it, as the engines use for ``Train/Samples/train_loss``."""
    x = (step + 1) * samples
    ev = [("Train/Samples/samples_per_s", samples / step_time_s if step_time_s > 0 else 0.0, x),
          ("Train/Samples/step_time_s", float(step_time_s), x)]
    ev += [(f"Train/Samples/compute_s_rank{d}", float(c), x) for d, c in enumerate(compute_s)]
    return ev


class TrainLog:
    """Writes lines to the run's train.log: Hydra's file handler(s) on the root logger, else
    (no Hydra job log) appended to ``<run_dir>/train.log``; nowhere without a run folder."""

    NAME = "malleus_ds.progress"

    def __init__(self, run_dir: str | None) -> None:
        self.handlers = [h for h in logging.getLogger().handlers
                         if isinstance(h, logging.FileHandler)]
        self.path = (os.path.join(run_dir, "train.log")
                     if run_dir and not self.handlers else None)

    def write(self, line: str) -> None:
        if self.handlers:
            rec = logging.LogRecord(self.NAME, logging.INFO, __file__, 0, line, None, None)
            for h in self.handlers:
                if rec.levelno >= h.level:
                    h.handle(rec)
                    h.flush()
        elif self.path:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")


class StepStream:
    """Rank 0's streamed output for one run: progress lines, train.log, monitor events.

    ``StepReporter`` makes one on rank 0 and calls :meth:`step` after each step with the
    all-gathered per-rank compute seconds."""

    def __init__(self, cfg: RunConfig, monitor=None,
                 stdout: TextIO | None = None, tty: bool | None = None,
                 train_log: TrainLog | None = None) -> None:
        self.total, self.every = cfg.train.steps, cfg.log_every
        self.samples = cfg.train.global_batch_size
        self.stdout = stdout or sys.stdout
        self.tty = _isatty(self.stdout) if tty is None else tty
        self.log = train_log if train_log is not None else TrainLog(cfg.run_dir)
        self.monitor = monitor if getattr(monitor, "enabled", False) else None
        self._times: list[float] = []
        self._compute: list[float] = []
        self.lines: list[str] = []           # every progress line made (tests, callers)

    def startup(self, seconds: float, first_step: int, model=None) -> str:
        """The start-up line (:func:`format_startup`): stdout and train.log."""
        line = format_startup(seconds, first_step, self.total, model)
        print(line, file=self.stdout, flush=True)
        self.log.write(line)
        return line

    def step(self, step: int, loss: float, step_time_s: float,
             compute_s: Sequence[float]) -> str | None:
        """After step ``step`` (0-based): monitor events each step; a progress line on
        :func:`should_log` steps (returned; printed to stdout unless it is a terminal)."""
        if self.monitor is not None:
            self.monitor.write_events(monitor_events(step, self.samples, step_time_s, compute_s))
        self._times.append(float(step_time_s))
        if len(self._compute) < len(compute_s):
            self._compute += [0.0] * (len(compute_s) - len(self._compute))
        for d, c in enumerate(compute_s):
            self._compute[d] += float(c)
        if not should_log(step + 1, self.total, self.every):
            return None
        n, t = len(self._times), sum(self._times)
        mean_c = [c / n for c in self._compute] or [0.0]
        slow = max(range(len(mean_c)), key=mean_c.__getitem__)
        line = format_progress(step + 1, self.total, float(loss),
                               self.samples * n / t if t > 0 else 0.0, t / n, slow, mean_c[slow])
        self._times, self._compute = [], []
        self.lines.append(line)
        if not self.tty:
            print(line, file=self.stdout, flush=True)
        self.log.write(line)
        return line


def format_startup(seconds: float, first_step: int, total: int, model=None) -> str:
    """The line rank 0 prints once the engine is built, before the first step: start-up seconds
    (process group, model build or load, engine set-up, checkpoint), and what rank 0 read of a
    local model folder (``HFModel.load_stats``)."""
    line = f"[malleus_ds] ready after {seconds:.1f} s; training steps {first_step + 1}-{total}"
    st = getattr(model, "load_stats", None)
    if st and st.get("tensors"):
        line += (f"; rank 0 read {st['tensors']} tensors ({st['bytes'] / 2 ** 20:.1f} MiB) "
                 f"from {len(st['files'])} of {st['of_files']} weight file(s) in "
                 f"{st['seconds']:.1f} s")
    return line


def _isatty(f) -> bool:
    try:
        return bool(f.isatty())
    except (AttributeError, ValueError):
        return False
