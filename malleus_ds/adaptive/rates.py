"""Per-rank straggling rates from per-step compute timings (DESIGN.md §6).

:class:`RateEstimator`: per-step rates ``x_d`` = (compute seconds / work units) relative to a
robust healthy reference, smoothed by a median over the last few steps. Ranks without work are
measured by a probe, divided by the reference rank's probe of the same step
(``held.probe_reference``); so are held ranks (``held.held_ranks``: working under a plan made for
them as slow). :func:`probe_reading`: a rank is read at the slower of its last two probes.

The loop an engine runs (``control.py``)::

    units = cost_units(plan, world, tp, tp_slowdown)       # once per plan (work.py)
    est.add(compute_s, units, probe_s)                     # every step (gathered timings)
    trig = det.check(est.rates())                          # every DetectConfig.every steps

numpy only: no torch, no torch.distributed, no deepspeed, no omegaconf.
"""
from __future__ import annotations

import warnings
from collections import deque
from typing import Sequence

import numpy as np

from .detect import HEALTHY
from .work import per_rank


def _reference(t: np.ndarray, band: float) -> float:
    """The healthy per-unit time among active ranks' times ``t``: the median of those within
    ``band`` × the lower quartile. Anchored on the quartile, not the fastest rank: on shared
    CPUs one rank can run alone on a core for many steps and look 2× faster than the rest."""
    return float(np.median(t[t <= band * np.quantile(t, 0.25)]))


