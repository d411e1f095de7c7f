"""Ranks that share a host's CPU cores: the step time of a CPU run, for ``--from-run``.

On a GPU cluster a rank's compute runs on its own device; the host's cores only feed it, and
the replay's step is the cost model's (``run.Replay.step_seconds``). A CPU run is different:
its ranks' compute *is* CPU work, and on a host with fewer cores than busy processes they take
turns. With twice as many busy ranks as cores, each waits about as long as it computes
(``wait_s`` of a step line); a rank that sleeps (an emulated straggler) or has no work hands its
core to the others; the planner's search and a suspended rank's sustained probe take cores too. :class:`SharedHost`
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
* a rank runs its compute as spans, in the order the engine runs them (:func:`plan_graph`: a
  forward and a backward per micro-batch, 1F1B on a pipeline's stages), each once the spans it
  waits for have ended (a stage's forward waits for the previous stage's, its backward for the
  next's; a sleeping rank's span ends with its sleep, which comes before the send), wanting no
  core while it waits; the compute part ends when the last rank is through. The order matters
  where a light stage waits on a busy one: its rank gives up its core while it waits, so the
  step is not the cost model's pipelined floor over the dilated rates;
* the rank that calibrates the probes times the probe block (``ProbeBlock.REF_RUNS`` runs, a
  cost unit each) after a step's all-reduce: it runs them before its next step's compute
  (``lead``), so its probe steps compute that much longer than the others;
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
from typing import Sequence

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
                     searching: bool = False,
                     graph: Sequence[Sequence[Span]] | None = None,
                     lead: Sequence[float] | None = None) -> float:
        """One step's seconds: the ranks' compute (fluid sharing of each host's cores, module
        doc; ``work``: each rank's CPU seconds of it with a core to itself, 0 without work),
        then the non-compute part; the job waits for its slowest host. The planner searches
        on host 0 (rank 0's). A probe wants ``1/r`` of a core (its rank's rate ``r``) for
        ``probe_s`` seconds from the step's start; where the ranks sleep (:attr:`sleeps`: a
        probe does not sustain, it is a few timed runs of the block, the emulation sleeping
        after each), ``probe_s`` is its CPU seconds instead, and its wall ``r`` times them.
        ``graph``: each rank's compute spans in the order it runs them, each a fraction of its
        work and the spans of other ranks it waits for (:func:`plan_graph`: a pipeline's
        1F1B schedule; default: one span each, waiting for nothing). ``lead``: CPU seconds
        each rank runs before its first span (the calibrating rank's probe, timed after the
        last step's all-reduce, at its rank's pace)."""
        u = np.asarray(work, dtype=np.float64)
        r = np.maximum(np.asarray(rates, dtype=np.float64), 1.0)
        p = np.zeros(u.size, dtype=bool) if probing is None else np.asarray(probing, bool)
        n = self.ranks_per_host
        hosts = np.arange(u.size) // n
        fixed = [(1.0 / x, probe_s * x if self.sleeps else probe_s, int(h))
                 for x, h in zip(r[p], hosts[p])] + ([(1.0, np.inf, 0)] if searching else [])
        ends = _shared(u, 1.0 / r, self.cores, fixed, sleeps=self.sleeps, graph=graph,
                       hosts=hosts, lead=lead)
        worst = 0.0
        for h in range(0, u.size, n):
            sl = slice(h, h + n)
            busy = u[sl] > 0
            want = int(busy.sum()) + (1 if searching and h == 0 else 0)
            other = self.other_s / min(1.0, self.cores / want) if want else 0.0
            worst = max(worst, float(ends[sl].max()) + (other if busy.any() else 0.0))
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


#: a compute span: its fraction of the rank's work, and the spans ``(rank, index)`` whose
#: ends (a sleeping rank's: its sleep's) it waits for
Span = tuple[float, tuple[tuple[int, int], ...]]


def one_f_one_b(micro_batches: int, warm: int = 0) -> list[tuple[str, int]]:
    """A pipeline stage's forwards ``("F", j)`` and backwards ``("B", j)`` of micro-batch
    ``j`` in the order it runs them (1F1B): ``warm`` forwards first (a stage's warm-up,
    ``stages - stage - 1``), then a forward and a backward each, then the warm-up's
    backwards."""
    m = int(micro_batches)
    w = max(0, min(int(warm), m - 1))
    seq = [("F", j) for j in range(w)]
    for j in range(m - w):
        seq += [("F", w + j), ("B", j)]
    return seq + [("B", j) for j in range(m - w, m)]


def spans(micro_batches: int, warm: int = 0) -> tuple[float, ...]:
    """A rank's compute spans in a step, in the order it runs them (:func:`one_f_one_b`), as
    fractions of its work: a forward is 1 part and a backward 2 per micro-batch, as the engine
    times them (``ComputeClock.compute`` around each instruction)."""
    m = int(micro_batches)
    return tuple((1.0 if k == "F" else 2.0) / (3.0 * m) for k, _ in one_f_one_b(m, warm))


def plan_graph(plan, num_ranks: int) -> list[tuple[Span, ...]]:
    """Each rank's compute spans under ``plan`` (:func:`spans`) and what each waits for: a
    stage's forward of micro-batch ``j`` the previous stage's (its activations), its backward
    the next stage's (their gradients), each after its sender's sleep (the emulation sleeps
    before the send); a rank of a tensor-parallel stage its peers' previous span (their
    collectives). A suspended rank has none."""
    out: list[tuple[Span, ...]] = [()] * num_ranks
    for pipe in plan.pipelines:
        S, m = len(pipe.stages), pipe.micro_batches
        seqs = [one_f_one_b(m, S - k - 1) for k in range(S)]
        at = [{x: i for i, x in enumerate(seq)} for seq in seqs]
        for k, st in enumerate(pipe.stages):
            for r in st.ranks:
                row = []
                for i, ((kind, j), frac) in enumerate(zip(seqs[k], spans(m, S - k - 1))):
                    nb = k - 1 if kind == "F" else k + 1
                    deps = ([(q, at[nb][(kind, j)]) for q in pipe.stages[nb].ranks]
                            if 0 <= nb < S else [])
                    if i > 0:
                        deps += [(q, i - 1) for q in st.ranks if q != r]
                    row.append((frac, tuple(deps)))
                out[r] = tuple(row)
    return out


def _span_rows(work: np.ndarray, graph: Sequence[Sequence[Span]] | None,
               lead: Sequence[float] | None) -> list[list[tuple[float, tuple]]]:
    """Each rank's spans as (CPU seconds, the spans it waits for): its lead first, then its
    graph's fractions of its work (default: one span); none for a rank without work."""
    rows: list[list[tuple[float, tuple]]] = []
    for i in range(work.size):
        g = list(graph[i]) if graph is not None and len(graph[i]) else [(1.0, ())]
        tot = float(sum(f for f, _ in g))
        first = [(float(lead[i]), ())] if lead is not None and lead[i] > 0 else []
        rows.append(first + [(float(work[i]) * f / tot, tuple(d)) for f, d in g]
                    if work[i] > 0 else [])
    return rows


