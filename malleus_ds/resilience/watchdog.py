"""Hung-rank watchdog: a frozen rank is the extreme straggler, and must not hang the job silently.

Every rank keeps a :data:`HEARTBEAT` (step, phase, a progress counter bumped at every phase
change) that the runners and the engine update as they go: ``forward/backward`` (the compute
clock), ``all-reduce``, ``p2p``, ``migration``, ``checkpoint``. A daemon thread per rank
(:class:`Watchdog`) publishes it through the job's store every ``interval`` seconds together
with a tick that advances as long as the process runs (a SIGSTOPped or crashed process stops
ticking; one blocked in a collective keeps ticking).

Rank 0's thread reads every rank's record. When some rank has made no progress for
``hang_timeout_s`` (top-level config key; 0 = off), :func:`find_stuck` names the culprits: ranks
whose tick stopped, else ranks stuck outside communication, else (everyone waits in
communication: a mismatched collective) the ranks furthest behind. Rank 0 publishes the report;
every live rank prints it (which rank, step, phase, for how long), rank 0 appends a
``{"event": "hang", ...}`` line to metrics.jsonl, and every rank exits with
:data:`HANG_EXIT_CODE`, so a scheduler can restart the job from its last checkpoint. The other
ranks also watch rank 0's tick, so a frozen rank 0 is reported too.

The store itself can stop answering: with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (what a
node that rejoins needs) it lives in rank 0's process, and a frozen rank 0 freezes it. Every
rank's thread then finds no record to read, so each one counts how long the store has been
silent; after ``hang_timeout_s`` it reports that (:meth:`Watchdog._store_lost_report`), ends a
stopped peer on its own host, and exits like any other hang. A second thread judges that: a
TCPStore call to a stopped host can block for good (``check`` waits past the client's timeout),
and the thread inside it could never report.

The process-group timeout (``comm_timeout_s``) stays the backstop for what this cannot see.
The decision (:func:`find_stuck`) is pure and tested without processes.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Mapping

#: the exit status of every rank of a job the watchdog stopped
HANG_EXIT_CODE = 3
#: phases in which a rank waits for its peers (a rank stuck there is a victim, not a culprit).
#: On a GPU the host does not block in a collective or a receive (NCCL queues them on the
#: stream); it blocks where it reads results: the step's timing events and the loss all-reduce
#: ("waiting for the GPU", ``clock.py``; "all-reduce" around the read). A rank stuck there waits
#: for queued transfers as much as for its own kernels, so it is not evidence against itself;
#: NCCL's flight recorder (``TORCH_NCCL_DUMP_ON_TIMEOUT``) names the operation.
COMM_PHASES = frozenset({"all-reduce", "all-gather", "p2p", "migration", "checkpoint",
                         "barrier", "broadcast", "communication", "waiting for the GPU"})
#: phases that may legitimately take longer than ``hang_timeout_s`` without a beat (building or
#: loading a large model, writing a checkpoint): while a live rank is in one, nobody is stalled
#: (a *frozen* process is still reported)
PATIENT_PHASES = frozenset({"start-up", "checkpoint"})


class Heartbeat:
    """This rank's progress: plain attribute writes, cheap enough for every phase change."""

    def __init__(self) -> None:
        self.step = -1
        self.phase = "start-up"
        self.progress = 0
        self.done = False

    def beat(self, phase: str, step: int | None = None) -> None:
        if step is not None:
            self.step = step
        self.phase = phase
        self.progress += 1


HEARTBEAT = Heartbeat()


@contextmanager
def phase(name: str):
    """``with phase("all-reduce"): ...`` — the heartbeat names ``name`` while inside, and the
    phase around it again afterwards (each change counts as progress)."""
    hb = HEARTBEAT
    outer = hb.phase
    hb.beat(name)
    try:
        yield
    finally:
        hb.beat(outer)


@dataclass
class RankView:
    """What the watcher knows of one rank: its last record and, on the watcher's own clock,
    when its tick and its progress last changed."""

    record: dict
    tick_at: float
    progress_at: float