def _weighted_nanmedian(r: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``np.nanmedian(r, axis=-1, keepdims=True)`` where column ``j`` of ``r`` stands for
    ``w[j]`` (an integer count) equal columns: the median of the expanded rows, the mean of the
    two middle values for an even count, NaN for a row with no value. Sorting once, not
    ``nanmedian``'s per-row loop, which dominates the fit's time at a thousand ranks."""
    if np.all(w == 1.0):                             # every column once: positions by count
        rs = np.sort(r, axis=-1)                     # NaN last
        n = np.sum(~np.isnan(r), axis=-1, keepdims=True)
        lo = np.maximum((n - 1) // 2, 0)
        m = 0.5 * (np.take_along_axis(rs, lo, -1) + np.take_along_axis(rs, n // 2, -1))
        return np.where(n > 0, m, np.nan)
    idx = np.argsort(r, axis=-1)                     # NaN last
    rs = np.take_along_axis(r, idx, -1)
    ws = np.where(np.isnan(rs), 0.0, w[idx])
    cum = np.cumsum(ws, axis=-1)
    n = cum[..., -1:]
    lo = np.argmax(cum > np.floor((n - 1) / 2), axis=-1)[..., None]
    hi = np.argmax(cum > np.floor(n / 2), axis=-1)[..., None]
    m = 0.5 * (np.take_along_axis(rs, lo, -1) + np.take_along_axis(rs, hi, -1))
    return np.where(n > 0, m, np.nan)


def probe_reading(probes: np.ndarray) -> np.ndarray:
    """Per rank (column), the reading of its probe rates over the window (rows, oldest first;
    NaN = no probe): the slower of its last two probes. A rank comes back only when two probes
    in a row agree that it is fit (one that ran in a lucky moment never lets a slow rank back:
    a heavily throttled rank's probe can now and then read a fraction of its rate), and a recovered rank waits at most one
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
        #: the probe rates of the last step :meth:`add` recorded (NaN: no probe read)
        self.last_probe_rates = np.full(world, np.nan)

    #: steps of history the work model is fitted on (they may span several plans)
    FIT_STEPS = 40
    #: refit every this many steps within a plan (and at every new plan)
    FIT_EVERY = 4
    #: distinct rank histories the fit reads at most: beyond, an even sample of them (the terms
    #: are shared by every stage of a shape, and a fit of all of them at a thousand ranks would
    #: cost rank 0 a noticeable share of a step every FIT_EVERY steps)
    FIT_COLUMNS = 256
    #: the largest per-micro-batch term fitted, in layer units (a micro-batch's fixed cost or
    #: a first stage's embedding worth more than 4 layers is not a shape effect)
    MAX_TERM = 4.0
    #: a rank's log-distance from its step's median counts at most this much in the fit
    CAP = 0.15
    #: ...and this much where it is *faster* than the median: nothing runs faster than healthy,
    #: so terms that make a rank read fast explain a straggler away (of two light first
    #: stages, one slow, terms that trade one for the other would read the slow one healthy
    #: and the healthy one impossibly fast)
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
        self.last_probe_rates = np.full(self.world, np.nan)
        c = per_rank(compute_s, self.world, "compute_s")
        u = per_rank(units, self.world, "units")
        active = u > 0
        hold = np.zeros(self.world, dtype=bool) if held is None else \
            per_rank(held, self.world, "held").astype(bool) & active
        B = C = np.zeros(self.world)
        if shape is not None:
            B = per_rank(shape[0], self.world, "shape B")
            C = per_rank(shape[1], self.world, "shape C")
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
            p = per_rank(probe_s, self.world, "probe_s")
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
        self.last_probe_rates = pr.copy()
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
        # ranks with the same history (timings, shape, work) weigh as one column with a count:
        # exact, and at 1,024 ranks of a replay (no noise) a few dozen columns instead of all
        K = c.shape[0]
        cols, w = np.unique(np.concatenate([np.nan_to_num(c, nan=-np.inf), A, B, C, ok]),
                            axis=1, return_counts=True)
        c, A, B, C = cols[:K], cols[K:2 * K], cols[2 * K:3 * K], cols[3 * K:4 * K]
        ok = cols[4 * K:].astype(bool)
        w = w.astype(np.float64)
        if w.size > self.FIT_COLUMNS:    # at scale: an even sample of them (sorted by timings)
            keep = np.arange(0, w.size, -(-w.size // self.FIT_COLUMNS))
            c, A, B, C, ok, w = c[:, keep], A[:, keep], B[:, keep], C[:, keep], ok[:, keep], \
                w[keep]

        def per_rank(betas, gammas):
            b = np.asarray(betas)[:, None, None, None]
            g = np.asarray(gammas)[None, :, None, None]
            with np.errstate(divide="ignore", invalid="ignore"):
                r = np.where(ok, c - np.log(A + b * B + g * C), np.nan)
            r = r - _weighted_nanmedian(r, w)
            # slower than the step's median: capped at CAP (a straggler); faster: at FAST_CAP
            cost = np.where(r < 0, np.minimum(-r, self.FAST_CAP), np.minimum(r, self.CAP))
            return np.nansum(cost, axis=2)      # (b, g, column)

        def loss(betas, gammas):
            b = np.asarray(betas)[:, None]
            g = np.asarray(gammas)[None, :]
            return per_rank(betas, gammas) @ w + self.PULL * (ok.sum(axis=0) @ w) * (b + g)

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
        helped = int(w[gain > 0.5 * self.CAP].sum())
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
        # while every peer does, so its training reads slow for a healthy rank)
        h = self._held
        with np.errstate(invalid="ignore"):
            fit = h & (probe < self.healthy)
        out[h] = np.fmax(out[h], probe[h])
        out[fit] = probe[fit]
        if floor is not None:
            f = per_rank(floor, self.world, "floor")
            unprobed = self._held & np.isnan(probe)
            out[unprobed] = np.fmax(out[unprobed], f[unprobed])
        return out

    def read(self, last: int | None = None) -> np.ndarray:
        """Per rank: does :meth:`rates` over the last ``last`` steps read this rank from its
        own timings (a working rank not held that computed in them, or a held or idle rank
        probed at least twice in them)? False: it would read the rank's floor or nothing."""
        if not self._rows:
            return np.zeros(self.world, dtype=bool)
        rows, probes, _ = self._normalised_rows()
        if last is not None:
            rows, probes = rows[-last:], probes[-last:]
        probed = np.isfinite(probes).sum(axis=0) >= 2
        timed = np.isfinite(rows).any(axis=0)
        return np.where(self._held | ~self._active, probed, timed)


def as_list(rates: Sequence[float]) -> list[float | None]:
    """Rates for logs/JSON: rounded to 3 decimals, NaN -> None."""
    return [None if np.isnan(x) else round(float(x), 3) for x in np.asarray(rates, dtype=float)]
