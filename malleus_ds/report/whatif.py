"""What-if account of one run: what the stragglers cost it, next to what they would have cost a
static job and the least any layout could have lost (pure: records in, numbers and text out).

Input: the step and event lines of ``metrics.jsonl`` (format: ``metrics.py``), from any engine
and any version, and optionally the run's nominal :class:`Layout` (the static plan a static job
runs). Steps before ``first recorded step + warmup`` are left out of everything.

**Rates.** One source per run, named in the output: ``measured`` (engine=malleus:
``measured_rates``, nulls skipped), else ``emulated`` (``emulated_rates``, or ``rates`` in older
files), else ``compute_s`` (each rank's compute seconds over the fastest rank's that step: a
DeepSpeed or torch run with a real, not emulated, straggler), else none (every step healthy).
A rate below :data:`HEALTHY` (1.2, DESIGN.md §6) counts as 1.0.

**Phases.** When the run was emulated: maximal runs of consecutive steps with the same emulated
schedule (ranks at or above :data:`HEALTHY`; its onset is exact, and measurement noise cannot
split it; ``run_model.stretches``). Else the per-step rates (source above) are read as the
adaptive loop reads them (``phases.rate_phases``): each rank's median over 5 steps centred on
the step, below :data:`HEALTHY` healthy, and a new straggler condition only when it lasts at
least ``phases.MIN_STEPS`` (7) steps; so one noisy step, or a run shorter than that, has no
straggler phase. A straggler phase's rates are each rank's median over the phase (source
above).

**Per phase** ``p`` with ``S_p`` samples (all in samples/s, except the seconds):

* ``achieved = S_p / W_p``, ``W_p`` = its step times + the seconds of the ``migrate`` events
  whose ``step`` lies in the phase (what the job did, migrations included;
  ``run_model.throughput``);
* ``healthy = H``: samples over step seconds of all healthy phases (migrations left out: they
  are counted below); ``t_h`` = its seconds per step, ``C`` = the busiest rank's
  ``compute_s`` per healthy step (mean over those steps);
* ``static = k_p H``: the static plan (``plan.static_plan`` of the layout) under ``rates_p``.
  ``T_h``, ``T_p``: its simulated 1F1B step time healthy and under the rates (model units,
  ``simulate.build_timeline``; head layers left out; equal to the cost model's
  ``sum t + (m-1) max t`` when the slow stage is the last one, below it otherwise), ``U``: the
  compute units one rank does per healthy step (the busiest stage's ``t m``). Only compute
  slows down, so the static step takes ``t_h + (C / U) (T_p - T_h)`` seconds and
  ``k_p = t_h / (t_h + (C / U) (T_p - T_h))``; without ``compute_s`` the whole step scales:
  ``k_p = T_h / T_p``. Without a layout (or one of another world size): ``T_h = U = 1``,
  ``T_p = max rate`` (a static job runs at its slowest rank's pace: exact for pp=1), and the
  output says so. Without a healthy phase, ``t_h`` is estimated from the first phase's steps
  before any plan switch (the job is assumed to have started on the static plan): their mean
  step time less ``(C / U) (T_p - T_h)``, ``C`` from the fastest rank's ``compute_s`` (a
  healthy one);
* ``bound``: ``f_p = mean over ranks of 1/rate`` (``cost.capacity_of_rates``) is the share of
  the cluster's compute left; no layout of the same work computes faster than spreading the
  step's compute over it: ``t_h + C (1/f_p - 1)`` seconds per step, so ``bound = H t_h /
  (t_h + C (1/f_p - 1))`` (``= f_p H`` when the step is all compute, or without
  ``compute_s``). The same compute-only slowdown as ``static``, so ``bound >= static``;
* ``detect s``: the seconds lost before the first plan switch of a straggler phase (the first
  ``migrate`` event in it, else the first adopted ``replan``), i.e. detection and planning
  latency: the steps before the switch took ``T_before`` seconds for ``S_before`` samples, the
  steps from the switch on ran ``T_after / S_after`` seconds per sample:
  ``detect = max(0, T_before - S_before * T_after / S_after)``; ``-`` without a switch (or
  with no step after it);
* ``migrate s``: the sum of the phase's ``migrate`` seconds; ``lost s = W_p - S_p / H``.

**The line.** Over the run: ``T_healthy = sum S_p / H``, ``T_static = sum S_p / static_p``,
``T_bound = sum S_p / bound_p``, ``T_job = sum W_p``. Each percentage is the share of that
job's own wall time over these steps that the stragglers cost it:
``X = (T_static - T_healthy) / T_static`` (a static job), ``Y = (T_job - T_healthy) / T_job``
(this run), ``Z = (T_bound - T_healthy) / T_bound`` (the least loss any layout could achieve,
so ``Z <= X``). A run without straggler phases says "no straggler in this run".

**Slow links.** A step's slow links (:func:`link_state`): the measured ones of its
``link_rates`` (rank 0's link watch, slow from ``detect.link_healthy``), else "emulated" where
the slow-link emulation waited (``link_emulated_s``). They split the phases further, and a
phase's label names them (``link 0-1 at 20``). For such a phase ``static`` is what the run
measured on its first plan under the link, before any switch (a static run: all its steps),
when that is at least two steps and below the compute model's; ``bound`` is the compute bound
times ``link_capacity / f`` (``malleus_ds/capacity.py``, DESIGN.md §3), with the ``comm``
section the loop measured (its first ``replan`` event that carries one), the run's layout and
node shape; without them the compute bound stands. Healthy phases have neither stragglers nor
slow links.

**Plan checks.** The adaptive loop's ``check`` events (``pace_check.py``) ride along
(``Account.checks``, ``check_events.checks_of``: each miss with what the re-plan after it did),
and the account ends with their line: ``plan checks: 4 kept, 1 missed (step 14: 2.09x its
promise of 0.430 s -> re-planned: back to plan-...)``; none for a run without them.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from .check_events import Check, checks_line, checks_of
from ..cost import capacity_of_rates
from .metrics import MetricsError, metrics_path, read_run
from .run_model import (Throughput, emulated_condition, emulated_rates, events_in, stretches,
                        throughput, world_of)
from .phases import rate_phases
# re-exported as this module's interface: HEALTHY, link_state, Layout, layout_from_config,
# static_model, static_keep
from .whatif_rates import (HEALTHY, link_state, phase_links, phase_rates, rate_source,
                           readings)
from .whatif_static import (Layout, StaticModel, layout_from_config, link_bound, static_keep,
                            static_model)


class WhatIfError(ValueError):
    """The records hold nothing to account for; the message says why (file and line if any)."""


@dataclass(frozen=True)
class PhaseAccount:
    first: int
    last: int
    rates: tuple[tuple[int, float], ...]   # ((rank, rate), ...) of slowed ranks; () = healthy
    steps: int
    samples: float
    seconds: float                          # W_p: step times + migrations
    healthy: float                          # samples/s
    static: float
    bound: float
    detect_s: float | None
    migrate_s: float
    f: float = 1.0                          # capacity fraction: mean over ranks of 1/rate
    #: slow links: ((link "a-b" or "emulated", measured rate or None), ...); () = healthy links
    links: tuple[tuple[str, float | None], ...] = ()

    @property
    def slow(self) -> bool:
        return bool(self.rates or self.links)

    @property
    def label(self) -> str:
        parts = [f"rank {r} at rate {x:.3g}" for r, x in self.rates]
        parts += [f"link {n}" + (f" at {x:.3g}" if x else " (emulated)") for n, x in self.links]
        return ", ".join(parts) or "healthy"

    @property
    def achieved(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def lost_s(self) -> float:
        return self.seconds - self.samples / self.healthy


@dataclass(frozen=True)
class Account:
    phases: tuple[PhaseAccount, ...]
    world: int
    rate_source: str           # "measured" | "emulated" | "compute_s" | "none"
    static_source: str
    healthy_source: str
    adaptive: bool             # the run switched plans (engine=malleus)
    t_healthy: float
    t_static: float
    t_bound: float
    t_job: float
    checks: tuple[Check, ...] = ()    # the adaptive loop's plan checks (``check_events.py``)

    @property
    def stragglers(self) -> bool:
        return any(p.slow for p in self.phases)

    @staticmethod
    def _share(t: float, t_healthy: float) -> float:
        return (t - t_healthy) / t if t > 0 else 0.0

    @property
    def x(self) -> float:
        return self._share(self.t_static, self.t_healthy)

    @property
    def y(self) -> float:
        return self._share(self.t_job, self.t_healthy)

    @property
    def z(self) -> float:
        return self._share(self.t_bound, self.t_healthy)



# ---------------------------------------------------------------------------------------------
# the account


def _switch_step(events: Sequence[Mapping], lo: int, hi: int) -> int | None:
    s = [int(e["step"]) for e in events_in(events, lo, hi, "migrate")] or \
        [int(e["step"]) for e in events_in(events, lo, hi, "replan")
         if e.get("adopted", True) is not False]
    return min(s) if s else None


def _seconds(rs: Sequence[Mapping]) -> float:
    """The step seconds of ``rs`` (``run_model.throughput``, migrations left out)."""
    return throughput(rs).step_s


def _samples(rs: Sequence[Mapping]) -> float:
    return throughput(rs).samples


def _compute(rs: Sequence[Mapping], pick=max) -> float | None:
    """Mean over ``rs`` of ``pick`` over ranks of ``compute_s`` (None: not recorded)."""
    xs = [pick(float(x) for x in r["compute_s"]) for r in rs
          if isinstance(r.get("compute_s"), list) and r["compute_s"]
          and all(isinstance(x, (int, float)) for x in r["compute_s"])]
    return sum(xs) / len(xs) if xs else None


def _before_after(events: Sequence[Mapping], g: Sequence[Mapping]
                  ) -> tuple[int | None, list[Mapping], list[Mapping]]:
    """(the phase's first plan switch, its steps before it, its steps from it on); without a
    switch: (None, all its steps, [])."""
    s = _switch_step(events, g[0]["step"], g[-1]["step"])
    if s is None:
        return None, list(g), []
    return s, [r for r in g if r["step"] < s], [r for r in g if r["step"] >= s]


@dataclass(frozen=True)
class _Phase:
    """One phase as read from the step lines: its steps, slowed ranks, slow links, throughput
    (migrations included) and the static plan under its rates."""

    steps: list[Mapping]
    rates: tuple[tuple[int, float], ...]
    links: tuple[tuple[str, float | None], ...]
    tp: Throughput
    model: StaticModel

    @property
    def slow(self) -> bool:
        return bool(self.rates or self.links)


@dataclass(frozen=True)
class _Pace:
    """The healthy pace: samples/s ``H``, the busiest rank's compute seconds per healthy step
    ``C`` (None: not recorded), healthy seconds per step ``t_h``, and where they come from."""

    samples_s: float
    compute: float | None
    step_s: float
    source: str


def _kept_steps(records: Sequence[Mapping], warmup: int) -> tuple[list[Mapping], list[Mapping]]:
    """(all step lines by step, those after the warm-up); a WhatIfError when none is left."""
    steps = sorted((r for r in records if "event" not in r), key=lambda r: r["step"])
    if not steps:
        raise WhatIfError("no step lines (an empty metrics.jsonl, or events only): nothing "
                          "to account for")
    start = int(steps[0]["step"]) + max(0, int(warmup))
    kept = [r for r in steps if r["step"] >= start]
    if not kept:
        raise WhatIfError(f"all {len(steps)} step lines are warm-up steps (warmup={warmup}): "
                          f"nothing left to account for")
    return steps, kept


def _rate_groups(steps: Sequence[Mapping], kept: list[Mapping], source: str, world: int
                 ) -> tuple[list[list[Mapping]], list[tuple[tuple[int, float], ...]]]:
    """The kept steps cut into phases of one straggler condition, with each phase's rates."""
    if any(emulated_rates(r) for r in steps):
        # the known schedule: exact onsets, and no measurement noise in the split
        sts = stretches(emulated_condition(r, HEALTHY) for r in kept)
        groups = [kept[st.lo:st.hi] for st in sts]
        conds = [st.key for st in sts]
        # a straggler phase the measurement missed (it lags the onset) keeps its emulated rates
        rates = [(phase_rates(g, source, world) or c) if c else ()
                 for g, c in zip(groups, conds)]
        return groups, rates
    # measured: read as the adaptive loop reads it (phases.py)
    ph = rate_phases([int(r["step"]) for r in kept],
                     [readings(r, source, world) for r in kept], world=world)
    return [kept[p.lo:p.hi] for p in ph], [p.rates for p in ph]


def _split_by_links(groups: list[list[Mapping]], rates: list[tuple[tuple[int, float], ...]]
                    ) -> list[tuple[list[Mapping], tuple[tuple[int, float], ...],
                                    tuple[tuple[str, float | None], ...]]]:
    """Slow links split the phases further (their own state per step, ``link_state``):
    (steps, rates, slow links) per phase."""
    out = []
    for g, x in zip(groups, rates):
        for st in stretches(link_state(r) for r in g):
            part = g[st.lo:st.hi]
            out.append((part, x, phase_links(part, st.key)))
    return out


def _estimated_pace(first: _Phase, events: Sequence[Mapping]
                    ) -> tuple[float, float | None, str, list[Mapping]]:
    """Without a healthy phase: the first phase's steps before any switch ran the static plan
    (assumed), less its modelled extra; (H, C, source, the steps read)."""
    _, pre, post = _before_after(events, first.steps)
    pre = pre or post
    t = _seconds(pre) / len(pre)
    comp = _compute(pre, min)       # the fastest rank is a healthy one
    mo = first.model
    t_h = t - comp / mo.busy * (mo.slowed - mo.healthy) if comp else 0.0
    if not t_h > 0:
        t_h, comp = t * mo.healthy / mo.slowed, None
    H = _samples(pre) / len(pre) / t_h
    source = (f"estimated (no healthy phase): steps {pre[0]['step']}-"
              f"{pre[-1]['step']} less the static plan's modelled extra "
              + ("compute" if comp else "step time"))
    return H, comp, source, pre


def _healthy_pace(phases: Sequence[_Phase], events: Sequence[Mapping]) -> _Pace:
    """The healthy pace, from the healthy phases, else estimated (:func:`_estimated_pace`)."""
    healthy = [r for ph in phases if not ph.slow for r in ph.steps]
    if healthy:
        t = _seconds(healthy)
        if t <= 0:
            raise WhatIfError(f"the healthy steps' step_time_s add up to {t}: no pace to "
                              f"compare with")
        H, comp, source, base = _samples(healthy) / t, _compute(healthy), "healthy phases", healthy
    else:
        H, comp, source, base = _estimated_pace(phases[0], events)
    if not H > 0:
        raise WhatIfError(f"healthy throughput {H} samples/s (samples or step times add up to "
                          f"0?): no pace to compare with")
    return _Pace(H, comp, _samples(base) / len(base) / H, source)


def _detect_s(s: int | None, pre: Sequence[Mapping], post: Sequence[Mapping]) -> float | None:
    """The seconds lost before the phase's first switch ``s`` (None: no switch, or no step
    after it)."""
    if s is not None and post and _samples(post) > 0:
        return max(0.0, _seconds(pre) - _samples(pre) * _seconds(post) / _samples(post))
    return None


def _phase_account(ph: _Phase, pace: _Pace, events: Sequence[Mapping], first_plan: object,
                   world: int, lbound: float | None) -> PhaseAccount:
    """One phase's numbers; ``lbound``: :func:`link_bound` for a phase with slow links."""
    g, x, ln = ph.steps, ph.rates, ph.links
    H, comp, step_h = pace.samples_s, pace.compute, pace.step_s
    k = static_keep(ph.model, step_h, comp)
    detect = None
    if ph.slow:
        s, pre, post = _before_after(events, g)
        detect = _detect_s(s, pre, post)
        if ln:
            # a static job under a slow link: what this run's steps of the phase measured on
            # the first plan, before any switch (a static run: all of them)
            static_steps = [r for r in pre if r.get("plan") == first_plan]
            if len(static_steps) >= 2 and _seconds(static_steps) > 0:
                k = min(k, _samples(static_steps) / _seconds(static_steps) / H)
    f = capacity_of_rates(dict(x), world)
    b = step_h / (step_h + comp * (1 / f - 1)) if comp else f
    if ln and lbound is not None:
        b = b * lbound
    tp = ph.tp
    return PhaseAccount(int(g[0]["step"]), int(g[-1]["step"]), x, tp.steps, tp.samples,
                        tp.seconds, H, k * H, b * H, detect, tp.migrate_s, f, ln)


def account(records: Sequence[Mapping], events: Sequence[Mapping] = (),
            layout: Layout | None = None, warmup: int = 0,
            cluster: tuple[int, int] | None = None) -> Account:
    """The what-if account of one run (definitions: the module docstring). ``records``: step
    lines (event lines among them are moved to ``events``); ``cluster``: (nodes, GPUs per
    node), for the capacity bound with slow links."""
    events = list(events) + [r for r in records if "event" in r]
    steps, kept = _kept_steps(records, warmup)
    world = world_of(steps)         # run_model.world_of
    source = rate_source(steps)
    split = _split_by_links(*_rate_groups(steps, kept, source, world))
    comm = next((e["comm"] for e in events if e.get("event") == "replan"
                 and isinstance(e.get("comm"), Mapping)), None)
    phases = [_Phase(g, x, ln, throughput(g, events), static_model(layout, dict(x), world))
              for g, x, ln in split]
    static_source = next((ph.model.how for ph in phases if ph.rates), phases[0].model.how)
    pace = _healthy_pace(phases, events)
    if pace.compute is None:
        static_source += "; no compute_s: the whole step scales"
    first_plan = steps[0].get("plan")
    out = [_phase_account(ph, pace, events, first_plan, world,
                          link_bound(layout, cluster, comm, dict(ph.rates), ph.links)
                          if ph.links else None)
           for ph in phases]
    adaptive = any(e.get("event") == "migrate" for e in events) or \
        len({r.get("plan") for r in steps if r.get("plan")}) > 1
    return Account(tuple(out), world, source, static_source, pace.source, adaptive,
                   t_healthy=sum(p.samples / p.healthy for p in out),
                   t_static=sum(p.samples / p.static for p in out),
                   t_bound=sum(p.samples / p.bound for p in out),
                   t_job=sum(p.seconds for p in out), checks=checks_of(events))


# ---------------------------------------------------------------------------------------------
# text


def closing_line(a: Account) -> str:
    """The one line: X, Y and Z (module docstring), or "no straggler in this run"."""
    if not a.stragglers:
        return "no straggler in this run: nothing for a re-layout to win back"
    who = "adaptive Malleus" if a.adaptive else "this run (no plan switch)"
    return (f"stragglers would have cost a static job {100 * a.x:.1f}% of this run; {who} lost "
            f"{100 * a.y:.1f}%; the bound is {100 * a.z:.1f}%")


def format_account(a: Account, indent: str = "  ") -> str:
    """A per-phase table (samples/s and seconds), where the numbers come from, and the line;
    then the plan checks' line when the run has ``check`` events (``check_events.checks_line``:
    all of them, the warm-up's too)."""
    checks = checks_line(a.checks)
    tail = f"\n{indent}{checks}" if checks else ""
    if not a.stragglers:
        n = sum(p.steps for p in a.phases)
        return f"{indent}what-if: {closing_line(a)} ({n} steps after the warm-up)" + tail
    w = max([16] + [len(p.label) for p in a.phases])
    lines = [f"{indent}what-if (rates: {a.rate_source}; static: {a.static_source}; healthy: "
             f"{a.healthy_source}); samples/s, seconds:",
             f"{indent}  {'phase':{w}s} {'steps':>7s} {'f':>5s} {'healthy':>8s} {'static':>8s} "
             f"{'bound':>8s} {'achieved':>8s} {'lost s':>8s} {'detect s':>8s} {'migrate s':>9s}"]
    for p in a.phases:
        det = f"{p.detect_s:8.2f}" if p.detect_s is not None else f"{'-':>8s}"
        lines.append(f"{indent}  {p.label:{w}s} {f'{p.first}-{p.last}':>7s} {p.f:5.2f} "
                     f"{p.healthy:8.2f} "
                     f"{p.static:8.2f} {p.bound:8.2f} {p.achieved:8.2f} {p.lost_s:8.2f} {det} "
                     f"{p.migrate_s:9.2f}")
    lines.append(f"{indent}{closing_line(a)}")
    return "\n".join(lines) + tail


# ---------------------------------------------------------------------------------------------
# run folders


def read_config(run_dir: str | Path) -> Mapping | None:
    """``<run>/.hydra/config.yaml`` as a dict, or None (absent or unreadable)."""
    p = Path(run_dir) / ".hydra" / "config.yaml"
    if not p.is_file():
        return None
    try:
        import yaml

        d = yaml.safe_load(p.read_text())
    except Exception:  # noqa: BLE001 - a run folder without a readable config still accounts
        return None
    return d if isinstance(d, Mapping) else None


def read_lines(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(step lines, event lines) of a metrics.jsonl or its run folder, checked
    (``metrics.read_run``); a line that is not a JSON object, or a step line without
    numeric ``step``/``samples``/``step_time_s``, is a WhatIfError naming the file and line, and
    so is a file without step lines."""
    try:
        steps, events = read_run(path)
    except MetricsError as e:
        raise WhatIfError(str(e)) from None
    if not steps:
        raise WhatIfError(f"{metrics_path(path)}: no step lines ({len(events)} event line(s)): "
                          f"nothing to account for")
    return steps, events


def account_of_run(run_dir: str | Path, warmup: int | None = None,
                   layout: Layout | None = None,
                   lines: tuple[Sequence[Mapping], Sequence[Mapping]] | None = None) -> Account:
    """The account of a run folder's metrics.jsonl. ``layout`` / ``warmup`` None: from the
    folder's ``.hydra/config.yaml`` when there is one (else no layout, warm-up 1, the config's
    default). ``lines``: its (step lines, event lines) when the caller has read them already
    (``metrics.read_run``), so the file is read once; None: read here (:func:`read_lines`)."""
    steps, events = read_lines(run_dir) if lines is None else lines
    conf = read_config(run_dir) if Path(run_dir).is_dir() else None
    world = world_of(steps)
    if layout is None and conf is not None:
        layout = layout_from_config(conf, world)
    cluster = None
    cl = (conf or {}).get("cluster") or {}
    if isinstance(cl, Mapping) and cl.get("gpus_per_node"):
        from ..job_layout import JobLayout, JobLayoutError
        try:
            job = JobLayout(world, int(cl["gpus_per_node"]))
            cluster = (job.nodes, job.gpus_per_node)
        except (TypeError, ValueError, JobLayoutError):
            cluster = None
    if warmup is None:
        w = (conf or {}).get("train", {}).get("warmup_steps", 1) if conf else 1
        warmup = w if isinstance(w, int) and w >= 0 else 1
    return account(steps, events, layout, warmup, cluster)
