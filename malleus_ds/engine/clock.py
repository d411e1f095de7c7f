"""This rank's compute clock: times forward/backward with communication left out, and applies
the straggler emulation (``emulation/straggler.py``) after each timed piece.

The engine's measured rates (``adaptive/rates.py``) and the per-rank ``compute_s`` of metrics.jsonl
come from here. A runner passes its own clock to the engine (``set_compute_clock``); an engine
used on its own keeps one built from ``ds_config.malleus.straggler``.
"""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

from ..emulation.cpu_quota import own_cap

from ..emulation.straggler import Straggler
from ..resilience.watchdog import HEARTBEAT, phase


class ComputeClock:
    """Times this rank's compute and applies the straggler emulation after each timed piece.

    ``compute_s`` (per step) includes the emulated sleep, as a slow GPU would show it;
    ``emulated_s`` is the sleep alone. Communication that happens *inside* a timed span
    (e.g. DeepSpeed reducing gradients in backward hooks, or a TP all-reduce) is left out: wrap it
    in :meth:`excluded` (:func:`exclude_calls`), so a healthy rank waiting for a
    slow peer does not look slow itself.

    One clock, two time sources:

    * CPU: ``time.perf_counter`` around each span (the host runs the work), less the time this
      thread waited, runnable, for a core that another process held (``/proc/thread-self/
      schedstat``), floored by its CPU seconds times its own cgroup's quota (``own_cap``): a
      rank's device is the core it gets. Ranks that share cores (more ranks than cores)
      otherwise count their peers' compute as their own, by the plan's mix: a healthy rank on a
      light share read as a straggler (docs/DESIGN.md §6, "Where the rates' bias comes
      from"). A CPU quota's throttling stays in (the floor), and so does the whole wait under
      ``straggler.method=compete``, whose slowdown *is* that wait;
    * CUDA: a pair of CUDA events per span, recorded on the current stream, nothing synchronised
      while the step runs; the events are read once, when ``compute_s`` is first asked for in a
      step (the host waits there for the GPU: watchdog phase "waiting for the GPU"). An excluded
      span inside a compute span is timed by its own events (an asynchronous NCCL all-reduce's
      wait for a slow peer happens on the stream, between them). A step in which the straggler
      emulation slows this rank synchronises around each span instead: the emulation sleeps on
      the host in proportion to the compute it just measured.
    """

    def __init__(self, straggler: Straggler | None = None, cuda: bool = False,
                 links=None, sleep=time.sleep) -> None:
        self.straggler = straggler
        self.cuda = cuda
        #: the slow-link emulation (``emulation/links.py``'s LinkSchedule; None: none)
        self.links = links if links else None
        self._sleep = sleep
        #: this step's seconds slept by the link emulation after messages and collectives
        self.link_emulated_s = 0.0
        #: where timed communication goes (``comm_log.py``'s CommLog: link rates; None: no log)
        self.comm_log = None
        self._fastest: dict[tuple, float] = {}    # (kind, ranks) -> least seconds per MB seen
        #: CUDA: this step's timed communication as event pairs, (kind, ranks, MB, start, end),
        #: read at the next step's start (:meth:`_read_comm`)
        self._comm_events: list[tuple] = []
        self.step = 0
        self._compute_s = 0.0
        self.emulated_s = 0.0
        #: this step's seconds inside compute spans that are not device time: waits for a core
        #: another process held (CPU; 0 on CUDA), the host's contention (``wait_s`` of a step line)
        self.wait_s = 0.0
        self._excluded = 0.0
        self._ex_depth = 0
        self._in_compute = 0
        self._events: list[tuple[object, object, float]] = []    # (start, end, +1 | -1)
        self._sync = cuda
        method = getattr(getattr(straggler, "schedule", None), "method", "sleep")
        #: CPU spans leave out the waits for a core held by another process (None: wall time)
        self.waits = not cuda and method != "compete" and thread_times() is not None
        self._cap = 1.0                  # this process's CPU quota (read at each step start)
        self._ex_cpu = self._ex_wait = 0.0

    def start_step(self, step: int) -> None:
        self.step, self._compute_s, self.emulated_s, self.wait_s = step, 0.0, 0.0, 0.0
        self.link_emulated_s = 0.0
        if self.comm_log is not None:
            self.comm_log.start_step()
        self._read_comm()
        self._events = []
        self._sync = self.cuda and self._emulating(step)
        if self.straggler is not None:
            self.straggler.at_step(step)    # method=quota|compete: the step's CPU cap
        if self.waits:
            self._cap = own_cap()
        HEARTBEAT.beat("step start", step)

    def _emulating(self, step: int) -> bool:
        """Does the sleep emulation slow this rank at ``step`` (it needs synchronised spans to
        sleep in proportion to them)? A CPU quota or competitors (``method=quota|compete``) slow
        the process itself:
        CUDA events time it like a real slow GPU."""
        st = self.straggler
        return (st is not None and getattr(st.schedule, "method", "sleep") == "sleep"
                and st.schedule.rate(st.rank, step) > 1.0)

    @property
    def events(self) -> bool:
        """Spans are timed by CUDA events this step (not synchronised)."""
        return self.cuda and not self._sync

    @property
    def compute_s(self) -> float:
        """This step's compute seconds so far (reads the step's CUDA events: one wait)."""
        if self._events:
            ev, self._events = self._events, []
            with phase("waiting for the GPU"):
                ev[-1][1].synchronize()
            self._compute_s += sum(sign * a.elapsed_time(b) / 1e3 for a, b, sign in ev)
        return self._compute_s

    def _event_pair(self):
        import torch
        a = torch.cuda.Event(enable_timing=True)
        a.record()
        return a, torch.cuda.Event(enable_timing=True)

    def _read_comm(self) -> None:
        """CUDA: the last step's timed communication, read from its events into the comm log
        (they have completed: the last step's all-reduce was read on the host after them; the
        wait on the last one is a formality). Its ops therefore ride in the all-reduce of the
        step after the one that ran them, as a probe's reading does."""
        ev, self._comm_events = self._comm_events, []
        if not ev or self.comm_log is None:
            return
        with phase("waiting for the GPU"):
            ev[-1][4].synchronize()
        for kind, ranks, mb, a, b in ev:
            self.comm_log.add(kind, ranks, mb, a.elapsed_time(b) / 1e3)

    @contextmanager
    def compute(self):
        if self.events:
            a, b = self._event_pair()
            self._in_compute += 1
            try:
                with phase("forward/backward"):
                    yield
            finally:
                self._in_compute -= 1
                b.record()
                self._events.append((a, b, 1.0))
            return
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        t0, ex0 = time.perf_counter(), self._excluded
        c0, w0 = thread_times() if self.waits else (0.0, 0.0)
        cx0, wx0 = self._ex_cpu, self._ex_wait
        with phase("forward/backward"):
            yield
        if self.cuda:
            import torch
            torch.cuda.synchronize()
        wall = max(0.0, time.perf_counter() - t0 - (self._excluded - ex0))
        dev = wall
        if self.waits:
            c1, w1 = thread_times()
            cpu = (c1 - c0) - (self._ex_cpu - cx0)
            dev = max(0.0, wall - ((w1 - w0) - (self._ex_wait - wx0)), cpu * self._cap)
            # never above the wall: one thread's device time cannot exceed it (a quota's floor
            # overshoots a span shorter than the quota's period, which runs in one burst)
            dev = min(dev, wall)
            self.wait_s += wall - dev
        self.add(dev, wall)

    @contextmanager
    def excluded(self):
        """Time spent in here does not count as compute (re-entrant: outermost span counts)."""
        self._ex_depth += 1
        outer = self._ex_depth == 1
        ev = self._event_pair() if outer and self.events and self._in_compute else None
        t0 = time.perf_counter()
        c0, w0 = thread_times() if outer and self.waits else (0.0, 0.0)
        try:
            with phase("communication"):
                yield
        finally:
            self._ex_depth -= 1
            if ev is not None:
                ev[1].record()
                self._events.append((ev[0], ev[1], -1.0))
            elif self._ex_depth == 0:
                self._excluded += time.perf_counter() - t0
                if self.waits:
                    c1, w1 = thread_times()
                    self._ex_cpu += c1 - c0
                    self._ex_wait += w1 - w0

    def after_comm(self, ranks, seconds: float) -> float:
        """A message or collective between ``ranks`` took ``seconds``: where the link
        emulation slows a link it crosses this step, wait ``(rate - 1) x seconds`` more
        (``emulation/links.py``). Returns the seconds slept."""
        if self.links is None or seconds <= 0:
            return 0.0
        rate = self.links.rate(ranks, self.step)
        if rate <= 1.0:
            return 0.0
        t = (rate - 1.0) * seconds
        with phase("emulated slow link"):
            self._sleep(t)
        self.link_emulated_s += t
        return t

    @contextmanager
    def comm(self, ranks, mb: float = 0.0, kind: str = "p2p"):
        """Time a blocking communication between ``ranks`` (``kind`` "p2p": this rank and the
        peer it receives from; "dp": a bucket's reduction; "tp": a TP collective; "probe": a
        link probe's round trip) moving ``mb``, apply the link
        emulation (:meth:`after_comm`), and log it, the emulated wait included
        (:attr:`comm_log`).

        The emulation waits ``(rate - 1) x`` the *wire's* time, not the wait's: the fastest
        seconds per MB this rank has seen of this communication, times ``mb``. A receive also
        waits for its peer to get there, and in a pipeline across the link the peer may be
        late by its own emulated wait: slowing the whole wait fed that back, message after
        message, and steps grew far beyond ``rate`` times their healthy time. A message never
        seen before (a new plan's) starts from the fastest of its kind:
        the first step after a switch waits for first touches too."""
        if self.links is None and self.comm_log is None:
            yield
            return
        if self.cuda:
            # on the stream: the wait on a NCCL work handle makes the current stream wait, so
            # a pair of events around it times the wait as the host's clock does on CPU. Read
            # a step later (:meth:`_read_comm`), nothing synchronised; where the emulation
            # slows this link now, or for a probe (an isolated exchange after the step), the
            # host waits for the end event: it sleeps in proportion to the time
            slowed = self.links is not None and self.links.rate(ranks, self.step) > 1.0
            if not slowed and kind != "probe" and self.comm_log is None:
                yield                      # nothing would read the events
                return
            a, b = self._event_pair()
            yield
            b.record()
            if not slowed and kind != "probe":
                self._comm_events.append((kind, tuple(ranks), mb, a, b))
                return
            with phase("communication"):
                b.synchronize()
            dt = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            yield
            dt = time.perf_counter() - t0
        base = dt
        if mb > 0 and self.links is not None:      # the wire's time: only the emulation uses it
            key, spm = (kind, tuple(ranks)), dt / mb
            seen = self._fastest.get(key)
            if seen is None:     # never seen (a new plan's first message): the fastest of its
                # kind, else of anything (its first wait holds the new plan's first touches)
                seen = min((v for (k, _), v in self._fastest.items() if k == kind),
                           default=min(self._fastest.values(), default=spm))
            self._fastest[key] = fastest = min(seen, spm)
            base = fastest * mb
        dt += self.after_comm(ranks, base)
        if self.comm_log is not None:
            self.comm_log.add(kind, ranks, mb, dt)

    @contextmanager
    def collective(self, ranks, mb: float, kind: str = "tp"):
        """A collective inside a compute span (a TP all-reduce in forward or backward): left out
        of compute (:meth:`excluded`) and timed as communication (:meth:`comm`)."""
        with self.excluded(), self.comm(ranks, mb, kind):
            yield

    def add(self, seconds: float, wall: float | None = None) -> None:
        """Account ``seconds`` of measured compute (device time: on CPU, net of waits for a core),
        then emulate (sleep) if slowed. ``wall``: the same span by the wall (default
        ``seconds``). The sleep is ``(rate - 1) x wall``, so a slowed rank takes ``rate`` times
        as long as its peers do on shared cores too; it is accounted as ``(rate - 1) x
        seconds``, the same device time (its own wait for a core after waking left out: on
        shared cores a short sleep can take several times its length, and a slowed rank then
        read far slower than its rate)."""
        wall = seconds if wall is None else wall
        slept = 0.0
        if self.straggler is not None:
            w0 = thread_times()[1] if self.waits else 0.0
            slept = self.straggler.after_compute(self.step, wall)
            if self.waits and slept > 0:
                woke = thread_times()[1] - w0
                self.wait_s += woke
                slept = max(0.0, slept - woke)
                slept *= seconds / wall if wall > 0 else 1.0
        self._compute_s += seconds + slept
        self.emulated_s += slept

