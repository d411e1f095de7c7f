"""The hung-rank watchdog's decision (pure) and its thread against an in-memory store."""
import json
import os
import time

import pytest

from malleus_ds.report.metrics import MetricsBusy, MetricsWriter
from malleus_ds.resilience.watchdog import (
    HANG_EXIT_CODE,
    Heartbeat,
    RankView,
    Watchdog,
    find_stuck,
    format_hang,
    phase,
    HEARTBEAT)


def view(step, ph, tick_age, progress_age, now=100.0, done=False):
    return RankView({"step": step, "phase": ph, "tick": 1, "progress": 1, "done": done},
                    now - tick_age, now - progress_age)


def test_no_report_while_every_rank_progresses():
    views = {0: view(5, "all-reduce", 0, 3), 1: view(5, "forward/backward", 0, 1)}
    assert find_stuck(views, 100.0, 10, 5) is None


def test_a_frozen_rank_is_the_culprit_and_its_peers_wait():
    views = {0: view(7, "all-reduce", 0.5, 12), 1: view(7, "forward/backward", 12, 12),
             2: view(7, "p2p", 0.5, 11)}
    rep = find_stuck(views, 100.0, 10, 5)
    assert [s["rank"] for s in rep["stuck"]] == [1]
    assert rep["stuck"][0] == {"rank": 1, "step": 7, "phase": "forward/backward",
                               "stalled_s": 12.0}
    assert [w["rank"] for w in rep["waiting"]] == [0, 2]
    line = format_hang(rep)
    assert "rank 1 in step 7 (forward/backward) for 12.0 s" in line and "ranks 0, 2 wait" in line


def test_a_rank_stuck_in_compute_while_alive_is_named():
    views = {0: view(3, "all-gather", 0.2, 15), 1: view(3, "forward/backward", 0.2, 15)}
    rep = find_stuck(views, 100.0, 10, 5)
    assert [s["rank"] for s in rep["stuck"]] == [1] and "outside communication" in rep["reason"]


def test_waiting_for_the_gpu_is_waiting_not_evidence():
    """On NCCL the host blocks reading the step's events (queued receives and all-reduces sit
    on the stream): a rank there is not blamed over one stuck in its own compute."""
    views = {0: view(3, "waiting for the GPU", 0.2, 15), 1: view(3, "forward/backward", 0.2, 15)}
    rep = find_stuck(views, 100.0, 10, 5)
    assert [s["rank"] for s in rep["stuck"]] == [1]
    views = {0: view(4, "waiting for the GPU", 0.2, 15), 1: view(3, "waiting for the GPU", 0.2, 15)}
    assert [s["rank"] for s in find_stuck(views, 100.0, 10, 5)["stuck"]] == [1]


def test_everyone_in_communication_names_the_ranks_behind():
    views = {0: view(4, "all-reduce", 0.2, 15), 1: view(3, "p2p", 0.2, 15),
             2: view(4, "all-reduce", 0.2, 15)}
    rep = find_stuck(views, 100.0, 10, 5)
    assert [s["rank"] for s in rep["stuck"]] == [1] and "never joined" in rep["reason"]


def test_finished_ranks_are_never_culprits():
    views = {0: view(9, "all-reduce", 0.2, 3), 1: view(9, "done", 30, 30, done=True)}
    assert find_stuck(views, 100.0, 10, 5) is None


def test_long_start_up_or_checkpoint_is_not_a_hang_but_a_frozen_process_is():
    for ph in ("start-up", "checkpoint"):
        views = {0: view(-1 if ph == "start-up" else 9, ph, 0.3, 400),
                 1: view(-1 if ph == "start-up" else 9, "all-reduce", 0.3, 400)}
        assert find_stuck(views, 100.0, 10, 5) is None, ph
    views = {0: view(-1, "start-up", 0.3, 400), 1: view(-1, "start-up", 30, 400)}
    assert [s["rank"] for s in find_stuck(views, 100.0, 10, 5)["stuck"]] == [1]


def test_phase_context_restores_and_counts_progress():
    hb = HEARTBEAT
    before, outer = hb.progress, hb.phase
    with phase("p2p"):
        assert hb.phase == "p2p"
    assert hb.phase == outer and hb.progress == before + 2


def test_watchdog_thread_reports_a_silent_rank_and_exits():
    """Rank 1 publishes once and then never again (as a SIGSTOPped process): rank 0's thread
    names it within the timeout, logs the event, and exits with HANG_EXIT_CODE; rank 1's
    (if it were alive) would read the published report."""
    import torch.distributed as dist

    store = dist.HashStore()
    exits, logged = [], []
    hb0, hb1 = Heartbeat(), Heartbeat()
    hb1.beat("forward/backward", 4)
    silent = Watchdog(store, 1, 2, 0.6, heartbeat=hb1, interval_s=0.05)
    silent._publish()                       # one record, then silence
    dog = Watchdog(store, 0, 2, 0.6, on_hang=logged.append, interval_s=0.05,
                   exit=exits.append, heartbeat=hb0)
    hb0.beat("all-reduce", 4)
    t0 = time.monotonic()
    dog.start()
    while not exits and time.monotonic() - t0 < 60:        # at once, but for a starved CPU
        time.sleep(0.05)
    assert exits == [HANG_EXIT_CODE], "rank 0 never reported"
    assert logged and logged[0]["stuck"][0]["rank"] == 1 and logged[0]["stuck"][0]["step"] == 4
    assert json.loads(store.get("malleus_wd/hang"))["stuck"][0]["rank"] == 1
    other = Watchdog(store, 1, 2, 0.6, heartbeat=Heartbeat(), interval_s=0.05)
    assert other._watch_rank0()["stuck"][0]["rank"] == 1     # the report reaches the others


