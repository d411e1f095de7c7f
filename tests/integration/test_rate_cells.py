"""Rates that hold on any plan, with processes (issue 31 part 1): two cells of
``bench/bench_rates.py`` run for real, on 2 ranks (no oversubscription on 2 cores: 4 ranks wait
for a core inside their compute and read 0.8-1.6 whatever the estimator does; see
docs/DESIGN.md §6, "Where the rates' bias comes from").

Each cell is a short training run (tiny 4 x 256, 20 steps) with a scripted switch at step 3 to
the cell's plan; the estimator is fed exactly what the step's all-reduce carried (recorded by
the bench's hooks) and replayed as ``control.py`` does. Required, over the steps whose window
holds only the new plan: a healthy rank's median reading within 1.0 +- 0.1, a slowed one's
within 15% of its rate, and every reading within 50% (one run in three or four on this VM has
a few steps up to +43% on a 2-rank cell with nothing else running: the host's noise, which the
recorded matrix judges per step). ~25 s in all. The full matrix (27 cells) is ``bench/bench_rates.py``; its recordings are
``tests/unit/adaptive/test_rate_matrix.py``'s fixture.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_rates", ROOT / "bench" / "bench_rates.py")
br = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_rates", br)
_spec.loader.exec_module(br)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cell", ["w2-pipe13", "w2-uniform-slow"])
def test_a_cell_reads_its_true_rates_with_processes(cell, tmp_path):
    """``w2-pipe13``: a 2-stage pipeline of 1 + 3 layers (rank 1 the light first stage, rank 0
    three layers and the head), both healthy; ``w2-uniform-slow``: rank 1 slowed at rate 3 by
    the sleep emulation, no switch. Recorded (2026-12-05): 1.00 +- 0.01; 1.00 and 3.15 +- 0.07.
    (A slowed cell with a switch makes rank 1 a held rank, read at times by its floor -- the
    reading at the switch, from the run's first two steps here: ``w2-mb1-slow`` read 3.26 with
    a worst 4.06 in one run of four.)"""
    c = dataclasses.replace(br.cells()[cell], steps=20)
    rec = br.run_cell(c, tmp_path / cell)
    rec["head"] = br.head_units()
    readings = br.replay(rec)
    for s in br.steady(rec, readings):
        msg = (f"{cell} rank {s['rank']} (true {s['true']}): median {s['median']:.2f}, "
               f"{s['lo']:.2f}-{s['hi']:.2f}, worst error {s['worst']:.2f}")
        off = abs(s["median"] / s["true"] - 1) if s["true"] > 1 else abs(s["median"] - 1)
        assert off <= s["bound"], msg
        assert s["hi"] <= 1.5 * s["true"] and s["lo"] >= s["true"] / 1.5, msg
