"""The step reporter's per-rank numbers (app/runners/common.py, ``StepReporter.step_done``): from
a step all-reduce's sums with no collective of its own; gathered from every rank's clock when
a runner has no such sums (engine=deepspeed, torch) or when they are ``late`` (a probe timed
after the all-reduce); the same metrics.jsonl line either way."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from malleus_ds.app.runners.base import DistEnv
from malleus_ds.app.runners.common import StepReporter
from malleus_ds.app.runners.guard import STOP
from malleus_ds.emulation.links import LinkSchedule
from malleus_ds.engine.clock import ComputeClock
from malleus_ds.steploop import StepSums
from tests.configs import cfg

#: rank 0's clock and rank 1's, as each would put them in the step's collective
CLOCKS = [dict(compute_s=0.25, emulated_s=0.0, wait_s=0.001, link_emulated_s=0.0),
          dict(compute_s=0.75, emulated_s=0.5, wait_s=0.002, link_emulated_s=0.125)]
SUMS = StepSums(loss=2.5, overflow=False, ready=False, compute_s=np.array([0.25, 0.75]),
                probe_s=np.full(2, np.nan), emulated_s=np.array([0.0, 0.5]),
                wait_s=np.array([0.001, 0.002]), link_s=np.array([0.0, 0.125]), stop=15)


@pytest.fixture
def gathers(monkeypatch):
    """A 2-rank world whose all-gather returns :data:`CLOCKS` (rank 1 got SIGTERM); counts
    the calls."""
    import torch.distributed as dist

    calls = []

    def all_gather(out, t, group=None):
        calls.append(t.tolist())
        for o, c in zip(out, CLOCKS):
            o.copy_(torch.tensor([c["compute_s"], c["emulated_s"], c["wait_s"],
                                  c["link_emulated_s"], 15.0 if o is out[1] else 0.0],
                                 dtype=torch.float64))

    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    monkeypatch.setattr(STOP, "signum", 0)
    return calls


def _reporter(tmp_path):
    c = dataclasses.replace(cfg(progress=False), run_dir=str(tmp_path),   # links reported
                            links=LinkSchedule.parse([{"ranks": [0, 1], "rate": 2.0}], 2, 2))
    return StepReporter(c, DistEnv(rank=0, world_size=2))


def _clock():
    clock = ComputeClock()
    for k, v in CLOCKS[0].items():
        setattr(clock, "_compute_s" if k == "compute_s" else k, v)
    return clock


def _line(tmp_path, rep):
    rep.close()
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("how", ["sums", "late sums", "no sums"])
def test_the_reporter_reads_the_sums_or_gathers_the_clocks_to_the_same_line(tmp_path, gathers,
                                                                           how):
    rep = _reporter(tmp_path)
    sums = {"sums": SUMS, "late sums": dataclasses.replace(SUMS, late=True),
            "no sums": None}[how]
    rep.step_done(0, 2.5, 1.0, _clock(), sums=sums)
    assert len(gathers) == (0 if how == "sums" else 1)
    assert rep.stop_signal == 15            # rank 1's SIGTERM: every rank stops after step 0
    line = _line(tmp_path, rep)
    assert line["compute_s"] == [0.25, 0.75] and line["emulated_s"] == [0.0, 0.5]
    assert line["wait_s"] == [0.001, 0.002] and line["link_emulated_s"] == [0.0, 0.125]