def _speeds(hid: np.ndarray, run: np.ndarray, want: np.ndarray,
            fixed: Sequence[tuple[float, float, int]], t: float, nh: int, cores: float
            ) -> np.ndarray:
    """Each rank's progress per second at ``t``: its want times its host's share ``sigma =
    min(1, cores / demand)``, the demand of the running spans and of the fixed loads still
    on."""
    demand = np.bincount(hid[run], weights=want[run], minlength=nh).astype(np.float64)
    for d, until, h in fixed:
        if until > t:
            demand[h] += d
    sigma = np.minimum(1.0, cores / np.maximum(demand, 1e-300))
    return sigma[hid] * want


def _next_event(run_left: np.ndarray, sleep_left: np.ndarray,
                fixed: Sequence[tuple[float, float, int]], t: float) -> float | None:
    """Seconds from ``t`` to the next event: a running span's end, a sleeping rank's wake-up or
    a fixed load's end (None: nothing is running, sleeping or timed)."""
    cand = list(run_left) + list(sleep_left)
    cand += [until - t for _, until, _ in fixed if t < until < np.inf]
    return max(0.0, min(cand)) if cand else None


#: a rank's state in :func:`_shared`: waiting for a span's inputs, running it, sleeping after
#: it (the sleep emulation), through its work
_WAIT, _RUN, _SLEEP, _DONE = 0, 1, 2, 3


