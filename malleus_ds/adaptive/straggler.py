"""Measured straggling rates and re-plan detection (DESIGN.md §2, §6).

The loop an engine runs, every step and every ``DetectConfig.every`` steps::

    units = cost_units(plan, world, tp, tp_slowdown)       # once per plan
    est.add(compute_s, units, probe_s)                     # every step (gathered timings)
    trig = det.check(est.rates())                          # every cfg.every steps
    if trig: plan for trig.rates ...; det.planned_for(trig.rates); est.reset() on a switch

* :func:`cost_units` — work a rank does under a plan: layers held × micro-batches of its
  pipeline × the TP-size slowdown of its group (0 for a rank without work).
* :class:`RateEstimator` — per-step rates ``x_d`` = (compute seconds / units) relative to a
  robust healthy reference, smoothed by a median over the last few steps. Suspended ranks are
  measured by a probe (per-unit seconds), calibrated by the same probe on the least-loaded
  rank with work (:func:`probe_reference`); so are held ranks (:func:`held_ranks`: working
  under a plan made for them as slow), read at the slower of their training and their probe.
* :class:`Detector` — Malleus's rule: a rate below ``healthy`` counts as 1.0; a re-plan needs some
  rate to differ from the one the current plan was made for by ``change`` (relative), in
  ``confirm`` consecutive detections, and none is raised during a ``cooldown`` after planning.

numpy only: no torch, no torch.distributed, no deepspeed, no omegaconf.
"""
from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..plan import Plan, charged_layers

#: a smoothed measured rate below this counts as healthy (1.0): DESIGN.md §6; the default of
#: :attr:`DetectConfig.healthy`, and the threshold ``whatif.py`` and ``malleus-plot`` use
HEALTHY = 1.2


def cost_units(plan: Plan, world: int, tp: int, tp_slowdown: Mapping[int, float],
               head: float = 0.0, layer_cost: float = 1.0) -> np.ndarray:
    """Per-rank work under ``plan`` (length ``world``, float64), in "one layer × one micro-batch
    on a healthy full TP group": ``layers held × micro-batches × tp_slowdown[tp // g]``; a
    pipeline's last stage holds ``head`` more layers' worth (the output head, ``cost.head_layers``).
    ``layer_cost``: a layer's work in those units (``cost.RECOMPUTE_FACTOR`` when activation
    checkpointing recomputes layers but not the head).

    0.0 for a rank the plan does not use (suspended or absent). Raises ``ValueError`` for a rank
    outside the world, a group size that does not divide ``tp``, or a missing slowdown key.
    """
    out = np.zeros(world, dtype=np.float64)
    for i, pipe in enumerate(plan.pipelines):
        for j, stage in enumerate(pipe.stages):
            where = f"pipelines[{i}].stages[{j}]"
            if tp % stage.tp:
                raise ValueError(f"{where}: TP group size {stage.tp} does not divide tp={tp}")
            key = tp // stage.tp
            if key not in tp_slowdown:
                raise ValueError(f"{where}: tp_slowdown has no entry for key {key} (= tp {tp} / "
                                 f"group size {stage.tp}); keys: {sorted(tp_slowdown)}")
            layers = charged_layers(stage, j == len(pipe.stages) - 1, head, layer_cost)
            u = layers * pipe.micro_batches * float(tp_slowdown[key])
            for r in stage.ranks:
                if not 0 <= r < world:
                    raise ValueError(f"{where}: rank {r} is outside 0..{world - 1}")
                out[r] = u
    return out


def cost_shape(plan: Plan, world: int) -> np.ndarray:
    """Per rank ``(B, C)`` (shape ``(world, 2)``): the micro-batches it runs as a first stage
    (the embedding's per-micro-batch cost) and the micro-batches it runs at all (the fixed cost
    every micro-batch pays: launches, the activation hand-off, Python); zeros for a rank without
    work. With :func:`cost_units` these are the features whose weights ``RateEstimator`` fits
    (the work model beyond ``layers x micro-batches``)."""
    out = np.zeros((world, 2), dtype=np.float64)
    for pipe in plan.pipelines:
        for j, stage in enumerate(pipe.stages):
            for r in stage.ranks:
                if 0 <= r < world:
                    out[r] = (pipe.micro_batches if j == 0 else 0.0, pipe.micro_batches)
    return out