def exclude_calls(obj, names, clock: ComputeClock) -> list[str]:
    """Wrap the bound methods ``names`` of ``obj`` (instance attributes shadow the class's, so
    internal ``self.name(...)`` calls go through the wrapper; a name-mangled private method is
    named as Python stores it, ``_Class__name``) in ``clock.excluded()``. A name ``obj`` lacks
    is skipped. Returns the names wrapped."""
    done = []
    for name in names:
        fn = getattr(obj, name, None)
        if fn is None:
            continue

        def wrapped(*a, _fn=fn, **kw):
            with clock.excluded():
                return _fn(*a, **kw)

        setattr(obj, name, wrapped)
        done.append(name)
    return done


SCHEDSTAT = "/proc/thread-self/schedstat"


def thread_times(path: str = SCHEDSTAT) -> tuple[float, float] | None:
    """(seconds this thread has run on a CPU, seconds it has waited runnable for one: a core held
    by another process, or its cgroup's quota spent) from the kernel's schedstat; None where it
    cannot be read (not Linux, no ``CONFIG_SCHED_INFO``).

    For this thread (the default path) the run time is ``time.thread_time()``: schedstat's run
    time of a running thread is only brought up to date at a tick or a switch, so two reads
    around a span of a few milliseconds differed from the wall by up to a tick: short spans
    read well above their wall, and the emulation accounted more than it slept. Its wait is
    complete: a running thread's waits all ended when it got its core."""
    try:
        if path == SCHEDSTAT:       # read twice around every compute span: an open file
            run, wait = os.pread(_own_schedstat(), 128, 0).split()[:2]
        else:
            with open(path, "rb") as f:
                run, wait = f.read().split()[:2]
        run_s = time.thread_time() if path == SCHEDSTAT else int(run) / 1e9
        return run_s, int(wait) / 1e9
    except (OSError, ValueError):
        return None


class _Fd(int):
    """A file descriptor closed when the last reference goes (its thread's end)."""

    def __del__(self) -> None:
        try:
            os.close(self)
        except OSError:
            pass


_OWN = threading.local()


def _own_schedstat() -> int:
    """This thread's ``/proc/thread-self/schedstat``, opened once per thread and process (a
    read at offset 0 regenerates it: 2 us against 11 us for open, read and close). The path
    names the thread that opened it, so a forked child opens its own."""
    fd = getattr(_OWN, "fd", None)
    if fd is None or _OWN.pid != os.getpid():
        _OWN.fd, _OWN.pid = _Fd(os.open(SCHEDSTAT, os.O_RDONLY)), os.getpid()
        fd = _OWN.fd
    return fd
