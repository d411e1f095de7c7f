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

WAIT = ("4 ranks on 2 cores: waiting for a core counted as compute (wall / CPU seconds 1.2-2.2 "
        "by share, per-step log-sd 0.14-0.18 against 0.014 in CPU seconds, where this rank "
        "reads within the bound)")
PROBE = ("a held rank read by its probe on 4 ranks / 2 cores: probe over reference 2.5-5.8 "
         "for rate 3; without its probes it reads 3.10 / 3.14 / 2.95 in CPU seconds "
         "(malleus_ds/adaptive/probe.py)")
LIGHT = "a 35 ms share (1 layer + embedding x 2 micro-batches): one step at 1.11-1.12"
PAIR = ("2 ranks: each step's median is the pair's mean, so the healthy rank moves against "
        "the other (in w2-pipe13-slow the fit explains held rank 1's training away, beta 2.6, "
        "and only its floor keeps it at 3.20)")
QPROBE = ("a CPU quota on a light share: training fits inside the quota (reads ~1), probes read "
          "3.1-3.9 for 3.04 and twice in a row 1.11 (the cap not seen)")
QTRUE = ("quota on 4 ranks / 2 cores: --calibrate's 2.81 is against a full core; against peers "
         "that share the cores the rank is ~1.7x slow (wall 404 vs 221-237 ms for the same CPU "
         "140 vs 134-136 ms), DESIGN's r*s rule")

