"""Rates that hold on any plan (issue 31 part 1): a matrix of plans x true rates, replayed
from recorded per-rank timings, no processes.

``tests/fixtures/rate_matrix.json`` holds 27 recordings of ``bench/bench_rates.py`` (2026-12-05; tiny
4 x 256, seq 128, micro-batch 2, CPU, 2 cores): per step every rank's compute seconds and probe
readings as the step's all-reduce carried them, under a scripted switch to each cell's plan
(uniform; 2-stage pipelines of 1 + 3 layers; the head stage with 1 layer; one micro-batch vs
three; five vs one; the planner's plan for rank 1 at 3.3; next to a suspended rank; just
re-admitted), nobody slowed or rank 1 at rate 3 (sleep; three cells with a CPU quota, whose
true rate is ``python -m malleus_ds.emulation.cpu_quota --calibrate``'s), on 4 ranks and on 2. Four-rank
sleep cells also hold each rank's CPU seconds inside its compute spans (``cpu``: wall minus
the time it waited for a core).

Each cell is replayed through ``RateEstimator`` as ``control.py`` feeds it
(``bench_rates.replay``) and every working rank's smoothed reading -- what the detector sees
-- is judged over the steps whose window holds only the cell's plan: a healthy rank within
1.0 +- 0.1, a slowed one within 15% of its true rate (the issue's bounds). Where a rank misses,
the test is ``xfail(strict=True)`` with the measured numbers (median, range, worst error) and
the cause found (docs/DESIGN.md §6, "Where the rates' bias comes from"): it fails the day the
rank passes, so the list stays true.
"""
from __future__ import annotations

import importlib.util
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "rate_matrix.json"
_spec = importlib.util.spec_from_file_location("bench_rates", ROOT / "bench" / "bench_rates.py")
br = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_rates", br)     # dataclasses look their module up
_spec.loader.exec_module(br)

CELLS = {r["name"]: r for r in br.load_fixture(FIXTURE)}

PROBE = ("a held rank at rate 3 read by its probes (the slower of its last two): within 7% "
         "but for one pair of probes at 3.44-3.69 for 2-4 steps (4 ranks / 2 cores)")
FIRST = ("the first windows after a switch to a light share hold its first steps: 1.08-1.14, "
         "then 1.00-1.02")
PAIR = ("2 ranks: each step's median is the pair's mean, so one rank's noise moves the other "
        "(rank 1 at 2.54 for 2 steps; a healthy rank at 0.74-0.82 for 8 steps beside a quota)")
QPROBE = ("a CPU quota on a light share: probes read 3.25-3.56 for --calibrate's 2.92, which "
          "is against a full core")

#: (variant, cell, rank) -> (median, lowest, highest, worst error, cause): the misses
#: measured on the fixture with the estimator of this commit (recorded with the compute clock
#: that leaves out waits for a core, and time.thread_time's CPU seconds: 7 misses of 127
#: working ranks, against 44 recorded with the wall clock)
KNOWN = {
    ("wall", "w4-pipe13-slow", 1): (3.16, 3.00, 3.69, 0.23, PROBE),
    ("wall", "w4-planner", 1): (1.00, 0.99, 1.13, 0.13, FIRST),
    ("wall", "w2-uniform-slow", 1): (3.14, 2.54, 3.23, 0.15, PAIR),
    ("wall", "w4-readmit-slow", 1): (3.06, 2.98, 3.61, 0.20, PROBE),
    ("wall", "w4-readmit-slow", 3): (1.01, 1.00, 1.10, 0.10, FIRST),
    ("wall", "w2-pipe13-quota", 0): (0.95, 0.74, 1.00, 0.26, PAIR),
    ("wall", "w2-pipe13-quota", 1): (3.51, 3.25, 3.56, 0.22, QPROBE),
    ("cpu", "w4-pipe13-slow", 1): (3.16, 3.05, 3.69, 0.23, PROBE),
    ("cpu", "w4-planner", 1): (1.01, 1.00, 1.14, 0.14, FIRST),
    ("cpu", "w4-planner-slow", 1): (3.19, 3.05, 3.55, 0.18, PROBE),
    ("cpu", "w4-readmit-slow", 1): (3.08, 2.99, 3.61, 0.20, PROBE),
    ("cpu", "w4-readmit-slow", 3): (1.01, 1.00, 1.10, 0.10, FIRST),
}


