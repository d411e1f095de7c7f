"""The watchdog with real processes: frozen peers on this host are killed, others are not."""




def test_frozen_peers_on_this_host_are_killed_others_are_not():
    import os
    import signal
    import subprocess
    import sys

    from malleus_ds.resilience.procs import start_time
    from malleus_ds.resilience.watchdog import end_frozen_peers

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        st = start_time(victim.pid)
        report = {"stuck": [
            {"rank": 1, "frozen": True, "host": "h1", "pid": victim.pid, "started": st},
            {"rank": 2, "frozen": True, "host": "h2", "pid": victim.pid, "started": st},  # elsewhere
            {"rank": 3, "frozen": True, "host": "h1", "pid": victim.pid, "started": st + 1},  # reused
            {"rank": 4, "host": "h1", "pid": victim.pid, "started": st},   # stalled, not frozen
            {"rank": 0, "frozen": True, "host": "h1", "pid": victim.pid, "started": st}]}  # me
        sent = []
        assert end_frozen_peers(report, 0, "h1", kill=lambda p, s: sent.append((p, s))) == \
            [(1, victim.pid)]
        assert sent == [(victim.pid, signal.SIGKILL)]
        os.kill(victim.pid, signal.SIGSTOP)               # a stopped process dies of SIGKILL
        assert end_frozen_peers(report, 0, "h1") == [(1, victim.pid)]
        assert victim.wait(timeout=10) == -signal.SIGKILL
    finally:
        if victim.poll() is None:
            victim.kill()