def find_stuck(views: Mapping[int, RankView], now: float, hang_timeout_s: float,
               frozen_after_s: float) -> dict | None:
    """The hang report, or None while every rank progresses (pure).

    A hang: some rank (not done) has made no progress for ``hang_timeout_s``, and no live rank
    is in a :data:`PATIENT_PHASES` phase (unless some process is frozen). Culprits, in
    order of evidence: ranks whose tick stopped for ``frozen_after_s`` (the process is not
    running), else stalled ranks outside a communication phase, else the stalled ranks with the
    lowest step (all wait in communication: a collective some rank never joined)."""
    live = {r: v for r, v in views.items() if not v.record.get("done")}
    stalled = {r: v for r, v in live.items() if now - v.progress_at >= hang_timeout_s}
    if not stalled:
        return None
    frozen = [r for r, v in live.items() if now - v.tick_at >= frozen_after_s]
    patient = [r for r, v in live.items()
               if v.record.get("phase") in PATIENT_PHASES and r not in frozen]
    if patient and not frozen:
        return None             # the others wait for a long start-up or checkpoint write
    outside = [r for r, v in stalled.items() if v.record.get("phase") not in COMM_PHASES]
    if frozen:
        culprits, why = frozen, "its process stopped responding (no heartbeat)"
    elif outside:
        culprits, why = outside, "no progress outside communication"
    else:
        low = min(v.record.get("step", -1) for v in stalled.values())
        culprits = [r for r, v in stalled.items() if v.record.get("step", -1) == low]
        why = "every stalled rank waits in communication (a collective some rank never joined)"
    ranks = []
    for r in sorted(culprits):
        v = live[r]
        ranks.append({"rank": r, "step": v.record.get("step"), "phase": v.record.get("phase"),
                      "stalled_s": round(now - v.progress_at, 1)})
        if frozen and "pid" in v.record:    # where it is: a peer on its host can end it
            ranks[-1].update(frozen=True, host=v.record.get("host"), pid=v.record["pid"],
                             started=v.record.get("started"))
    waiting = [{"rank": r, "step": v.record.get("step"), "phase": v.record.get("phase"),
                "stalled_s": round(now - v.progress_at, 1)}
               for r, v in sorted(stalled.items()) if r not in culprits]
    return {"event": "hang", "stuck": ranks, "waiting": waiting, "reason": why,
            "hang_timeout_s": hang_timeout_s}


def format_hang(report: dict) -> str:
    """One line a person reads first: who is stuck, where, for how long."""
    stuck = "; ".join(f"rank {s['rank']} in step {s['step']} ({s['phase']}) for {s['stalled_s']} s"
                      for s in report["stuck"])
    wait = ", ".join(str(w["rank"]) for w in report.get("waiting", []))
    if report.get("gone"):        # Watchdog._gone_report: at once, not after hang_timeout_s
        return f"rank(s) gone: {stuck} — {report['reason']}; stopping the job"
    if report.get("store_lost"):  # Watchdog._store_lost_report: no record could be read
        return (f"hang: {report['reason']}" + (f"; stopped on this host: {stuck}" if stuck else "")
                + "; stopping the job")
    return (f"hang: {stuck} — {report['reason']}; no progress for >= "
            f"{report['hang_timeout_s']} s (hang_timeout_s)"
            + (f"; ranks {wait} wait for it" if wait else "") + "; stopping the job")