@lru_cache(maxsize=None)
def _steady(variant: str, cell: str) -> tuple:
    rec = CELLS[cell]
    return tuple(br.steady(rec, br.replay(rec, source="compute" if variant == "wall" else "cpu")))


def _cases():
    for variant in ("wall", "cpu"):
        for name, rec in CELLS.items():
            if variant == "cpu" and "cpu_ms" not in rec:
                continue
            for d in np.flatnonzero(br.working(rec)):
                key = (variant, name, int(d))
                marks = ()
                if key in KNOWN:
                    med, lo, hi, worst, why = KNOWN[key]
                    marks = pytest.mark.xfail(strict=True, reason=(
                        f"reads {med:.2f} ({lo:.2f}-{hi:.2f}), worst error {worst:.2f}: {why}"))
                yield pytest.param(*key, marks=marks, id=f"{variant}-{name}-rank{d}")


@pytest.mark.parametrize("variant,cell,rank", list(_cases()))
def test_a_rank_reads_its_true_rate_on_any_plan(variant, cell, rank):
    s = _steady(variant, cell)[rank]
    assert s["worst"] <= s["bound"], (
        f"{cell} rank {rank} (true {s['true']:.2f}): median {s['median']:.2f}, "
        f"{s['lo']:.2f}-{s['hi']:.2f}, worst error {s['worst']:.2f} > {s['bound']}")


def test_the_known_misses_are_cells_of_the_fixture():
    """A renamed cell or rank must not leave a stale entry that no case uses."""
    cases = {tuple(p.values) for p in _cases()}
    assert set(KNOWN) <= cases


def test_without_waiting_every_healthy_rank_reads_within_the_bound():
    """The estimator itself, with the oversubscription taken out (CPU seconds, 4-rank sleep
    cells): every healthy working rank within 1.0 +- 0.1 but the first windows of two light
    shares after their switch (0.14 at most)."""
    worst = {}
    for name, rec in CELLS.items():
        if "cpu_ms" not in rec:
            continue
        for s in _steady("cpu", name):
            if br.working(rec)[s["rank"]] and s["true"] == 1.0:
                worst[(name, s["rank"])] = s["worst"]
    assert len(worst) >= 40
    over = {k: v for k, v in worst.items() if v > 0.10}
    assert set(over) <= {("w4-planner", 1), ("w4-readmit-slow", 3)}
    assert max(over.values(), default=0.0) <= 0.15


def test_the_fitted_terms_and_the_head_are_what_holds_a_pipeline_stage_on_2_ranks():
    """Without oversubscription the per-micro-batch terms matter: without them the 1 + 3 layer
    pipeline and the head stage read up to 0.11 and 0.06 off (2 ranks, healthy), with them
    within 0.04 and 0.01; a slowed head stage without head units reads 3.59 (+20%), with
    them 3.33."""
    for name in ("w2-pipe13", "w2-head"):
        rec = CELLS[name]
        fitted = [s["worst"] for s in br.steady(rec, br.replay(rec))]
        plain = [s["worst"] for s in br.steady(rec, br.replay(rec, shape=False))]
        assert max(fitted) <= 0.04 < 0.05 <= max(plain)
    rec = CELLS["w2-head-slow"]
    with_head = br.steady(rec, br.replay(rec))[1]["median"]
    without = br.steady(rec, br.replay(rec, head=0.0))[1]["median"]
    assert with_head < 3.45 < 3.5 < without