#: (variant, cell, rank) -> (median, lowest, highest, worst error, cause): the misses
#: measured on the fixture with the estimator of this commit
KNOWN = {
    ("wall", "w4-uniform", 1): (1.00, 0.79, 1.06, 0.21, WAIT),
    ("wall", "w4-uniform", 2): (1.00, 0.67, 1.12, 0.33, WAIT),
    ("wall", "w4-uniform-slow", 0): (1.00, 0.95, 1.11, 0.11, WAIT),
    ("wall", "w4-uniform-slow", 1): (2.65, 2.28, 2.88, 0.24, WAIT),
    ("wall", "w4-uniform-slow", 2): (0.99, 0.90, 1.16, 0.16, WAIT),
    ("wall", "w4-uniform-slow", 3): (1.00, 0.90, 1.12, 0.12, WAIT),
    ("wall", "w4-pipe13", 0): (1.00, 0.92, 1.29, 0.29, WAIT),
    ("wall", "w4-pipe13", 1): (1.02, 0.91, 1.18, 0.18, WAIT),
    ("wall", "w4-pipe13", 2): (0.98, 0.82, 1.21, 0.21, WAIT),
    ("wall", "w4-pipe13", 3): (0.99, 0.90, 1.19, 0.19, WAIT),
    ("wall", "w4-pipe13-slow", 0): (1.01, 0.95, 1.13, 0.13, WAIT),
    ("wall", "w4-pipe13-slow", 1): (4.43, 2.34, 5.83, 0.94, PROBE),
    ("wall", "w4-pipe13-slow", 2): (0.99, 0.89, 1.09, 0.11, WAIT),
    ("wall", "w4-pipe13-slow", 3): (1.00, 0.82, 1.02, 0.18, WAIT),
    ("wall", "w4-head", 1): (1.00, 0.90, 1.06, 0.10, WAIT),
    ("wall", "w4-head", 3): (1.01, 0.89, 1.13, 0.13, WAIT),
    ("wall", "w4-head-slow", 1): (2.92, 2.88, 4.51, 0.50, PROBE),
    ("wall", "w4-head-slow", 3): (0.98, 0.85, 1.03, 0.15, WAIT),
    ("wall", "w4-mb1", 0): (0.86, 0.74, 1.00, 0.26, WAIT),
    ("wall", "w4-mb1", 1): (1.23, 1.10, 1.51, 0.51, WAIT),
    ("wall", "w4-mb1", 2): (1.00, 0.92, 1.16, 0.16, WAIT),
    ("wall", "w4-mb1", 3): (1.01, 0.92, 1.18, 0.18, WAIT),
    ("wall", "w4-mb1-slow", 0): (1.00, 0.71, 1.00, 0.29, WAIT),
    ("wall", "w4-mb1-slow", 1): (3.68, 3.17, 4.35, 0.45, WAIT),
    ("wall", "w4-mb1-slow", 2): (1.00, 0.93, 1.28, 0.28, WAIT),
    ("wall", "w4-mb1-slow", 3): (1.06, 0.98, 1.17, 0.17, WAIT),
    ("wall", "w4-mb5", 0): (1.08, 0.96, 1.25, 0.25, WAIT),
    ("wall", "w4-mb5", 1): (0.63, 0.57, 0.74, 0.43, WAIT),
    ("wall", "w4-mb5", 2): (0.97, 0.87, 1.04, 0.13, WAIT),
    ("wall", "w4-mb5", 3): (1.06, 0.96, 1.13, 0.13, WAIT),
    ("wall", "w4-mb5-slow", 0): (1.00, 0.88, 1.00, 0.12, WAIT),
    ("wall", "w4-mb5-slow", 2): (1.03, 0.85, 1.08, 0.15, WAIT),
    ("wall", "w4-mb5-slow", 3): (0.97, 0.76, 1.18, 0.24, WAIT),
    ("wall", "w4-planner", 0): (1.24, 1.05, 1.40, 0.40, WAIT),
    ("wall", "w4-planner", 1): (1.04, 0.96, 1.11, 0.11, LIGHT),
    ("wall", "w4-planner", 3): (0.92, 0.79, 0.98, 0.21, WAIT),
    ("wall", "w4-planner-slow", 0): (1.09, 0.97, 1.31, 0.31, WAIT),
    ("wall", "w4-planner-slow", 1): (3.72, 2.65, 5.05, 0.68, PROBE),
    ("wall", "w4-planner-slow", 2): (0.96, 0.81, 1.05, 0.19, WAIT),
    ("wall", "w4-planner-slow", 3): (1.00, 0.84, 1.11, 0.16, WAIT),
    ("wall", "w4-suspended", 0): (1.00, 0.87, 1.03, 0.13, WAIT),
    ("wall", "w4-suspended", 1): (1.00, 0.99, 1.57, 0.57, WAIT),
    ("wall", "w4-suspended", 2): (1.00, 0.84, 1.07, 0.16, WAIT),
    ("wall", "w4-suspended-slow", 0): (0.89, 0.85, 0.96, 0.15, WAIT),
    ("wall", "w4-suspended-slow", 1): (3.49, 3.13, 3.86, 0.29, WAIT),
    ("wall", "w4-suspended-slow", 2): (1.11, 1.04, 1.15, 0.15, WAIT),
    ("wall", "w2-pipe13-slow", 0): (1.00, 0.87, 1.01, 0.13, PAIR),
    ("wall", "w4-readmit", 0): (1.03, 0.94, 1.10, 0.10, WAIT),
    ("wall", "w4-readmit", 1): (0.98, 0.77, 1.04, 0.23, WAIT),
    ("wall", "w4-readmit", 2): (0.98, 0.94, 1.20, 0.20, WAIT),
    ("wall", "w4-readmit", 3): (1.01, 0.90, 1.09, 0.10, WAIT),
    ("wall", "w4-readmit-slow", 1): (3.64, 3.64, 3.64, 0.21, WAIT),
    ("wall", "w4-readmit-slow", 2): (0.93, 0.81, 1.26, 0.26, WAIT),
    ("wall", "w4-readmit-slow", 3): (1.01, 0.91, 1.12, 0.12, WAIT),
    ("wall", "w2-pipe13-quota", 0): (0.99, 0.81, 1.18, 0.19, PAIR),
    ("wall", "w2-pipe13-quota", 1): (3.64, 1.11, 3.86, 0.63, QPROBE),
    ("wall", "w4-uniform-quota", 0): (1.00, 0.96, 1.10, 0.10, WAIT),
    ("wall", "w4-uniform-quota", 1): (1.72, 1.54, 1.87, 0.45, QTRUE),
    ("wall", "w4-uniform-quota", 2): (1.00, 0.85, 1.08, 0.15, WAIT),
    ("wall", "w4-uniform-quota", 3): (0.95, 0.81, 1.14, 0.19, WAIT),
    ("cpu", "w4-pipe13-slow", 1): (4.43, 3.08, 5.83, 0.94, PROBE),
    ("cpu", "w4-head-slow", 1): (3.15, 3.09, 4.51, 0.50, PROBE),
    ("cpu", "w4-planner", 1): (1.01, 1.00, 1.12, 0.12, LIGHT),
    ("cpu", "w4-planner-slow", 1): (3.72, 2.91, 3.86, 0.29, PROBE),
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
    cells): every healthy working rank within 1.0 +- 0.1 but one 35 ms share (0.12 once)."""
    worst = {}
    for name, rec in CELLS.items():
        if "cpu_ms" not in rec:
            continue
        for s in _steady("cpu", name):
            if br.working(rec)[s["rank"]] and s["true"] == 1.0:
                worst[(name, s["rank"])] = s["worst"]
    assert len(worst) >= 40
    over = {k: v for k, v in worst.items() if v > 0.10}
    assert set(over) == {("w4-planner", 1)} and over[("w4-planner", 1)] <= 0.13


def test_the_fitted_terms_and_the_head_are_what_holds_a_pipeline_stage_on_2_ranks():
    """Without oversubscription the per-micro-batch terms matter: without them the 1 + 3 layer
    pipeline and the head stage read 0.93-1.07 (2 ranks, healthy), with them within 0.01; a
    slowed head stage without head units reads 3.61 (+20%), with them 3.34."""
    for name in ("w2-pipe13", "w2-head"):
        rec = CELLS[name]
        fitted = [s["worst"] for s in br.steady(rec, br.replay(rec))]
        plain = [s["worst"] for s in br.steady(rec, br.replay(rec, shape=False))]
        assert max(fitted) <= 0.02 < 0.05 <= max(plain)
    rec = CELLS["w2-head-slow"]
    with_head = br.steady(rec, br.replay(rec))[1]["median"]
    without = br.steady(rec, br.replay(rec, head=0.0))[1]["median"]
    assert with_head < 3.45 < 3.5 < without
