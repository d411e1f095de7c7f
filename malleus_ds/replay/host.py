"""Ranks that share a host's CPU cores: the step time of a CPU run, for ``--from-run``.

On a GPU cluster a rank's compute runs on its own device; the host's cores only feed it, and
the replay's step is the cost model's (``run.Replay.step_seconds``). A CPU run is different:
its ranks' compute *is* CPU work, and on a host with fewer cores than busy processes they take
turns. 4 ranks on 2 cores each wait about as long as they compute (``wait_s`` of a step line);
a rank that sleeps (an emulated straggler) or has no work hands its core to the others; the
planner's search and a suspended rank's sustained probe take cores too. :class:`SharedHost`
models that as fluid processor sharing:

* each rank ``i`` has ``a_i`` CPU seconds of compute (its cost units x the replay's seconds per
  unit, ``Replay.scale``, which ``compute_s`` measures without the waits); at rate
  ``r_i`` (the emulation sleeps ``r - 1`` times each piece's wall after it) it wants a core
  ``1/r_i`` of its time and gets through its work at ``sigma / r_i`` per second, where
  ``sigma = min(1, cores / demand)`` and ``demand`` sums what every unfinished rank, every
  running probe (``1/r`` for ``probe_s`` seconds from the step's start) and a searching planner
  (a whole core) want; where the run's stragglers were emulated by sleeping (``sleeps``), a
  slowed rank runs as the emulation runs it instead: each of its compute spans (a forward and
  a backward per micro-batch, :func:`spans`) at a whole core's demand, then a sleep of
  ``r - 1`` times that span's wall, its waits for a core included;
* the compute part ends when the last rank has finished, and no sooner than the cost model's
  step, which holds the pipeline's order, with each rank's pieces run at the pace the sharing
  left it (its rate times its wall over its wall alone): a stage that waits on a straggler's
  pieces waits on its own shared ones too (a 2-stage pipeline with a rank at 8x beside two busy
  ranks, 4 on 2 cores: 0.48 s undilated, 0.58 dilated, 0.58-0.70 measured);
* the rest of the step (optimizer, reduction, Python: ``other_s`` CPU seconds per working rank)
  runs on every working rank at once, shared the same way.

:func:`SharedHost.calibrate` reads ``cores`` and ``other_s`` from a run's healthy steps (every
rank working on the user's layout): a rank's compute wall over its device time
``(compute_s + wait_s) / compute_s`` is ``ranks / cores`` when they all compute at once, and
what the healthy step (its mean) leaves is ``other_s``, shared by them all.

numpy only.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np


@dataclass(frozen=True)
class SharedHost:
    """``ranks`` ranks on one host of ``cores`` effective cores (a job's hosts alike)."""

    cores: float
    other_s: float         # CPU seconds of a step's non-compute part per working rank
    ranks_per_host: int
    #: the run's stragglers were emulated by sleeping (``straggler.method=sleep``): a slowed
    #: rank wants a whole core while it runs each compute span, and sleeps ``rate - 1`` times
    #: the span's wall after it, its waits for a core included (``ComputeClock.add``); and a
    #: probe does not sustain, it times a few runs of the block (``ProbeBlock._can_be_capped``)
    sleeps: bool = False

    @property
    def probes_sustain(self) -> bool:
        """Does a probe keep its core busy through a sustained window, within its budget?"""
        return not self.sleeps

    def __post_init__(self) -> None:
        if not (self.cores > 0 and self.other_s >= 0 and self.ranks_per_host >= 1):
            raise ValueError(f"SharedHost: cores {self.cores!r}, other_s {self.other_s!r}, "
                             f"ranks_per_host {self.ranks_per_host!r} out of range")

    def step_seconds(self, work: Sequence[float], rates: Sequence[float],
                     probing: Sequence[bool] | None = None, probe_s: float = 0.0,
                     searching: bool = False, floor_s: float = 0.0,
                     floor: Callable[[np.ndarray], float] | None = None,
                     order: Sequence[Sequence[float]] | None = None) -> float:
        """One step's seconds: each host's compute (fluid sharing, module doc; ``work``: each
        rank's CPU seconds of it with a core to itself, 0 without work), at least the cost
        model's step, then the non-compute part; the job waits for its slowest host. The
        planner searches on host 0 (rank 0's). The cost model's step is ``floor_s``, or
        ``floor(rates)`` given each rank's rate times its dilation under the sharing (its wall
        over its wall with a core to itself): a pipeline's pieces on its path run at the pace
        the sharing leaves their ranks. A probe wants ``1/r`` of a core (its rank's rate ``r``)
        for ``probe_s`` seconds from the step's start; where the ranks sleep (:attr:`sleeps`: a
        probe does not sustain, it is a few timed runs of the block, the emulation sleeping
        after each), ``probe_s`` is its CPU seconds instead, and its wall ``r`` times them.
        ``order``: where the ranks sleep, each rank's compute spans in the order it runs them,
        as fractions of its work (:func:`spans`); a slowed rank then runs each at a whole
        core's demand and sleeps ``r - 1`` times its wall after it (default: one span)."""
        u = np.asarray(work, dtype=np.float64)
        r = np.maximum(np.asarray(rates, dtype=np.float64), 1.0)
        p = np.zeros(u.size, dtype=bool) if probing is None else np.asarray(probing, bool)
        n = self.ranks_per_host
        hosts = [slice(h, h + n) for h in range(0, u.size, n)]
        ends = np.zeros(u.size)
        for h, sl in enumerate(hosts):
            ends[sl] = _shared(u[sl], 1.0 / r[sl], self.cores,
                               [(1.0 / x, probe_s * x if self.sleeps else probe_s)
                                for x in r[sl][p[sl]]]
                               + ([(1.0, np.inf)] if searching and h == 0 else []),
                               sleeps=self.sleeps,
                               order=None if order is None else list(order)[sl])
        if floor is not None:
            dil = np.where(u > 0, ends / np.maximum(u * r, 1e-300), 1.0)
            floor_s = max(floor_s, float(floor(r * np.maximum(dil, 1.0))))
        worst = 0.0
        for h, sl in enumerate(hosts):
            busy = u[sl] > 0
            want = int(busy.sum()) + (1 if searching and h == 0 else 0)
            other = self.other_s / min(1.0, self.cores / want) if want else 0.0
            worst = max(worst, max(float(ends[sl].max()), floor_s)
                        + (other if busy.any() else 0.0))
        return worst

    @classmethod
    def calibrate(cls, healthy: Sequence[dict], ranks_per_host: int, step_s: float,
                  busiest_s: float, sleeps: bool = False) -> "SharedHost | None":
        """From a run's healthy step lines on its first plan (every rank working at once), their
        step ``step_s`` and busiest rank's ``compute_s`` ``busiest_s`` (``run_costs.steady``:
        medians): None where the lines carry no ``wait_s`` (runs before it was written) or no
        compute. The non-compute part is what the model's healthy step leaves of ``step_s``.
        ``sleeps``: as the field (the run's ``straggler.method`` is ``sleep``)."""
        ratios = []
        for s in healthy:
            c, w = s.get("compute_s"), s.get("wait_s")
            if not c or not w or len(c) != len(w):
                continue
            c, w = np.asarray(c, dtype=np.float64), np.asarray(w, dtype=np.float64)
            ratios += list((c[c > 0] + w[c > 0]) / c[c > 0])
        if not ratios:
            return None
        n = min(ranks_per_host, len(healthy[0]["compute_s"]))
        k = max(1.0, statistics.median(ratios))
        cores = n / k
        other = max(0.0, step_s - busiest_s * k) * min(1.0, cores / n)
        return cls(cores, other, ranks_per_host, sleeps)


def spans(micro_batches: int, warm: int = 0) -> tuple[float, ...]:
    """A rank's compute spans in a step, in the order it runs them, as fractions of its work:
    a forward (1 part) and a backward (2 parts) per micro-batch, as the engine times them
    (``ComputeClock.compute`` around each instruction), in 1F1B order: ``warm`` forwards
    first (a stage's warm-up, ``stages - stage - 1``), then a forward and a backward each,
    then the warm-up's backwards."""
    m = int(micro_batches)
    if m <= 0:
        return ()
    w = max(0, min(int(warm), m - 1))
    seq = [1.0] * w + [1.0, 2.0] * (m - w) + [2.0] * w
    tot = 3.0 * m
    return tuple(x / tot for x in seq)


def plan_spans(plan, num_ranks: int) -> list[tuple[float, ...]]:
    """Each rank's :func:`spans` under ``plan`` (a suspended rank: none)."""
    out: list[tuple[float, ...]] = [()] * num_ranks
    for pipe in plan.pipelines:
        for k, st in enumerate(pipe.stages):
            for r in st.ranks:
                out[r] = spans(pipe.micro_batches, len(pipe.stages) - k - 1)
    return out


def _shared(work: np.ndarray, duty: np.ndarray, cores: float,
            fixed: list[tuple[float, float]], sleeps: bool = False,
            order: Sequence[Sequence[float]] | None = None) -> np.ndarray:
    """Seconds until every rank with work is through it under fluid processor sharing:
    rank ``i`` wants ``duty[i]`` of a core until its ``work[i]`` CPU seconds are done (it
    progresses at ``sigma * duty[i]``); each ``(demand, until)`` of ``fixed`` wants ``demand``
    until that second whatever it gets (a time-boxed probe, the planner).

    With ``sleeps`` a rank at ``duty < 1`` runs as the emulation runs it: each of its compute
    spans (``order[i]``, fractions of its work; default one) at a whole core's demand, getting
    ``sigma`` of one, then a sleep of ``1/duty - 1`` times that span's wall, waits for a core
    included. Its first span runs beside every busy rank, so its waits are a span's, not a
    share spread over the step. Measured (``recover``, 4 data-parallel ranks on 2 cores, 2
    micro-batches each, rank 3 at x9.6): the slowed rank waited 0.029-0.035 s of its 0.165 s,
    its first forward's 0.0275 s beside three busy ranks; spread over the step, 0.012 s."""
    n = work.size
    left = np.where(work > 0, work, 0.0)
    fin = np.zeros(n)
    slept = (duty < 1.0) & (left > 0) if sleeps else np.zeros(n, dtype=bool)
    queue: dict[int, list[float]] = {}
    for i in np.flatnonzero(slept):
        fr = list(order[i]) if order is not None and len(order[i]) else [1.0]
        tot = float(sum(fr))
        queue[int(i)] = [float(work[i]) * f / tot for f in reversed(fr)]   # popped from the end
    cur = np.zeros(n)                        # a sleeper's span left (CPU seconds)
    began = np.zeros(n)                      # ... when its span began
    wake = np.full(n, -np.inf)               # ... when its sleep ends
    for i in queue:
        cur[i] = queue[i].pop()
    active = left > 0
    t = 0.0
    while active.any():
        running = slept & active & (wake <= t)
        fluid = active & ~slept
        demand = (float(duty[fluid].sum()) + float(running.sum())
                  + sum(d for d, end in fixed if end > t))
        sigma = min(1.0, cores / demand) if demand > 0 else 1.0
        speed = sigma * duty
        cand = [float(np.min(left[fluid] / speed[fluid]))] if fluid.any() else []
        if running.any():
            cand.append(float(np.min(cur[running])) / sigma)
        asleep = slept & active & (wake > t)
        if asleep.any():
            cand.append(float(np.min(wake[asleep])) - t)
        cand += [end - t for _, end in fixed if t < end < np.inf]
        dt = max(0.0, min(cand))
        left[fluid] -= speed[fluid] * dt
        cur[running] -= sigma * dt
        t += dt
        done = fluid & (left <= 1e-12 * np.maximum(work, 1.0))
        fin[done] = t
        active &= ~done
        for i in np.flatnonzero(running & (cur <= 1e-12 * np.maximum(work, 1.0))):
            wake[i] = t + (1.0 / duty[i] - 1.0) * (t - began[i])
        for i in np.flatnonzero(slept & active & (wake > -np.inf) & (wake <= t + 1e-15)):
            if queue[int(i)]:
                cur[i], began[i], wake[i] = queue[int(i)].pop(), t, -np.inf
            else:
                fin[i] = max(t, wake[i])
                active[i] = False
    return fin
