"""Pieces every runner shares: data assignment, compute timing + straggler emulation, the per-step
reporter (metrics.jsonl, progress bar, summary).

A runner's step loop looks like::

    clock = ComputeClock(cfg, env)            # times compute, emulates stragglers
    reporter = StepReporter(cfg, env)         # rank 0: metrics.jsonl + tqdm
    for step in range(cfg.train.steps):
        t0 = time.perf_counter(); clock.start_step(step)
        for ids in replica_micro_batches(cfg, step, dp_rank, dp):
            with clock.compute():             # forward + backward of one micro-batch
                ...
        ...optimizer step...
        reporter.step_done(step, loss, time.perf_counter() - t0, clock)
    return reporter.finish()
"""
from __future__ import annotations

import sys
import time

from ...engine.clock import ComputeClock as _ComputeClock
from ...engine.clock import exclude_calls  # noqa: F401  (the runners' name for it)
from ..run_config import RunConfig
from ...emulation.straggler import Straggler
from ...report.metrics import MetricsWriter, StepRecord, format_event, format_phases, phases
from ...plan import Plan, even_split
from ..reference import micro_batches
from ...resilience.watchdog import phase
from .base import DistEnv, RunSummary
from .stream import StepStream


def replica_micro_batches(cfg: RunConfig, step: int, replica: int, replicas: int
                          ) -> list[list[int]]:
    """Sample ids of the micro-batches replica ``replica`` (of ``replicas``) runs at ``step``.

    The static plan's rule (DESIGN.md §5): micro-batches of the global batch are dealt out in
    global order, replica ``i`` taking the next ``m_i`` of them (``m_i`` as even as possible)."""
    mbs = micro_batches(step, cfg.train.global_batch_size, cfg.train.micro_batch_size)
    b = even_split(len(mbs), replicas)
    return mbs[b[replica]:b[replica + 1]]


def monitors_to_run_dir(ds_config: dict, run_dir: str | None) -> None:
    """DeepSpeed monitors enabled without an ``output_path`` write into the run folder."""
    for mon in ("csv_monitor", "tensorboard"):
        m = ds_config.get(mon)
        if isinstance(m, dict) and m.get("enabled") and not m.get("output_path") and run_dir:
            m["output_path"] = run_dir


class ComputeClock(_ComputeClock):
    """The run's compute clock (``malleus_ds/engine/clock.py``) with this rank's straggler emulation
    from ``straggler.schedule`` and the slow links of ``straggler.link_schedule``."""

    def __init__(self, cfg: RunConfig, env: DistEnv) -> None:
        super().__init__(Straggler(cfg.straggler, env.rank), env.device.startswith("cuda"),
                         links=cfg.links)


def shown_live(ev: dict) -> bool:
    """An event the progress bar prints when it happens: a re-plan, a migration, a missed plan
    check (a kept one is only in metrics.jsonl and the summary)."""
    kind = ev.get("event")
    return kind in ("migrate", "replan") or (kind == "check" and ev.get("outcome") == "missed")