def test_watchdog_stays_quiet_while_ranks_progress():
    import threading

    import torch.distributed as dist

    store = dist.HashStore()
    exits = []
    hbs = [Heartbeat(), Heartbeat()]
    dogs = [Watchdog(store, r, 2, 0.5, interval_s=0.05, exit=exits.append, heartbeat=hbs[r])
            for r in range(2)]
    for d in dogs:
        d.start()
    stop = threading.Event()

    def work():
        k = 0
        while not stop.is_set():
            for hb in hbs:
                hb.beat("forward/backward", k)
            k += 1
            time.sleep(0.05)

    t = threading.Thread(target=work)
    t.start()
    time.sleep(1.5)
    stop.set()
    t.join()
    for d in dogs:
        d.stop()
    assert exits == []


def test_a_second_live_writer_of_the_same_metrics_file_is_refused(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write_event({"event": "x"})
    with pytest.raises(MetricsBusy, match="another live run"):
        MetricsWriter(tmp_path)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"event": "x"}\n'
    w.close()
    MetricsWriter(tmp_path).close()         # free again once the first run closed it


def test_the_report_says_where_a_frozen_rank_runs():
    views = {0: RankView({"tick": 5, "progress": 9, "step": 3, "phase": "all-reduce",
                          "host": "h", "pid": 11, "started": 7}, 100.0, 90.0),
             1: RankView({"tick": 2, "progress": 4, "step": 3, "phase": "forward/backward",
                          "host": "h", "pid": 12, "started": 8}, 80.0, 80.0)}
    rep = find_stuck(views, 100.0, hang_timeout_s=5, frozen_after_s=5)
    assert rep["stuck"] == [{"rank": 1, "step": 3, "phase": "forward/backward", "stalled_s": 20.0,
                             "frozen": True, "host": "h", "pid": 12, "started": 8}]


class _Freezable:
    """A store that stops answering when told (its host process SIGSTOPped): a call then blocks
    until ``thaw`` (a TCPStore client's ``check`` to a stopped host blocks past its timeout)."""

    def __init__(self):
        import threading

        import torch.distributed as dist

        self.inner, self.frozen, self.thaw = dist.HashStore(), False, threading.Event()

    def __getattr__(self, name):
        fn = getattr(self.inner, name)

        def call(*a, **k):
            if self.frozen:
                self.thaw.wait(120)
                raise RuntimeError("store timeout (test)")
            return fn(*a, **k)
        return call


def test_a_store_that_stops_answering_is_a_hang_and_a_stopped_host_on_this_host_is_ended():
    """The long fault campaign's seed 45: rank 0 SIGSTOPped while it hosts the workers' store
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1). No rank could read any record, so no watchdog
    reported, for 400 s. Now every rank counts the store's silence: after hang_timeout_s it
    reports, and a peer on rank 0's host ends the stopped process."""
    import signal
    import subprocess
    import sys

    from malleus_ds.resilience.procs import is_alive, start_time

    host0 = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    store, exits, dog = _Freezable(), [], None
    try:
        hb0 = Heartbeat()
        hb0.beat("forward/backward", 13)
        rank0 = Watchdog(store, 0, 2, 0.6, heartbeat=hb0, interval_s=0.05)
        rank0._whoami = dict(rank0._whoami, pid=host0.pid, started=start_time(host0.pid))
        rank0._publish()
        reports = []
        dog = Watchdog(store, 1, 2, 0.6, interval_s=0.05, exit=exits.append,
                       heartbeat=Heartbeat(), on_hang=reports.append)
        dog.start()
        while 0 not in dog._views:             # it has seen rank 0's record (pid, host)
            rank0._publish()                   # ticking: no ordinary report meanwhile
            time.sleep(0.01)
        os.kill(host0.pid, signal.SIGSTOP)
        store.frozen = True
        t0 = time.monotonic()
        while not exits and time.monotonic() - t0 < 60:     # 0.6 s, but for a starved CPU
            time.sleep(0.05)
        assert exits == [HANG_EXIT_CODE], "the silent store was never reported"
        assert reports[0]["store_lost"] and [x["rank"] for x in reports[0]["stuck"]] == [0]
        host0.wait(timeout=30)
        assert host0.returncode == -signal.SIGKILL, host0.returncode
        assert not is_alive(host0.pid, None)
    finally:
        store.thaw.set()
        if dog is not None:
            dog.stop()
        if host0.poll() is None:
            host0.kill()
            host0.wait()


def test_the_silent_store_report_reads_as_one_line_and_names_nobody_elsewhere():
    store, dog = _Freezable(), None
    dog = Watchdog(store, 2, 4, 30.0, interval_s=0.05, heartbeat=Heartbeat())
    dog._views[0] = RankView({"tick": 3, "progress": 5, "step": 13, "phase": "all-reduce",
                              "host": "another-host", "pid": 1, "started": 1}, 0.0, 0.0)
    now = dog._store_ok_at
    assert dog._store_lost_report(now + 29.0) is None
    rep = dog._store_lost_report(now + 31.0)
    assert rep["stuck"] == [] and rep["store_lost"]
    line = format_hang(rep)
    assert line.startswith("hang: the job's store (") and "has not answered for 31 s" in line
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line and line.endswith("stopping the job")