class Watchdog:
    """One per rank (see the module doc). ``store``: a ``torch.distributed.Store`` all ranks
    share; ``on_hang(report)``: rank 0's hook to log the event before the process exits."""

    def __init__(self, store, rank: int, world: int, hang_timeout_s: float,
                 on_hang: Callable[[dict], None] | None = None, interval_s: float | None = None,
                 prefix: str = "malleus_wd", exit: Callable[[int], None] = os._exit,
                 heartbeat: Heartbeat = HEARTBEAT) -> None:
        self.store, self.rank, self.world = store, rank, world
        self.timeout = float(hang_timeout_s)
        self.interval = interval_s or min(1.0, max(0.05, self.timeout / 10))
        self.frozen_after = max(5 * self.interval, min(self.timeout, 5.0))
        self.on_hang, self.prefix, self._exit, self.hb = on_hang, prefix, exit, heartbeat
        self._tick = 0
        self._left = False        # this rank is exiting on a report: not itself a lost rank
        self._whoami = whoami()
        self._views: dict[int, RankView] = {}
        self._store_ok_at = time.monotonic()    # when the store last answered this thread
        self._stop = threading.Event()
        self._fired = threading.Lock()      # one report per process: the thread's or the caller's
        self._thread = threading.Thread(target=self._run, name="malleus-watchdog", daemon=True)
        self._judge = threading.Thread(target=self._watch_store, name="malleus-watchdog-store",
                                       daemon=True)

    def key(self, r: int) -> str:
        return f"{self.prefix}/hb/{r}"

    def start(self) -> "Watchdog":
        self._publish()
        self._store_ok_at = time.monotonic()
        self._thread.start()
        self._judge.start()
        return self

    def stop(self) -> None:
        """This rank finished: mark it done (never a culprit) and end the thread."""
        self.hb.done = True
        self._stop.set()
        # join before the process exits: a daemon thread left inside a store call while the
        # interpreter shuts down can abort the process after a run that succeeded
        for t in (self._thread, self._judge):
            if t.is_alive():
                t.join(timeout=10)
        try:
            self._publish()
        except Exception:  # noqa: BLE001 - the store may be gone at exit
            pass

    def gone_peers(self, seen: dict[int, tuple[int, float]]) -> list[int]:
        """Ranks whose process is gone: on this host, a published pid that no longer names the
        same process (at once); elsewhere, a heartbeat tick unchanged for ``frozen_after``
        (``seen``: the caller's memory of each rank's last tick and when it changed, updated
        here). A rank that finished (``done``) is never gone. Reads the store; any thread."""
        now, out = time.monotonic(), []
        for r, rec in self._read([r for r in range(self.world) if r != self.rank]).items():
            if rec.get("done"):
                continue
            local = self._process_gone(rec)
            if local is not None:
                if local:
                    out.append(r)
                continue
            tick, since = seen.get(r, (None, now))
            if rec.get("tick") != tick:
                seen[r] = (rec.get("tick"), now)
            elif now - since >= self.frozen_after:
                out.append(r)
        return sorted(out)

    def _process_gone(self, rec: dict) -> bool | None:
        """For a rank's published record: on this host, whether its pid no longer names the
        same process (killed, OOM, a segfault); None when it runs elsewhere (or published no
        pid), where only its heartbeat can tell."""
        from .procs import is_alive

        if rec.get("host") != self._whoami.get("host") or not isinstance(rec.get("pid"), int):
            return None
        return not is_alive(rec["pid"], rec.get("started"))

    # -- the thread ---------------------------------------------------------------------------

    def _publish(self) -> None:
        self._tick += 1
        hb = self.hb
        self.store.set(self.key(self.rank), json.dumps(
            {"tick": self._tick, "progress": hb.progress, "step": hb.step, "phase": hb.phase,
             "done": hb.done, "left": self._left, **self._whoami}))

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._publish()
                report = self._watch_all() if self.rank == 0 else self._watch_rank0()
                self._store_ok_at = time.monotonic()
            except Exception:  # noqa: BLE001 - store unreachable: _watch_store judges that
                continue
            if report is not None and not self._stop.is_set():
                self._fire(report)
                return

    def _watch_store(self) -> None:
        """The second thread: reports once the first has gone ``hang_timeout_s`` without a
        round of store calls that all answered (it may be blocked inside one)."""
        while not self._stop.wait(self.interval):
            report = self._store_lost_report(time.monotonic())
            if report is not None and not self._stop.is_set():
                self._fire(report)
                return

    def _read(self, ranks) -> dict[int, dict]:
        keys = [self.key(r) for r in ranks]
        present = [r for r, k in zip(ranks, keys) if self.store.check([k])]
        if not present:
            return {}
        vals = self.store.multi_get([self.key(r) for r in present])
        return {r: json.loads(v) for r, v in zip(present, vals)}

    def _update(self, recs: Mapping[int, dict], now: float) -> None:
        for r, rec in recs.items():
            v = self._views.get(r)
            if v is None:
                self._views[r] = RankView(rec, now, now)
                continue
            if rec["tick"] != v.record["tick"]:
                v.tick_at = now
            if rec["progress"] != v.record["progress"] or rec["step"] != v.record["step"]:
                v.progress_at = now
            v.record = rec

    def _watch_all(self) -> dict | None:
        now = time.monotonic()
        self._update(self._read(range(self.world)), now)
        report = (self._gone_report(now)
                  or find_stuck(self._views, now, self.timeout, self.frozen_after))
        if report is not None:
            self.store.set(f"{self.prefix}/hang", json.dumps(report))
        return report

    def end_if_peers_gone(self) -> None:
        """Called when a collective failed (gloo: "connection closed by peer"): if a rank on
        this host has no process any more, report it as the watchdog would and exit
        (``HANG_EXIT_CODE``), so the failure is named and logged whichever saw it first, the
        collective or the watchdog's thread. Returns when no such rank is found."""
        now = time.monotonic()
        try:
            self._update(self._read([r for r in range(self.world) if r != self.rank]), now)
        except Exception:  # noqa: BLE001 - store unreachable: nothing to tell
            return
        report = self._gone_report(now)
        if report is not None:
            if self.rank == 0:
                try:
                    self.store.set(f"{self.prefix}/hang", json.dumps(report))
                except Exception:  # noqa: BLE001 - the others find out by themselves
                    pass
            self._fire(report)

    def _gone_report(self, now: float) -> dict | None:
        """A report at once when the process of a rank on this host is gone (killed, OOM, a
        segfault): no collective or agreement with it can complete, and its launcher may be
        gone too (a lost node), so nobody else would end the job before ``hang_timeout_s``."""
        gone = [r for r, v in sorted(self._views.items())
                if r != self.rank and not v.record.get("done") and not v.record.get("left")
                and self._process_gone(v.record)]
        if not gone:
            return None
        stuck = [{"rank": r, "step": self._views[r].record.get("step"),
                  "phase": self._views[r].record.get("phase"),
                  "stalled_s": round(now - self._views[r].progress_at, 1)} for r in gone]
        return {"event": "hang", "stuck": stuck, "waiting": [], "gone": True,
                "reason": "its process is gone (killed, out of memory or crashed)",
                "hang_timeout_s": self.timeout}

    def _store_lost_report(self, now: float) -> dict | None:
        """The report once the store has not answered for ``hang_timeout_s`` (None before):
        the process hosting it is stopped or gone, and no rank can read another's record.
        Culprits: the ranks last seen on this host whose process is stopped (SIGSTOP), marked
        frozen so :func:`end_frozen_peers` ends them (their launcher restarts the job);
        elsewhere nobody can be named."""
        from .procs import is_stopped

        silent = now - self._store_ok_at
        if silent < max(self.timeout, self.frozen_after) or self.hb.done:
            return None
        host = self._whoami.get("host")
        stuck = [{"rank": r, "step": v.record.get("step"), "phase": v.record.get("phase"),
                  "stalled_s": round(now - v.progress_at, 1), "frozen": True, "host": host,
                  "pid": v.record["pid"], "started": v.record.get("started")}
                 for r, v in sorted(self._views.items())
                 if r != self.rank and v.record.get("host") == host and not v.record.get("done")
                 and isinstance(v.record.get("pid"), int)
                 and is_stopped(v.record["pid"], v.record.get("started"))]
        addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        return {"event": "hang", "stuck": stuck, "waiting": [], "store_lost": True,
                "reason": f"the job's store ({addr}) has not answered for {silent:.0f} s: the "
                          f"process hosting it (rank 0's, with "
                          f"TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1; else the launcher) is "
                          f"stopped or gone",
                "hang_timeout_s": self.timeout}

    def _watch_rank0(self) -> dict | None:
        if self.store.check([f"{self.prefix}/hang"]):
            return json.loads(self.store.get(f"{self.prefix}/hang"))
        now = time.monotonic()
        self._update(self._read([0]), now)
        gone = self._gone_report(now)        # rank 0 itself, on this host
        if gone is not None:
            return gone
        v = self._views.get(0)
        if v is None or v.record.get("done") or now - v.tick_at < max(self.timeout,
                                                                       self.frozen_after):
            return None
        return find_stuck({0: v}, now, self.timeout, self.frozen_after)

    def _fire(self, report: dict) -> None:
        if not self._fired.acquire(blocking=False):
            while True:         # the other reporter (thread or caller) is ending the process
                time.sleep(1.0)
        self._left = True
        try:            # the peers must not count this rank's exit as one more lost rank
            if not report.get("store_lost"):       # else it would wait out the store's timeout
                self._publish()
        except Exception:  # noqa: BLE001 - the store may be gone
            pass
        print(f"[malleus_ds] rank {self.rank}: {format_hang(report)}", file=sys.stderr,
              flush=True)
        for r, pid in end_frozen_peers(report, self.rank, self._whoami.get("host")):
            print(f"[malleus_ds] rank {self.rank}: killed frozen rank {r} (pid {pid}, same host): "
                  f"a stopped process cannot act on its launcher's SIGTERM, which would hold "
                  f"the job for the launcher's grace period (30 s)", file=sys.stderr, flush=True)
        if self.on_hang is not None:
            try:
                self.on_hang(report)
            except Exception as e:  # noqa: BLE001 - exiting anyway; say why the log lacks it
                print(f"[malleus_ds] rank {self.rank}: could not log the hang event: {e}",
                      file=sys.stderr, flush=True)
        if self.rank == 0:      # let the other ranks read the report before the store goes
            time.sleep(min(3.0, 3 * self.interval + 0.5))
        sys.stdout.flush()
        self._exit(HANG_EXIT_CODE)