class StepReporter:
    """Every rank's clock numbers each step (from the step's all-reduce, else gathered:
    :meth:`step_done`); rank 0 writes metrics.jsonl, a tqdm bar (a terminal), progress lines
    (stdout not a terminal) + train.log and events to the DeepSpeed ``monitor`` the runner
    passes (``app/runners/stream.py``)."""

    def __init__(self, cfg: RunConfig, env: DistEnv, group=None, first_step: int = 0,
                 monitor=None) -> None:
        self.cfg, self.env, self.group = cfg, env, group
        self.first_step = first_step        # a resumed run starts at its checkpoint's step
        self.losses: list[float] = []
        self.times: list[float] = []
        self.records: list[dict] = []
        self.events: list[dict] = []
        # a resumed or restarted run continues the folder's metrics.jsonl at its first step
        keep = first_step if first_step > 0 or env.restart > 0 else None
        self.writer = MetricsWriter(cfg.run_dir if env.is_rank0 else None, keep_before=keep)
        self.stop_signal = 0                # a SIGTERM/SIGINT some rank got (guard.py)
        self.bar = None
        # rank 0: progress lines (stdout not a terminal), train.log, the ds_config's monitor
        self.stream = StepStream(cfg, monitor) if env.is_rank0 else None
        if self.stream is not None and first_step < cfg.train.steps:
            self.stream.startup(time.perf_counter() - env.started, first_step, cfg.model)
        w = self.writer
        # torchrun started this job again: after a failure (its restart count), or after a
        # node joined or left (the count stays; the job's folder already has its lines)
        if env.is_rank0 and (env.restart > 0 or (env.elastic and w.kept_lines + w.dropped_steps)):
            # torchrun_restarts: the agent's count (0: a start of the same command again, or
            # a node joining or leaving, not a failure)
            ev = {"event": "restart", "attempt": w.restarts_before + 1, "from_step": first_step,
                  "world": env.world_size, "lost_steps": w.dropped_steps,
                  "torchrun_restarts": env.restart}
            self.event(ev)
            print(f"[malleus_ds] {format_event(ev)}", flush=True)
        if env.is_rank0 and cfg.progress:
            from tqdm import tqdm
            self.bar = tqdm(total=cfg.train.steps, initial=first_step,
                            desc=f"train[{cfg.engine}]", unit="step", file=sys.stderr,
                            dynamic_ncols=True, mininterval=0.5,
                            disable=None)  # None: off when stderr is not a terminal

    def event(self, obj: dict) -> None:
        """An event line in metrics.jsonl (rank 0 writes; every rank keeps it for the summary)."""
        self.events.append(dict(obj))
        self.writer.write_event(obj)
        if self.bar is not None and shown_live(obj):
            self.bar.write(f"[malleus_ds] {format_event(obj)}")

    def note(self, obj: dict) -> None:
        """An event line in metrics.jsonl that the summary does not list (a checkpoint save)."""
        self.writer.write_event(obj)

    def step_done(self, step: int, loss: float, step_time_s: float, clock: ComputeClock,
                  plan: str | None = None, measured_rates=None, link_rates=None,
                  gpu_link_rates=None, probe_rates=None, sums=None) -> None:
        """Record step ``step`` with every rank's clock numbers (compute, emulated, wait and
        slow-link seconds) and the stop signal some rank got (``guard.STOP``; every rank reads
        the same, so all stop after the same step). ``sums``: the step's all-reduced
        :class:`~malleus_ds.steploop.StepSums` (engine=malleus: ``engine.last_sums``), which
        carry them: no collective here. Without them (the deepspeed and torch runners: no step
        all-reduce of ours), or when they are ``late`` (a rank timed more of the step after
        its all-reduce, a probe: the same on every rank), the ranks all-gather their clocks."""
        if sums is not None and not sums.late:
            comp, emu, wait, links = (x.tolist() for x in (sums.compute_s, sums.emulated_s,
                                                           sums.wait_s, sums.link_s))
            self.stop_signal = sums.stop
        else:
            comp, emu, wait, links = self._gather(clock)
        self.losses.append(float(loss))
        self.times.append(float(step_time_s))
        rates = {str(r): x for r, x in self.cfg.straggler.rates(step, self.env.world_size).items()}
        rec = StepRecord(step, float(loss), self.cfg.train.global_batch_size, float(step_time_s),
                         tuple(comp), tuple(emu), rates, plan,
                         None if measured_rates is None else tuple(measured_rates),
                         tuple(round(w, 6) for w in wait),
                         tuple(round(x, 6) for x in links) if self.cfg.links else (),
                         dict(link_rates or {}), dict(gpu_link_rates or {}),
                         None if probe_rates is None else tuple(probe_rates))
        self.records.append(rec.to_json())
        self.writer.write(rec)
        if self.stream is not None:
            self.stream.step(step, loss, step_time_s, comp)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}", step_s=f"{step_time_s:.3f}", refresh=False)

    def _gather(self, clock: ComputeClock) -> tuple[list, list, list, list]:
        """Every rank's (compute, emulated, wait, slow-link) seconds, one all-gather; the stop
        signal any rank got rides along (:attr:`stop_signal`)."""
        import torch
        import torch.distributed as dist

        from .guard import STOP

        mine = [clock.compute_s, clock.emulated_s, clock.wait_s,
                getattr(clock, "link_emulated_s", 0.0)]
        self.stop_signal = STOP.signum
        if not (dist.is_initialized() and self.env.world_size > 1):
            return tuple([x] * self.env.world_size for x in mine)
        t = torch.tensor(mine + [STOP.signum], dtype=torch.float64, device=self.env.device)
        out = [torch.zeros_like(t) for _ in range(self.env.world_size)]
        with phase("all-gather"):
            dist.all_gather(out, t, group=self.group)
        self.stop_signal = int(max(float(x[4]) for x in out))
        return tuple([float(x[i]) for x in out] for i in range(4))

    def close(self) -> None:
        """Flush and close metrics.jsonl and the bar (the end of a run, or a stop)."""
        self.writer.close()
        if self.bar is not None:
            self.bar.close()

    def finish(self, **extra) -> RunSummary:
        self.close()
        # warm-up is per process: a resumed run warms up again from its first step
        ph = tuple(phases(self.records, self.first_step + self.cfg.train.warmup_steps))
        return RunSummary(engine=self.cfg.engine, losses=tuple(self.losses),
                          step_times_s=tuple(self.times),
                          samples_per_step=self.cfg.train.global_batch_size, phases=ph,
                          metrics_path=str(self.writer.path) if self.writer.path else None,
                          extra=dict(extra, events=list(self.events)) if self.events else extra)


