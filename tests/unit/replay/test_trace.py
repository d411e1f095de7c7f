"""The trace format (``malleus_ds/replay/trace.py``) and the regimes that draw traces
(``regimes.py``): rows checked with the line and field named, overlaps (the largest rate
holds), segments merged where nothing changes, 100,000 rows, reproducible draws."""
from __future__ import annotations

import time

import pytest

from malleus_ds.replay.regimes import generate
from malleus_ds.replay.trace import Event, TraceError, make_trace, read_csv, write_csv


def _csv(tmp_path, body: str, name="t.csv"):
    p = tmp_path / name
    p.write_text("start_s,end_s,gpu,rate\n" + body)
    return p


def test_segments_take_the_largest_rate_where_rows_overlap(tmp_path):
    p = _csv(tmp_path, "10,50,1,2.0\n30,40,1,3.0\n20,60,2,1.5\n60,70,2,1.5\n")
    tr = read_csv(p, 4, hours=0.05)                   # 180 s
    segs = [(s.start_s, s.end_s, s.rates) for s in tr.segments()]
    assert segs == [(0.0, 10.0, ()), (10.0, 20.0, ((1, 2.0),)),
                    (20.0, 30.0, ((1, 2.0), (2, 1.5))), (30.0, 40.0, ((1, 3.0), (2, 1.5))),
                    (40.0, 50.0, ((1, 2.0), (2, 1.5))), (50.0, 70.0, ((2, 1.5),)),
                    (70.0, 180.0, ())]                # 50-60 and 60-70 merged: no change
    assert sum(s.seconds for s in tr.segments()) == pytest.approx(180.0)


@pytest.mark.parametrize("body, match", [
    ("1,2,4,2.0\n", r"t.csv:2: gpu=4 is out of range: the job has 4 GPUs \(0..3\)"),
    ("5,5,0,2.0\n", r"t.csv:2: end_s=5 must be after start_s=5"),
    ("0,5,0,0.5\n", r"t.csv:2: rate=0.5 must be >= 1"),
    ("0,5,0,x\n", r"t.csv:2: rate='x' is not a number"),
    ("0,5,0\n", r"t.csv:2: 3 fields, need 4"),
    ("0,5,1.5,2\n", r"t.csv:2: gpu=1.5 is out of range"),
    ("0,5,0,2\n-1,5,0,2\n", r"t.csv:3: start_s=-1 must be >= 0"),
    ("0,7200,0,2\n", r"a row ends at 7200 s \(gpu 0\), after --hours=1 \(3600 s\)"),
])
def test_bad_rows_name_the_line_and_the_field(tmp_path, body, match):
    with pytest.raises(TraceError, match=match):
        read_csv(_csv(tmp_path, body), 4, hours=1.0)


def test_a_bad_header_or_a_missing_file_is_named(tmp_path):
    (tmp_path / "h.csv").write_text("start,end,gpu,rate\n")
    with pytest.raises(TraceError, match=r"h.csv:1: the header must be start_s,end_s,gpu,rate"):
        read_csv(tmp_path / "h.csv", 4)
    with pytest.raises(TraceError, match=r"nope.csv: cannot read the trace"):
        read_csv(tmp_path / "nope.csv", 4)
    with pytest.raises(TraceError, match=r"no rows, and no --hours"):
        read_csv(_csv(tmp_path, ""), 4)


def test_a_hundred_thousand_rows_read_and_cut_fast(tmp_path):
    ev = [Event(float(i), float(i) + 40.0, i % 1024, 1.0 + (i % 7) / 3) for i in range(100_000)]
    p = tmp_path / "big.csv"
    assert write_csv(ev, p) == 100_000
    t0 = time.process_time()
    tr = read_csv(p, 1024)
    segs = tr.segments()
    assert len(tr.events) == 100_000 and segs[-1].end_s == pytest.approx(100_039.0)
    assert max(len(s.rates) for s in segs) == 35       # 40 rows overlap, 1 in 7 at rate 1.0
    assert time.process_time() - t0 < 60                       # CPU seconds, not minutes


def test_regimes_are_reproducible_and_read_back(tmp_path):
    for regime in ("persistent", "transient", "mixed", "flapping"):
        a = generate(regime, 256, 24.0, seed=3)
        assert a == generate(regime, 256, 24.0, seed=3) and a
        assert a != generate(regime, 256, 24.0, seed=4)
        write_csv(a, tmp_path / f"{regime}.csv")
        tr = read_csv(tmp_path / f"{regime}.csv", 256, hours=24.0)
        assert len(tr.events) == len(a)
    pers = generate("persistent", 1024, 24.0, seed=1)
    assert len(pers) == 4 and all(2.5 <= e.rate <= 3.5 for e in pers)   # one per 256 GPUs
    tran = generate("transient", 1024, 24.0, seed=1)
    assert all(1.2 <= e.rate <= 2.0 for e in tran)
    # node-wide: each event slows the 8 GPUs of one node; ~1.5% of 128 nodes per 80 minutes
    starts = {(e.start_s, e.gpu // 8) for e in tran}
    assert len(tran) == 8 * len(starts)
    assert 20 <= len(starts) <= 60                                     # expected 34.6 in 24 h
    with pytest.raises(ValueError, match="regime='bursty'"):
        generate("bursty", 8, 1.0)
    assert make_trace([], 8, hours=1.0).segments()[0].rates == ()


def test_flapping_gpus_alternate_slow_and_healthy_phases_of_minutes():
    ev = generate("flapping", 1024, 4.0, seed=0)
    gpus = sorted({e.gpu for e in ev})
    assert len(gpus) == 6                                    # one per 170 GPUs
    for g in gpus:
        mine = sorted((e for e in ev if e.gpu == g), key=lambda e: e.start_s)
        assert len(mine) >= 25                               # 4 h of 4-8 minute cycles
        for a, b in zip(mine, mine[1:]):
            assert 120.0 - 1e-3 <= a.end_s - a.start_s <= 240.0 + 1e-3
            assert 120.0 - 1e-3 <= b.start_s - a.end_s <= 240.0 + 1e-3     # healthy between
        assert mine[-1].end_s <= 4 * 3600.0
        assert len({e.rate for e in mine}) == 1                  # one rate per GPU
    assert all(1.6 <= e.rate <= 1.9 for e in ev)
    assert len({e.gpu for e in generate("flapping", 64, 1.0, seed=0)}) == 1   # at least one


def test_nodes_that_do_not_tile_the_job_are_named():
    with pytest.raises(ValueError, match="gpus_per_node=8 does not divide the world size 12"):
        generate("transient", 12, 1.0)