@dataclass(frozen=True)
class DetectConfig:
    """When a measured rate shift triggers re-planning (Malleus's defaults)."""

    every: int = 1          # run detection every N steps (cheap: numpy on rank 0)
    window: int = 5         # median over the last N per-step rates (smoothing)
    healthy: float = HEALTHY  # a smoothed rate below this counts as healthy (1.0)
    change: float = 0.3     # re-plan when |r - p| >= change * p for some rank (relative)...
    confirm: int = 2        # ...in this many consecutive detections (hysteresis)
    cooldown: int = 2       # detections skipped after a planning attempt
    probe_every: int = 2    # a rank without work times its probe every N steps

    def check(self) -> None:
        """Raise ``ValueError`` naming ``malleus.detect.<field>=<value>`` for a bad field."""
        rules = (("every", self.every >= 1, ">= 1"), ("window", self.window >= 1, ">= 1"),
                 ("healthy", self.healthy >= 1.0, ">= 1.0 (1.0 = healthy)"),
                 ("change", self.change > 0, "> 0 (relative, e.g. 0.3 = 30%)"),
                 ("confirm", self.confirm >= 1, ">= 1"), ("cooldown", self.cooldown >= 0, ">= 0"),
                 ("probe_every", self.probe_every >= 1, ">= 1"))
        for name, ok, need in rules:
            if not ok:  # NaN fails every comparison, so it is rejected too
                raise ValueError(f"malleus.detect.{name}={getattr(self, name)!r} must be {need}")


def _vector(x: Sequence[float], world: int, what: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64).reshape(-1)
    if a.shape != (world,):
        raise ValueError(f"{what}: expected {world} values (one per rank), got {a.size}")
    return a


def _reference(t: np.ndarray, band: float) -> float:
    """The healthy per-unit time among active ranks' times ``t``: the median of those within
    ``band`` × the lower quartile. Anchored on the quartile, not the fastest rank: on shared
    CPUs one rank can run alone on a core for many steps and look 2× faster than the rest."""
    return float(np.median(t[t <= band * np.quantile(t, 0.25)]))


def probe_reading(probes: np.ndarray) -> np.ndarray:
    """Per rank (column), the reading of its probe rates over the window (rows, oldest first;
    NaN = no probe): the slower of its last two probes. A rank comes back only when two probes
    in a row agree that it is fit (one that ran in a lucky moment never lets a slow rank back:
    the rate-10 rank of issue 31 probed once at 3.3), and a recovered rank waits at most one
    more probe for an unlucky one to pass. NaN for a rank probed fewer than twice in the window
    (it keeps the rate its plan was made for)."""
    out = np.full(probes.shape[1], np.nan)
    for d in range(probes.shape[1]):
        v = probes[:, d]
        v = v[np.isfinite(v)]
        if v.size >= 2:
            out[d] = float(max(v[-1], v[-2]))
    return out


