"""A short fault campaign (``malleus-chaos``): two seeds of a real 2-rank engine=malleus job with
restarts, checkpoints and the adaptive loop, under faults of every kind that can be done to it
on one machine, judged by the campaign's own invariants (``malleus_ds/chaos/verdict.py``). The
long campaign's numbers are in bench/RESULTS.md."""
from __future__ import annotations

from pathlib import Path

import pytest

from malleus_ds.chaos.run import Options, run_one
from malleus_ds.chaos.schedule import Fault, Schedule

STEPS, WORLD = 16, 2
#: two runs that between them do every kind of fault a job on one machine can meet
CASES = {
    "deaths-and-disk": (Fault("planner_kill", 4), Fault("kill", 5, rank=1),
                        Fault("freeze", 8, rank=0, seconds=2.0),
                        Fault("disk_full", 9, until=11), Fault("disk_ro", 12, until=14)),
    "stop-and-slowdowns": (Fault("straggler", 3, rank=1, until=8, rate=3.0),
                           Fault("slow_link", 4, rank=0, until=7, rate=20.0, peer=1),
                           Fault("sigterm", 6), Fault("quota", 9, rank=1, until=12, rate=5.0),
                           Fault("hang", 11, rank=1)),
}


def _reference():
    from malleus_ds.app.reference import reference_run
    from malleus_ds.models import model_config

    ref, _ = reference_run(model_config("tiny", max_seq_len=16), seed=0, steps=STEPS,
                           global_batch_size=8, micro_batch_size=1)
    return list(ref)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_short_campaign_keeps_every_invariant(case, tmp_path, monkeypatch):
    sched = Schedule(0, STEPS, WORLD, CASES[case])
    said: list[str] = []
    monkeypatch.chdir(tmp_path)     # a relative folder, as `malleus-chaos --out chaos` gives
    # a 20 s hang timeout: a rank of a loaded machine may go 12 s (the campaign's) without a
    # step, and then the watchdog would count a healthy rank as hung
    v, done = run_one(sched, Path(case), _reference(),
                      Options(hang_timeout_s=20.0, budget_s=300), say=said.append)
    log = (tmp_path / case / "job.log").read_text()
    assert v.ok, "\n".join(sched.lines() + said + v.broken) + "\n" + log[-3000:]
    not_done = [f"{i.fault.kind}: {i.note}" for i in done if not i.done]
    assert not not_done, not_done