def whoami() -> dict:
    """Where this rank runs (host, pid, start time): published with the heartbeat, so a peer on
    the same host can end this process if it freezes."""
    import socket

    from .procs import start_time

    pid = os.getpid()
    return {"host": socket.gethostname(), "pid": pid, "started": start_time(pid)}


def end_frozen_peers(report: dict, me: int, host: str | None,
                     kill=os.kill) -> list[tuple[int, int]]:
    """SIGKILL the frozen culprits of ``report`` that run on ``host`` (not rank ``me``), if
    their pid still names the same process. A stopped (SIGSTOP, or frozen by a debugger) process
    cannot act on the SIGTERM its launcher sends when the other ranks exit: torchrun and
    deepspeed.launcher.launch then wait 30 s before their own SIGKILL. The job is being stopped
    anyway; this ends it now. Returns [(rank, pid)] killed."""
    import signal

    from .procs import is_alive

    out = []
    for s in report.get("stuck", ()):
        if not s.get("frozen") or s.get("rank") == me or s.get("host") != host or not host:
            continue
        pid = s.get("pid")
        if not isinstance(pid, int) or pid == os.getpid() or not is_alive(pid, s.get("started")):
            continue
        try:
            kill(pid, signal.SIGKILL)
            out.append((s["rank"], pid))
        except (ProcessLookupError, PermissionError):
            pass
    return out


def watchdog_store(timeout_s: float):
    """A store client of its own for the watchdog thread (the job's store at MASTER_ADDR /
    MASTER_PORT, as torchrun and the deepspeed launcher set them), with a short timeout so a
    stopped store host cannot block the thread. None when there is no such store."""
    from datetime import timedelta

    import torch.distributed as dist

    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    return dist.TCPStore(addr, int(port), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