class RateEstimator:
    """Per-rank straggling rates from per-step compute timings, median-smoothed.

    Per-unit time ``t_d`` = compute seconds / cost units for a rank with work. Each step's times
    are divided by that step's median over active ranks (a step that is slow for everyone, e.g.
    a busy host, moves nobody's rate) and kept for ``window`` steps. Smoothing comes first:
    :meth:`rates` takes each rank's median over the window, then divides by the reference = the
    median of the smoothed values of the active ranks within ``band`` × their lower quartile, so
    up to half the ranks may straggle without moving it. (Taking the reference per step instead
    would let one lucky-fast step of one rank make every other rank look slow: on shared CPUs
    per-step compute varies by 2-3×.)

    A rank without work, or a held one, is read by its probe: the probe's seconds divided by
    the reference rank's probe of the same step (:func:`probe_reference`: the same block, timed
    at the same moment, under the same load), over the window by :func:`probe_reading` (the
    probes must agree). Where no reference probed in a step, the probe is calibrated to training
    units by earlier reference probes instead (:meth:`_calibration`).
    """

    def __init__(self, world: int, window: int = 5, band: float = 1.5,
                 healthy: float = HEALTHY):
        if world < 1 or window < 1 or not band >= 1.0:
            raise ValueError(f"RateEstimator: need world >= 1, window >= 1, band >= 1.0; got "
                             f"world={world}, window={window}, band={band}")
        self.world, self.window, self.band, self.healthy = world, window, band, healthy
        self._rows: deque[np.ndarray] = deque(maxlen=window)
        self._active = np.ones(world, dtype=bool)     # ranks with work in the latest step
        self._held = np.zeros(world, dtype=bool)      # ...of them, planned as slow
        self._cal: deque[float] = deque(maxlen=5)      # recent calibration factors
        # the work model beyond cost_units: per-micro-batch weights of the first stage's extra
        # work (beta) and of every micro-batch's fixed cost (gamma), in layer units, fitted on
        # the healthy ranks of the last FIT_STEPS steps (any plans)
        self.beta = self.gamma = 0.0
        self._hist: deque[tuple] = deque(maxlen=self.FIT_STEPS)
        self._shape_key, self._since_fit = None, 0

    #: steps of history the work model is fitted on (they may span several plans)
    FIT_STEPS = 40
    #: refit every this many steps within a plan (and at every new plan)
    FIT_EVERY = 4
    #: the largest per-micro-batch term fitted, in layer units (a micro-batch's fixed cost or
    #: a first stage's embedding worth more than 4 layers is not a shape effect)
    MAX_TERM = 4.0
    #: a rank's log-distance from its step's median counts at most this much in the fit
    CAP = 0.15
    #: ...and this much where it is *faster* than the median: nothing runs faster than healthy,
    #: so terms that make a rank read fast explain a straggler away (issue 31 part 1: two light
    #: first stages, one 3x slow, read 1.0 and 0.3 under terms that traded one for the other)
    FAST_CAP = 2 * CAP
    #: per measurement and unit of beta + gamma: a pull to 0 where the plans cannot tell
    PULL = 1e-3

    def add(self, compute_s: Sequence[float], units: Sequence[float],
            probe_s: Sequence[float] | None = None,
            shape: tuple[Sequence[float], Sequence[float]] | None = None,
            held: Sequence[bool] | None = None) -> np.ndarray:
        """Record one step and return its raw rates (NaN = no measurement for that rank).

        ``compute_s[d]``: rank d's compute seconds this step (communication left out);
        ``units[d]``: from :func:`cost_units` (0 = no work); ``probe_s[d]``: per-unit seconds of
        a probe run by a rank without work, by a held rank, or by a rank with work to calibrate
        those (NaN or <= 0 = none); ``shape``: ``(B, C)`` from :func:`cost_shape` (first-stage
        micro-batches, micro-batches), whose per-micro-batch weights are fitted here
        (:meth:`fit`) so a rank's rate does not depend on the shape of its stage; ``held[d]``:
        rank d works under a plan made for it as slow (:func:`held_ranks`): its probe is
        measured like a suspended rank's, never used to calibrate, and :meth:`rates` reads it
        at the slower of its training and its probe. A step in which no active rank
        has a positive finite time returns all-NaN and is not kept (it would only push real
        measurements out of the window).
        """
        c = _vector(compute_s, self.world, "compute_s")
        u = _vector(units, self.world, "units")
        active = u > 0
        hold = np.zeros(self.world, dtype=bool) if held is None else \
            _vector(held, self.world, "held").astype(bool) & active
        B = C = np.zeros(self.world)
        if shape is not None:
            B = _vector(shape[0], self.world, "shape B")
            C = _vector(shape[1], self.world, "shape C")
            ok = active & np.isfinite(c) & (c > 0)
            if ok.any():
                self._hist.append((c.copy(), u.copy(), B, C, ok))
                key = (u.tobytes(), B.tobytes(), C.tobytes())
                self._since_fit += 1
                if key != self._shape_key or self._since_fit >= self.FIT_EVERY:
                    self.fit()          # a new plan, or every few steps (a fit costs ~10 ms)
                    self._shape_key, self._since_fit = key, 0
        base = u
        u = np.where(active, u + self.beta * B + self.gamma * C, u)
        t = np.full(self.world, np.nan)
        with np.errstate(divide="ignore", invalid="ignore"):
            t[active] = c[active] / u[active]
        t[~(np.isfinite(t) & (t > 0))] = np.nan   # a zero/negative/inf time is no measurement
        tp = np.full(self.world, np.nan)          # calibrated probes of idle and held ranks
        pr = np.full(self.world, np.nan)          # ...as rates against the reference's probe
        pref = None                               # (the rank that probed to calibrate)
        if probe_s is not None:
            p = _vector(probe_s, self.world, "probe_s")
            use = (~active | hold) & np.isfinite(p) & (p > 0)
            tp[use] = p[use] * self._calibration(t, p, active & ~hold)
            refs = np.flatnonzero(active & ~hold & np.isfinite(p) & (p > 0))
            if refs.size:
                # the same block, timed at the same moment under the same load: their ratio is
                # the rate, with nothing of training's shape or the step's noise in it
                pref = int(refs[np.argmin(u[refs])])
                pr[use] = p[use] / p[pref]
        t[~active] = tp[~active]
        valid = active & ~np.isnan(t)
        if not valid.any():
            return np.full(self.world, np.nan)
        ref = _reference(t[valid], self.band)
        if pref is None:                  # no reference probe this step: the calibration
            pr = tp / ref
        # kept raw, so rates() re-reads the window with the latest work model
        self._rows.append((pr, pref, c.copy(), base.copy(), B, C, active))
        self._active, self._held = active, hold
        out = t / ref
        if pref is not None and out[pref] >= self.healthy:
            pr = pr * out[pref]           # a slow reference: the probes read relative to it
        with np.errstate(invalid="ignore"):
            out[~active] = pr[~active]
            out[hold] = np.fmax(out[hold], pr[hold])
        return out

    def _normalised_rows(self) -> tuple[np.ndarray, np.ndarray, list]:
        """The kept steps' per-unit times under the current work model (training for ranks with
        work, NaN for the others), each divided by its step's median over ranks with work; their
        probe rates (idle and held ranks, else NaN: against the same step's reference probe,
        or calibrated where none was timed); and each step's reference rank (None: none)."""
        out, probes, prefs = [], [], []
        for pr, pref, c, u, B, C, active in self._rows:
            ue = u + self.beta * B + self.gamma * C
            with np.errstate(divide="ignore", invalid="ignore"):
                t = np.where(active, c / ue, np.nan)
            t[~(np.isfinite(t) & (t > 0))] = np.nan
            med = float(np.median(t[active & ~np.isnan(t)]))
            out.append(t / med)
            probes.append(pr)
            prefs.append(pref)
        return np.stack(out), np.stack(probes), prefs

    def fit(self) -> None:
        """Fit ``beta`` and ``gamma`` in ``[0, MAX_TERM]`` on the kept history (any plans): the
        pair under which the ranks' per-unit times agree best, in log space, each step centred
        on its median over ranks (a host slower for everyone cancels), each rank's distance
        capped at ``CAP`` (a straggler costs the same whatever the terms, so it cannot pull
        them; a cost every stage of some shape pays is shared by several ranks and steps, which
        is what the fit finds) where it is slow and at ``FAST_CAP`` (twice that) where it is
        fast (a healthy rank that shares a straggler's shape is not traded for it: terms that
        make the straggler agree make its healthy twin read fast), plus a small pull to 0 (one
        uniform plan cannot tell the terms apart: they stay near 0 and the rates are the plain
        ones). A coarse grid, then a finer one around its best point."""
        if len(self._hist) < 2:
            return
        with np.errstate(divide="ignore", invalid="ignore"):   # ranks without work: log 0
            c = np.log(np.stack([h[0] for h in self._hist]))      # (K, world)
        A = np.stack([h[1] for h in self._hist])
        B = np.stack([h[2] for h in self._hist])
        C = np.stack([h[3] for h in self._hist])
        ok = np.stack([h[4] for h in self._hist])
        if ok.sum() < 3:
            return

        def per_rank(betas, gammas):
            b = np.asarray(betas)[:, None, None, None]
            g = np.asarray(gammas)[None, :, None, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where(ok, c - np.log(A + b * B + g * C), np.nan)
            r = r - np.nanmedian(r, axis=3, keepdims=True)
            # slower than the step's median: capped at CAP (a straggler); faster: at FAST_CAP
            cost = np.where(r < 0, np.minimum(-r, self.FAST_CAP), np.minimum(r, self.CAP))
            return np.nansum(cost, axis=2)      # (b, g, world)

        def loss(betas, gammas):
            b = np.asarray(betas)[:, None]
            g = np.asarray(gammas)[None, :]
            return per_rank(betas, gammas).sum(axis=2) + self.PULL * ok.sum() * (b + g)

        lo_b = lo_g = 0.0
        span = self.MAX_TERM
        for _ in range(3):
            bs = np.linspace(lo_b, lo_b + span, 9)
            gs = np.linspace(lo_g, lo_g + span, 9)
            L = loss(bs, gs)
            ib, ig = np.unravel_index(int(np.argmin(L)), L.shape)
            best_b, best_g = float(bs[ib]), float(gs[ig])
            span /= 4
            lo_b, lo_g = max(0.0, best_b - span / 2), max(0.0, best_g - span / 2)
        # support: the terms must make several ranks agree, not explain one rank away (a
        # straggler alone in its stage shape looks like a shape cost to the fit)
        gain = per_rank([0.0], [0.0])[0, 0] - per_rank([best_b], [best_g])[0, 0]
        gain = np.maximum(gain, 0.0)
        helped = int((gain > 0.5 * self.CAP).sum())
        if best_b + best_g > 0 and helped < 2:
            best_b = best_g = 0.0
        self.beta, self.gamma = best_b, best_g

    def _calibration(self, t: np.ndarray, p: np.ndarray, active: np.ndarray) -> float:
        """Training per-unit seconds per probe second, from ranks with work that also probed
        (:func:`probe_reference`): a probe is one block on a dummy batch, and fixed overheads
        (or a stage's embedding and head) make it read off by a factor that this cancels. The
        factor is a property of the model and plan, not of the moment: the median of the last
        few samples keeps one noisy probe from moving it. 1.0 until a rank with work probed."""
        ref = active & np.isfinite(p) & (p > 0) & np.isfinite(t) & (t > 0)
        self._cal.extend((t[ref] / p[ref]).tolist())
        return float(np.median(self._cal)) if self._cal else 1.0

    def rates(self, floor: Sequence[float] | None = None, last: int | None = None) -> np.ndarray:
        """Smoothed rates: per rank the median over the kept rows, ignoring NaN; NaN where no
        row has a measurement. Not clamped (a rank may read 0.9). ``floor[d]``: the rate a
        held rank's plan was made for, which it keeps at least until a probe of it is in the
        window (right after a switch its light load alone would read it healthy). ``last``: read
        only the last that many steps (a re-measurement: the steps since a switch)."""
        if not self._rows:
            return np.full(self.world, np.nan)
        rows, probes, prefs = self._normalised_rows()
        if last is not None:
            rows, probes, prefs = rows[-last:], probes[-last:], prefs[-last:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN columns -> NaN
            sm = np.nanmedian(rows, axis=0)
        act = sm[self._active & ~np.isnan(sm)]
        if not act.size:
            return np.full(self.world, np.nan)
        out = sm / _reference(act, self.band)
        # a probe rate is relative to its step's reference rank: a healthy one is 1.0 (as the
        # detector reads it), a slow one (every working rank slow) scales it
        scale = np.array([1.0 if r is None or not out[r] >= self.healthy else out[r]
                          for r in prefs])
        probe = probe_reading(probes * scale[:, None])
        idle = ~self._active
        out[idle] = probe[idle]
        # a held rank is as slow as its sustained probe says, whatever its light load reads
        # (inside a throughput cap a light load reads healthy); and healthy once two probes in a
        # row say so, whatever its light load reads (on shared cores a light share computes only
        # while every peer does, so its training reads 1.5-2x for a healthy rank: issue 31)
        h = self._held
        with np.errstate(invalid="ignore"):
            fit = h & (probe < self.healthy)
        out[h] = np.fmax(out[h], probe[h])
        out[fit] = probe[fit]
        if floor is not None:
            f = _vector(floor, self.world, "floor")
            unprobed = self._held & np.isnan(probe)
            out[unprobed] = np.fmax(out[unprobed], f[unprobed])
        return out

    def reset(self) -> None:
        """Forget the history (after a plan switch, when units change). Never called here."""
        self._rows.clear()


@dataclass(frozen=True)
class Trigger:
    """A confirmed rate shift: plan for ``rates``."""

    kind: str                   # "onset" | "change" | "recovery"
    rates: tuple[float, ...]    # normalised smoothed rates (healthy ones = 1.0), per rank


class Detector:
    """Decides, from smoothed rates, when to re-plan (see :class:`DetectConfig`).

    ``planned`` holds the normalised rates the current plan was made for (all 1.0 at start).
    """

    def __init__(self, world: int, cfg: DetectConfig = DetectConfig()):
        cfg.check()
        self.world, self.cfg = world, cfg
        self.planned = np.ones(world, dtype=np.float64)
        self.streak = 0       # consecutive detections with a shift
        self.cooldown = 0     # detections still to skip

    def normalise(self, rates: Sequence[float]) -> np.ndarray:
        """A rate below ``healthy`` -> 1.0; NaN (no data) -> the planned value for that rank."""
        r = _vector(rates, self.world, "rates").copy()
        nan = np.isnan(r)
        r[nan] = self.planned[nan]
        r[r < self.cfg.healthy] = 1.0
        return r

    def check(self, rates: Sequence[float], idle: Sequence[bool] | None = None
              ) -> Trigger | None:
        """One detection (every ``cfg.every`` steps) on :meth:`RateEstimator.rates`.

        ``idle[d]``: rank d has no work under the running plan (suspended). For such a rank only
        a *decrease* counts: it may be fit to come back, while a rise changes nothing (it is
        out already) and its probe readings are the noisiest."""
        if self.cooldown > 0:
            self.cooldown -= 1
            return None
        r, p = self.normalise(rates), self.planned
        # a move by `change` (relative), or a rank planned as slow that now reads healthy: a
        # plan made for 1.2-1.43 could otherwise never see its rank recover (1.0 is the floor,
        # and 1.0 is not 30% below 1.42: a spurious 1.43 once kept a healthy rank out for good)
        moved = (np.abs(r - p) >= self.cfg.change * p) | ((p > 1.0) & (r == 1.0))
        if idle is not None:
            moved &= ~np.asarray(idle, dtype=bool) | (r < p)
        shifted = bool(np.any(moved))
        self.streak = self.streak + 1 if shifted else 0
        if self.streak < self.cfg.confirm:
            return None
        if np.all(r == 1.0) and np.any(p > 1.0):
            kind = "recovery"
        elif np.all(p == 1.0):
            kind = "onset"
        else:
            kind = "change"
        return Trigger(kind, tuple(round(float(x), 3) for x in r))

    def planned_for(self, rates: Sequence[float]) -> None:
        """After a planning attempt (adopted or not): remember ``rates``, restart hysteresis and
        the cooldown."""
        self.planned = self.normalise(rates)
        self.streak = 0
        self.cooldown = self.cfg.cooldown


#: a working rank planned at least this slow is held (:func:`held_ranks`): its share is light
#: enough (2/3 of a full one or less) for a cap to hide in it. Below, its training reads it:
#: probing a rank planned at 1.2-1.5 (often a noisy reading) cost a bench run ~25% of its
#: steps on a shared CPU, for a share nearly full anyway
HOLD = 1.5


def held_ranks(units: Sequence[float], rates: Sequence[float] | None,
               healthy: float = HOLD) -> np.ndarray:
    """Ranks with work under a plan made for them as slow (planned rate >= ``healthy``,
    :data:`HOLD` by default): each sustains a probe like a suspended rank (DESIGN.md §6,
    "Probes measure the device"), so a light load that runs inside a throughput cap (a CPU
    quota, a power cap) does not read as a recovery that full work would undo."""
    u = np.asarray(units, dtype=float)
    if rates is None:
        return np.zeros(u.size, dtype=bool)
    r = np.array([np.nan if x is None else x for x in rates], dtype=float)
    if r.size != u.size:
        raise ValueError(f"held_ranks: {r.size} rates for {u.size} ranks")
    with np.errstate(invalid="ignore"):
        return (u > 0) & (r >= healthy)


def probe_reference(units: Sequence[float], held: Sequence[bool] | None = None) -> int | None:
    """The rank that times a probe alongside the ranks without work and the held ones, to
    calibrate theirs: the least-loaded rank with work that is not held (lowest index on ties);
    None when no rank needs calibrating (every rank works, none held) or none can."""
    u = np.asarray(units, dtype=float)
    h = np.zeros(u.size, dtype=bool) if held is None else np.asarray(held, dtype=bool)
    ok = (u > 0) & ~h
    if not ((u <= 0).any() or h.any()) or not ok.any():
        return None
    return int(np.flatnonzero(ok & (u == u[ok].min()))[0])


def as_list(rates: Sequence[float]) -> list[float | None]:
    """Rates for logs/JSON: rounded to 3 decimals, NaN -> None."""
    return [None if np.isnan(x) else round(float(x), 3) for x in np.asarray(rates, dtype=float)]
