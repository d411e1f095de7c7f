"""Restart parts with real processes: gone_peers sees a dead process on this host, and the watchdog
reports a dead rank on its host at once."""
from __future__ import annotations

import json
import subprocess
import sys
import time




def test_gone_peers_sees_a_dead_process_on_this_host_and_a_silent_one_elsewhere():
    import torch.distributed as dist

    from malleus_ds.resilience.watchdog import Watchdog, whoami

    store = dist.HashStore()
    me = whoami()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    from malleus_ds.resilience.procs import start_time
    recs = {1: dict(me, tick=1, done=False),                           # this process: alive
            2: {"host": me["host"], "pid": dead.pid, "started": 1, "tick": 1, "done": False},
            3: {"host": "elsewhere", "pid": 1, "started": 1, "tick": 5, "done": False},
            4: {"host": me["host"], "pid": 99999999, "started": None, "tick": 1, "done": True}}
    for r, rec in recs.items():
        store.set(f"malleus_wd/hb/{r}", json.dumps(dict(rec, progress=0, step=0, phase="x")))
    dog = Watchdog(store, 0, 5, 10.0, interval_s=0.05)
    seen = {}
    assert dog.gone_peers(seen) == [2]               # rank 3: tick not stale yet
    seen[3] = (5, time.monotonic() - dog.frozen_after - 1)
    assert dog.gone_peers(seen) == [2, 3]            # rank 3's tick unchanged too long
    assert start_time(me["pid"]) == me["started"]


def test_the_watchdog_reports_a_dead_rank_on_its_host_at_once():
    """No launcher signals a survivor when a whole node is lost: rank 0 sees the dead process
    on its host in its next look, not after hang_timeout_s."""
    import torch.distributed as dist

    from malleus_ds.resilience.watchdog import Watchdog, format_hang, whoami

    store = dist.HashStore()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = whoami()
    rec = {"host": me["host"], "pid": dead.pid, "started": 1, "tick": 3, "progress": 9,
           "step": 7, "phase": "all-reduce", "done": False}
    store.set("malleus_wd/hb/1", json.dumps(rec))
    exits, logged = [], []
    dog = Watchdog(store, 0, 2, 300.0, interval_s=0.05, exit=exits.append,
                   on_hang=logged.append)
    dog.start()
    deadline = time.monotonic() + 20
    while not exits and time.monotonic() < deadline:
        time.sleep(0.05)
    dog.stop()
    assert exits == [3] and logged[0]["gone"] and logged[0]["stuck"][0]["rank"] == 1
    assert format_hang(logged[0]).startswith("rank(s) gone: rank 1 in step 7 (all-reduce)")