def format_summary(cfg: RunConfig, s: RunSummary) -> str:
    """The end-of-run summary printed by rank 0."""
    p, plan = cfg.parallel, s.extra.get("plan")
    if plan:    # a plan's layout and batch sizes win over parallel.* and train.*
        pl = Plan.from_json(plan)
        layout, gbs, mbs = "", pl.global_batch_size, pl.micro_batch_size
    else:
        layout = f" (tp={p.tp} pp={p.pp} dp={p.dp})"
        gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    lines = [f"== malleus_ds run: engine={cfg.engine} model={cfg.model.name} "
             f"world={cfg.world_size}{layout} global_batch={gbs} micro_batch={mbs}"]
    if plan:
        lines.append(f"  plan: {pl.describe()}")
    if s.losses:
        w = cfg.train.warmup_steps if len(s.step_times_s) > cfg.train.warmup_steps else 0
        t = sum(s.step_times_s[w:])
        tput = s.samples_per_step * (len(s.step_times_s) - w) / t if t > 0 else 0.0
        lines.append(f"  steps={len(s.losses)} loss {s.losses[0]:.4f} -> {s.losses[-1]:.4f}; "
                     f"{tput:.1f} samples/s after {w} warm-up step(s)")
    resumed = s.extra.get("resumed_from")
    if resumed:
        skipped = s.extra.get("skipped_switches")
        lines.append(f"  resumed from step {resumed['step']}: {resumed['path']}"
                     + (f" (malleus.switch entries at steps {skipped} were before it: skipped)"
                        if skipped else ""))
    if s.extra.get("nothing_to_run"):
        lines.append(f"  nothing to run: the checkpoint is at step {resumed['step']} and "
                     f"train.steps={cfg.train.steps}; raise train.steps to train further")
    sd = s.extra.get("tp_slowdown")
    if sd:
        lines.append("  TP slowdown measured at start-up (tp/g -> x one full-TP layer): "
                     + ", ".join(f"{k} -> {v:.2f}" for k, v in sd.items()))
    if s.phases:
        lines.append("  throughput by phase (warm-up and transition steps left out):")
        lines.append(format_phases(s.phases))
    for ev in s.extra.get("events", ()):
        lines.append(f"  {format_event(ev)}")
    if s.metrics_path:
        lines.append(_whatif(cfg, s.metrics_path, gbs, mbs))
    final = s.extra.get("final_plan")
    if final and final != plan:
        lines.append(f"  final plan: {Plan.from_json(final).describe()}")
    ck = s.extra.get("checkpoints")
    if ck:
        tags = ck["tags"]
        shown = ", ".join(tags) if len(tags) <= 4 else f"{tags[0]}, ..., {tags[-1]}"
        lines.append(f"  checkpoints: {len(tags)} saved to {ck['dir']} ({shown}; "
                     f"latest = {tags[-1]})")
    failed = s.extra.get("failed_saves")
    if failed:
        steps = ", ".join(str(f["step"]) for f in failed)
        lines.append(f"  checkpoint saves that failed and were tried again: {len(failed)} "
                     f"(steps {steps}; the last: {failed[-1]['error']})")
    if s.metrics_path:
        lines.append(f"  metrics: {s.metrics_path}")
    return "\n".join(lines)


def _whatif(cfg: RunConfig, metrics_path: str, gbs: int, mbs: int) -> str:
    """The run's what-if account (``whatif.py``) against the static layout of ``parallel.*``."""
    from ...report.whatif import Layout, WhatIfError, account_of_run, format_account

    p, layers = cfg.parallel, getattr(cfg.model, "num_layers", None)
    layout = Layout(p.tp, p.pp, p.dp, layers, gbs, mbs) if layers else None
    try:
        return format_account(account_of_run(metrics_path, cfg.train.warmup_steps, layout))
    except WhatIfError as e:
        return f"  what-if: {e}"