def _shared(work: np.ndarray, duty: np.ndarray, cores: float,
            fixed: Sequence[tuple[float, float, int]] = (), sleeps: bool = False,
            graph: Sequence[Sequence[Span]] | None = None,
            hosts: Sequence[int] | None = None,
            lead: Sequence[float] | None = None) -> np.ndarray:
    """Seconds until every rank with work is through it under fluid processor sharing of each
    host's ``cores`` (``hosts``: each rank's host, default one): rank ``i`` runs its spans
    (``graph[i]``, fractions of its ``work[i]`` CPU seconds; default one) in order, each once
    the spans it waits for have ended, wanting ``duty[i]`` of a core while it runs one (it
    progresses at ``sigma * duty[i]``) and none while it waits; each ``(demand, until,
    host)`` of ``fixed`` wants ``demand`` until that second whatever it gets (a time-boxed
    probe, the planner). A rank with work first runs ``lead[i]`` CPU seconds, waiting for none.

    With ``sleeps`` a rank at ``duty < 1`` runs as the emulation runs it: each span at a
    whole core's demand, getting ``sigma`` of one, then a sleep of ``1/duty - 1`` times that
    span's wall, waits for a core included; its span ends with its sleep. Its first span runs
    beside every busy rank, so its waits are a span's, not a share spread over the step."""
    n = work.size
    hid = np.zeros(n, dtype=int) if hosts is None else np.asarray(hosts, dtype=int)
    nh = int(hid.max()) + 1 if n else 1
    rows = _span_rows(work, graph, lead)
    slept = (duty < 1.0) & (work > 0) if sleeps else np.zeros(n, dtype=bool)
    want = np.where(slept, 1.0, duty)           # a core's share while a span runs
    eps = 1e-12 * np.maximum(work, 1.0)
    done: set[tuple[int, int]] = set()          # spans ended (sleeps included)
    idx = np.zeros(n, dtype=int)
    state = np.where(work > 0, _WAIT, _DONE)
    left, began, wake, fin = np.zeros(n), np.zeros(n), np.zeros(n), np.zeros(n)
    t = 0.0

    def end_span(i: int, at: float) -> None:
        done.add((i, int(idx[i])))
        idx[i] += 1
        if idx[i] == len(rows[i]):
            state[i], fin[i] = _DONE, at
        else:
            state[i] = _WAIT

    while True:
        for i in np.flatnonzero(state == _WAIT):
            w, deps = rows[i][idx[i]]
            if all(d in done for d in deps):
                state[i], left[i], began[i] = _RUN, w, t
        if (state == _DONE).all():
            return fin
        run = state == _RUN
        speed = _speeds(hid, run, want, fixed, t, nh, cores)
        dt = _next_event(left[run] / speed[run], wake[state == _SLEEP] - t, fixed, t)
        if dt is None:
            stuck = [(int(i), int(idx[i])) for i in np.flatnonzero(state == _WAIT)]
            raise ValueError(f"_shared: spans {stuck} wait for spans that never end")
        left[run] -= speed[run] * dt
        t += dt
        for i in np.flatnonzero(run & (left <= eps)):
            if slept[i]:
                state[i], wake[i] = _SLEEP, t + (1.0 / duty[i] - 1.0) * (t - began[i])
            else:
                end_span(int(i), t)
        for i in np.flatnonzero((state == _SLEEP) & (wake <= t + 1e-12)):
            end_span(int(i), max(t, float(wake[i])))
