"""The pieces a torchrun restart stands on, without processes: metrics.jsonl continued at the
resumed step, the restart event's text, the attempt-scoped store, the run folder that survives
restarts, ``max_restarts`` checks, and leaving at once when a peer is gone."""
from __future__ import annotations

import json
import signal
import sys
import time

import pytest

from malleus_ds.report.metrics import MetricsWriter, format_event, read_run
from malleus_ds.app.run_config import ConfigError
from malleus_ds.app.runners.base import DistEnv, attempt_store
from tests.configs import cfg


def _lines(*objs) -> str:
    return "".join(json.dumps(o) + "\n" for o in objs)


def _step(k):
    return {"step": k, "loss": 1.0 / (k + 1), "samples": 8, "step_time_s": 0.1}


def test_a_continuing_run_keeps_earlier_steps_and_drops_what_it_redoes(tmp_path):
    old = [_step(0), _step(1), {"event": "checkpoint", "step": 2, "path": "ck/global_step2"},
           _step(2), {"event": "replan", "step": 3, "trigger": "onset"}, _step(3),
           {"event": "hang", "stuck": [{"rank": 2}]}]
    (tmp_path / "metrics.jsonl").write_text(_lines(*old) + '{"step": 4, "lo')   # cut short
    w = MetricsWriter(tmp_path, keep_before=2)
    assert w.dropped_steps == 2                      # steps 2 and 3 are run again
    assert (w.kept_lines, w.restarts_before) == (4, 0)
    w.write_event({"event": "restart", "attempt": 1, "from_step": 2, "world": 4,
                   "lost_steps": w.dropped_steps})
    for k in (2, 3, 4):
        w.write_event(_step(k))
    w.close()
    steps, events = read_run(tmp_path)
    assert [s["step"] for s in steps] == [0, 1, 2, 3, 4]             # each step once
    # the checkpoint resumed from and the step-less hang report stay; the lost replan goes
    assert [e["event"] for e in events] == ["checkpoint", "hang", "restart"]
    again = MetricsWriter(tmp_path, keep_before=4)   # a second restart counts the first
    assert (again.restarts_before, again.dropped_steps) == (1, 1)
    again.close()
    # a fresh start (no keep_before) starts the file empty, as before
    MetricsWriter(tmp_path).close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_the_restart_event_reads_as_a_sentence():
    ev = {"event": "restart", "attempt": 2, "from_step": 6, "world": 4, "lost_steps": 1}
    assert format_event(ev) == ("restart 2: continuing from step 6 on 4 rank(s); 1 step(s) "
                                "done since that checkpoint are run again")
    assert format_event(ev, short=True) == "restart 2"


def test_each_attempt_gets_a_store_of_its_own_and_never_reads_a_dead_one():
    """Under torchrun's agent store rank 0 hosts a store for the attempt and publishes it; a
    rank that first finds a dead attempt's entry keeps looking until the live one answers."""
    import socket
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    assert attempt_store(DistEnv(), None, environ={}) == (None, "0")     # env:// as usual
    agent = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(agent.port)}
    with socket.socket() as sk:         # a port nothing listens on: the dead attempt's store
        sk.bind(("127.0.0.1", 0))
        dead_port = sk.getsockname()[1]
    agent.set("malleus/attempt", f"deadbeef {dead_port}")
    got = {}
    other = threading.Thread(target=lambda: got.update(r1=attempt_store(
        DistEnv(rank=1, world_size=2), timedelta(seconds=30), env)))
    other.start()
    time.sleep(0.5)                     # rank 1 meets the stale entry first (or not: same end)
    own, token = attempt_store(DistEnv(rank=0, world_size=2), timedelta(seconds=30), env)
    other.join(60)
    store1, token1 = got["r1"]
    assert token1 == token != "deadbeef"
    store1.set("rank1/addr", "live:1")
    assert own.get("rank1/addr") == b"live:1"      # one store, this attempt's

def test_dist_env_reads_the_restart_count(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert DistEnv.from_environ("cpu").restart == 2
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT")
    assert DistEnv.from_environ("cpu").restart == 0


def test_max_restarts_needs_resume_auto():
    ck = {"dir": "/tmp/ck"}
    assert cfg(max_restarts=0).world_size >= 1
    cfg(max_restarts=2, checkpoint=dict(ck, resume="auto"))
    with pytest.raises(ConfigError, match=r"max_restarts=2 needs checkpoint.resume=auto .*"
                                          r"checkpoint.resume=false a restart would train "
                                          r"again from step 0"):
        cfg(max_restarts=2, checkpoint=ck)
    with pytest.raises(ConfigError, match=r"checkpoint.resume=true a restart would fail"):
        cfg(max_restarts=1, checkpoint=dict(ck, resume=True))
    with pytest.raises(ConfigError, match=r"max_restarts=-1 must be an integer >= 0"):
        cfg(max_restarts=-1)


def test_a_restartable_torchrun_job_gets_one_run_folder_for_every_attempt():
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[4] / "launch"))
    from train import _restartable_run_dir

    env = {"TORCHELASTIC_MAX_RESTARTS": "2", "TORCHELASTIC_RUN_ID": "job7"}
    assert _restartable_run_dir(["engine=malleus"], env) == ["hydra.run.dir=outputs/elastic/job7"]
    assert _restartable_run_dir(["hydra.run.dir=/x"], env) == []          # the user's wins
    assert _restartable_run_dir([], dict(env, TORCHELASTIC_MAX_RESTARTS="0")) == []
    assert _restartable_run_dir([], {}) == []


class _Dog:
    """What leave_when_a_peer_is_gone reads off a Watchdog."""

    def __init__(self, answers):
        self.answers = list(answers)

    def gone_peers(self, seen):
        return self.answers.pop(0) if self.answers else []


def test_a_stop_signal_with_a_dead_peer_exits_at_once_and_one_with_live_peers_waits():
    from malleus_ds.app.runners.guard import leave_when_a_peer_is_gone

    exits = []
    t = leave_when_a_peer_is_gone(_Dog([[], [], [2]]), 0, int(signal.SIGTERM), grace_s=5,
                                  every_s=0.01, exit=exits.append)
    t.join(5)
    assert exits == [128 + signal.SIGTERM]
    exits.clear()
    t = leave_when_a_peer_is_gone(_Dog([]), 0, int(signal.SIGTERM), grace_s=0.1, every_s=0.01,
                                  exit=exits.append)
    t.join(5)
    assert exits == []                               # every peer alive: the stop is agreed


def test_a_live_metrics_file_reads_up_to_its_last_complete_line(tmp_path):
    from malleus_ds.report.metrics import read_live

    assert read_live(tmp_path) == []                             # not written yet
    (tmp_path / "metrics.jsonl").write_text(_lines(_step(0), {"event": "checkpoint",
                                                              "step": 1}) + '{"step": 1, "lo')
    assert [r.get("event", "step") for r in read_live(tmp_path)] == ["step", "checkpoint"]
    assert read_live(tmp_path / "metrics.jsonl") == read_live(tmp_path)
