"""malleus-plot: data extraction from metrics.jsonl, the PNG it writes, multirun labels, errors."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from malleus_ds.report.plot import DPI, FIGSIZE, main
from malleus_ds.report.whatif import format_account
from malleus_ds.report.plot_data import (
    Event,
    Region,
    job_labels,
    load_run_data,
    load_runs,
    rolling_median,
    straggler_regions)

SAMPLES = 8
STEPS = 40


def adaptive_lines(old_format: bool = False, measured: bool = True,
                   noise: float = 0.0) -> list[dict]:
    """An engine=malleus run: rank 3 at rate 5 for steps 4..29, replan at 8 + migrate at 9,
    a replan at 20 that is not adopted, recovery replan at 33 + migrate at 34. ``noise``:
    relative jitter on step times and measured rates (seeded), for looking at the figure."""
    rng = np.random.default_rng(0)
    out = []
    for s in range(STEPS):
        slow = 4 <= s < 30
        if s < 4:
            t = 0.20
        elif s < 10:
            t = 0.50          # straggler, old plan
        elif s < 30:
            t = 0.26          # new plan works around it
        elif s < 34:
            t = 0.16          # straggler gone, plan still skewed
        else:
            t = 0.20
        t *= 1 + noise * rng.standard_normal()
        rec = {"step": s, "loss": 5.0 - 0.05 * s, "samples": SAMPLES, "step_time_s": t,
               "compute_s": [0.09, 0.09, 0.1, 0.45 if slow else 0.09],
               "emulated_s": [0, 0, 0, 0.36 if slow else 0]}
        rates = {"3": 5.0} if slow else {}
        rec["rates" if old_format else "emulated_rates"] = rates
        if measured:
            if s < 2:
                rec["measured_rates"] = [None, None, None, None]
            else:
                r3 = 5.0 if 6 <= s < 31 else (3.0 if s in (5, 31) else 1.0)
                rec["measured_rates"] = [round(x * (1 + noise * rng.standard_normal()), 3)
                                         for x in (1.0, 1.02, 0.98, r3)]
            rec["plan"] = "plan-aaaa" if s < 9 or s >= 34 else "plan-bbbb"
        out.append(rec)
        if measured and s == 8:
            out.append({"event": "replan", "step": 8, "trigger": "onset",
                        "measured_rates": [1.0, 1.0, 1.0, 5.02], "from": "plan-aaaa",
                        "to": "plan-bbbb", "planning_s": 0.8, "predicted_step_s": [0.5, 0.26]})
            out.append({"event": "checkpoint", "step": 8, "path": "/x"})
        if measured and s == 9:
            out.append({"event": "migrate", "step": 9, "from": "plan-aaaa", "to": "plan-bbbb",
                        "bytes": 12.3 * 2**20, "seconds": 0.21, "peak_extra_bytes": 2345678})
        if measured and s == 20:
            out.append({"event": "replan", "step": 20, "trigger": "change",
                        "measured_rates": [1.0, 1.0, 1.0, 5.3], "from": "plan-bbbb",
                        "to": "plan-cccc", "planning_s": 0.7, "predicted_step_s": [0.26, 0.25],
                        "adopted": False})
        if measured and s == 33:
            out.append({"event": "replan", "step": 33, "trigger": "recovery",
                        "measured_rates": [1.0, 1.0, 1.0, 1.0], "from": "plan-bbbb",
                        "to": "plan-aaaa", "planning_s": 0.6, "predicted_step_s": [0.26, 0.2],
                        "adopted": True})
        if measured and s == 34:
            out.append({"event": "migrate", "step": 34, "from": "plan-bbbb", "to": "plan-aaaa",
                        "bytes": 12.3 * 2**20, "seconds": 0.19, "peak_extra_bytes": 2345678})
    return out


def write_run(d, lines, overrides=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    if overrides is not None:
        (d / ".hydra").mkdir(exist_ok=True)
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    return d


def test_single_run_extraction(tmp_path):
    run = load_run_data(write_run(tmp_path / "run", adaptive_lines()))
    assert run.steps.tolist() == list(range(STEPS))
    assert run.throughput[0] == pytest.approx(SAMPLES / 0.20)
    assert run.throughput[5] == pytest.approx(SAMPLES / 0.50)
    assert run.throughput[12] == pytest.approx(SAMPLES / 0.26)
    total_t = sum(x["step_time_s"] for x in adaptive_lines() if "event" not in x)
    assert run.mean_throughput == pytest.approx(SAMPLES * STEPS / total_t)
    assert run.world_size == 4
    assert np.isnan(run.measured_rates[0]).all() and run.measured_rates[10, 3] == 5.0
    assert run.compute_s.shape == (STEPS, 4)
    assert straggler_regions([run]) == [Region(4, 30, "rank 3 at rate 5")]
    assert run.events == [
        Event("replan", 8, "replan (onset)\n0.8 s plan", True, "onset"),
        Event("migrate", 9, "migrate 12.3 MiB, 0.21 s"),
        Event("replan", 20, "replan (change)\nnot adopted\n0.7 s plan", False, "change"),
        Event("replan", 33, "replan (recovery)\n0.6 s plan", True, "recovery"),
        Event("migrate", 34, "migrate 12.3 MiB, 0.19 s"),
    ]


def test_rolling_median():
    y = np.array([1.0, 1.0, 9.0, 1.0, 1.0, 5.0, 5.0, 5.0])
    m = rolling_median(y, 5)
    assert m.shape == y.shape and m[2] == 1.0 and m[-1] == 5.0
    assert rolling_median(np.array([np.nan, 2.0]), 3).tolist() == [2.0, 2.0]


def test_main_writes_png(tmp_path, capsys):
    import matplotlib.image as mpimg

    d = write_run(tmp_path / "run", adaptive_lines())
    assert main([str(d)]) == 0
    out = d / "throughput.png"
    assert capsys.readouterr().out.strip() == str(out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    h, w = mpimg.imread(out).shape[:2]
    assert abs(w - FIGSIZE[0] * DPI) <= 4 and abs(h - FIGSIZE[1] * DPI) <= 4
    # -o elsewhere (parent created); engine=torch (no measured rates) plots compute_s instead
    d2 = write_run(tmp_path / "torch", adaptive_lines(measured=False))
    o2 = tmp_path / "plots" / "t.png"
    assert main([str(d2), "-o", str(o2)]) == 0
    assert o2.read_bytes()[:4] == b"\x89PNG"
    assert load_run_data(d2).measured_rates is None and load_run_data(d2).events == []


def test_multirun_labels_and_union(tmp_path):
    sweep = tmp_path / "multirun" / "12-00-00"
    base = adaptive_lines()
    torch = adaptive_lines(measured=False)
    late = [dict(x) for x in torch]
    for x in late:   # job 2: straggler only at steps 35..37
        if "event" not in x:
            x["emulated_rates"] = {"1": 3.0} if 35 <= x["step"] < 38 else {}
    write_run(sweep / "0", base, ["engine=malleus", "straggler=onset", "train.steps=40"])
    write_run(sweep / "1", torch, ["engine=torch", "straggler=onset", "train.steps=40"])
    write_run(sweep / "2", late, ["engine=torch", "straggler=late", "train.steps=40"])
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    runs = load_runs(sweep)
    assert [r.path.name for r in runs] == ["0", "1", "2"]
    assert [r.name for r in runs] == ["engine=malleus, straggler=onset",
                                      "engine=torch, straggler=onset",
                                      "engine=torch, straggler=late"]
    assert straggler_regions(runs) == [Region(4, 30, "rank 3 at rate 5"),
                                       Region(35, 38, "rank 1 at rate 3")]
    assert main([str(sweep), "-o", str(tmp_path / "m.png")]) == 0   # one job with rates
    assert (tmp_path / "m.png").read_bytes()[:4] == b"\x89PNG"


def test_multirun_label_fallbacks(tmp_path):
    sweep = tmp_path / "sweep"
    lines = adaptive_lines(measured=False)
    write_run(sweep / "a" / "0", lines, ["x=1"])
    write_run(sweep / "a" / "10", lines, ["x=1"])      # nothing differs -> folder names
    write_run(sweep / "a" / "2", lines)                   # no overrides.yaml at all
    runs = load_runs(sweep)
    assert [r.name for r in runs] == ["a/0", "a/2", "a/10"]   # natural order
    runs = runs[::2]
    assert job_labels(runs, sweep) == ["a/0", "a/10"]
    # nested, one key only in one job
    write_run(sweep / "b" / "0", lines, ["x=1"])
    write_run(sweep / "b" / "1", lines, ["x=1", "+y=2"])
    assert [r.name for r in load_runs(sweep / "b")] == ["0", "+y=2"]
    # straggler union of identical schedules is labelled once
    assert straggler_regions(load_runs(sweep / "b")) == [Region(4, 30, "rank 3 at rate 5")]


def test_old_format_rates(tmp_path):
    lines = adaptive_lines(old_format=True, measured=False)
    assert all("emulated_rates" not in x for x in lines)
    run = load_run_data(write_run(tmp_path / "old", lines))
    assert run.emulated_rates[5] == {3: 5.0} and run.emulated_rates[0] == {}
    assert straggler_regions([run]) == [Region(4, 30, "rank 3 at rate 5")]
    assert main([str(tmp_path / "old")]) == 0


def test_regions_edge_cases(tmp_path):
    lines = [{"step": s, "samples": 4, "step_time_s": 0.1,
              "emulated_rates": ({"1": 2.0, "2": 2.0} if s < 3 else {"1": 4.0})} for s in range(5)]
    run = load_run_data(write_run(tmp_path / "r", lines))
    # active to the end: end = last step + 1; schedules that change inside one region are joined
    assert straggler_regions([run]) == [Region(0, 5, "ranks 1, 2 at rate 2 / rank 1 at rate 4")]
    lines[2]["step_time_s"] = 0
    assert math.isnan(load_run_data(write_run(tmp_path / "r", lines)).throughput[2])


def test_many_ranks_highlight_slowed_ones(tmp_path):
    from malleus_ds.report.plot import _highlighted_ranks

    w = 32
    lines = []
    for s in range(6):
        mr = [1.0] * w
        mr[20] = 3.0 if s >= 3 else 1.0          # slow by measurement only
        lines.append({"step": s, "samples": 4, "step_time_s": 0.1, "compute_s": [0.1] * w,
                      "emulated_rates": {"7": 4.0} if s >= 2 else {}, "measured_rates": mr})
    d = write_run(tmp_path / "big", lines)
    run = load_run_data(d)
    assert run.world_size == w
    assert _highlighted_ranks(run, run.measured_rates, 1.2) == [7, 20]
    assert main([str(d)]) == 0


def _err(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("malleus-plot: error: ")
    assert "Traceback" not in err
    return err


def test_errors(tmp_path, capsys):
    assert main([str(tmp_path / "nope")]) == 2
    assert "no such folder" in _err(capsys)
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in _err(capsys)
    lines = [json.dumps(x) for x in adaptive_lines()[:5]]
    lines.insert(3, '{"step": 3, "samples": 8, "step_ti')
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main([str(d)]) == 2
    err = _err(capsys)
    assert "metrics.jsonl:4:" in err and "corrupt" in err
    (d / "metrics.jsonl").write_text('{"step": 1, "samples": 8}\n')
    assert main([str(d)]) == 2
    assert "metrics.jsonl:1:" in _err(capsys)
    (d / "metrics.jsonl").write_text('[1, 2]\n')
    assert main([str(d)]) == 2
    assert "metrics.jsonl:1:" in _err(capsys)
    (d / "metrics.jsonl").write_text('{"event": "checkpoint", "step": 3}\n\n')
    assert main([str(d)]) == 2
    assert "no step lines" in _err(capsys)
    (d / "metrics.jsonl").write_text("")
    assert main([str(d)]) == 2
    assert "no step lines" in _err(capsys)
    assert not (d / "throughput.png").exists()


def test_whatif_account_on_the_plot(tmp_path):
    from malleus_ds.report.plot import draw
    from malleus_ds.report.whatif import closing_line

    run = load_run_data(write_run(tmp_path / "run", adaptive_lines()))
    a = run.whatif
    assert a is not None and a.rate_source == "measured"
    slow = [p for p in a.phases if p.rates]
    # emulated onset at step 4 (warm-up step 0 left out); rank 3's median measured rate is 5
    assert [(p.first, p.last, p.rates) for p in slow] == [(4, 29, ((3, 5.0),))]
    # no layout recorded: a static job at the slowest rank's pace, only its compute (0.1 s of
    # a healthy step) 5x; the bound spreads that compute over f = (3 + 1/5) / 4 of the cluster
    t_h = SAMPLES / slow[0].healthy
    assert slow[0].static == pytest.approx(SAMPLES / (t_h + 0.1 * 4))
    assert slow[0].f == pytest.approx(0.8)
    assert slow[0].bound == pytest.approx(SAMPLES / (t_h + 0.1 * 0.25))
    assert slow[0].migrate_s == pytest.approx(0.21) and slow[0].detect_s > 0
    assert "adaptive Malleus lost" in closing_line(a)
    out = draw([run], tmp_path / "p.png", "t")
    assert out.read_bytes()[:4] == b"\x89PNG"
    flat = [{"step": s, "samples": 8, "step_time_s": 0.1} for s in range(3)]
    assert not load_run_data(write_run(tmp_path / "flat", flat)).whatif.stragglers
    # only warm-up steps: no account, the plot is drawn without it
    assert load_run_data(write_run(tmp_path / "one", flat[:1])).whatif is None
    assert main([str(tmp_path / "one")]) == 0


def checked_lines() -> list[dict]:
    """adaptive_lines with the loop's plan checks: plan-bbbb kept its promise (step 16); back on
    plan-aaaa after the recovery, a miss at step 37 (2.09x) and the re-plan that went back to
    plan-bbbb before step 38."""
    extra = {16: [{"event": "check", "step": 16, "plan": "plan-bbbb", "outcome": "kept",
                   "expected_s": 0.25, "measured_s": 0.26, "ratio": 1.04, "margin": 0.3,
                   "expected_from": "re-plan calibration"}],
             37: [{"event": "check", "step": 37, "plan": "plan-aaaa", "outcome": "missed",
                   "expected_s": 0.1, "measured_s": 0.2093, "ratio": 2.093, "margin": 0.3,
                   "expected_from": "healthy pace"},
                  {"event": "replan", "step": 38, "trigger": "missed", "from": "plan-aaaa",
                   "to": "plan-bbbb", "adopted": True, "planning_s": 0.5,
                   "rates_for": [1.0, 1.0, 1.0, 5.0], "measured_rates": [1.0, 1.0, 1.0, 1.0],
                   "reason": "missed its promise ...; back to plan-bbbb, measured 0.180 s/step "
                             "against 0.209 s now"}]}
    out = []
    for x in adaptive_lines():
        out.append(x)
        if "event" not in x:
            out += extra.get(x["step"], [])
    return out


def test_plan_checks_are_drawn(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    from malleus_ds.report.plot import KEPT_COLOR, MISSED_COLOR

    run = load_run_data(write_run(tmp_path / "run", checked_lines()))
    checks = [e for e in run.events if e.kind == "check" or e.trigger == "missed"]
    assert checks == [
        Event("check", 16, "kept ×1.04", outcome="kept"),
        Event("check", 37, "missed ×2.09", outcome="missed"),
        Event("replan", 38, "replan (missed)\nback to previous plan\n0.5 s plan", True, "missed"),
    ]
    assert [e.missed for e in checks] == [False, True, False]
    assert "plan checks: 1 kept, 1 missed (step 37: 2.09x its promise of 0.100 s -> "\
           "re-planned: back to plan-bbbb)" in format_account(run.whatif)

    figs = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, *a, **k: (figs.append(self),
                                                                 save(self, *a, **k))[1])

    def drawn(d):
        figs.clear()
        assert main([str(d)]) == 0 and len(figs) == 1
        ax = figs[0].axes[0]
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        return ax, legend

    ax, legend = drawn(run.path)
    assert "plan check missed (1)" in legend and "plan check kept (1)" in legend
    assert "missed ×2.09" in [t.get_text() for t in ax.texts]      # labelled: the miss only
    assert not any(t.get_text().startswith("kept") for t in ax.texts)
    vlines = {(ln.get_xdata()[0], ln.get_color()) for ln in ax.get_lines()
              if len(ln.get_xdata()) == 2 and ln.get_xdata()[0] == ln.get_xdata()[1]}
    assert (37, MISSED_COLOR) in vlines and not any(x == 16 for x, _ in vlines)
    marks = {(ln.get_xdata()[0], ln.get_marker(), ln.get_markerfacecolor())
             for ln in ax.get_lines() if len(ln.get_xdata()) == 1}
    assert (37, "X", MISSED_COLOR) in marks and (16, "o", "white") in marks
    assert any(ln.get_marker() == "o" and ln.get_markeredgecolor() == KEPT_COLOR
               for ln in ax.get_lines() if len(ln.get_xdata()) == 1)
    # a run without checks: no legend entry for them
    _, legend = drawn(write_run(tmp_path / "plain", adaptive_lines()))
    assert not any("plan check" in x for x in legend)
    # a multirun with checks in one job draws too
    write_run(tmp_path / "multi" / "0", checked_lines(), ["engine=malleus"])
    write_run(tmp_path / "multi" / "1", adaptive_lines(measured=False), ["engine=torch"])
    _, legend = drawn(tmp_path / "multi")
    assert "plan check missed (1)" in legend


def test_a_slow_link_is_shaded_and_accounted(tmp_path):
    """A run whose step lines measure a slow link (``link_rates``): its steps are a shaded
    region of their own, labelled with the link, and its what-if phase is drawn."""
    from tests.unit.report.test_whatif import _link_case
    from malleus_ds.report.plot import draw
    from malleus_ds.report.plot_data import link_regions

    recs, events = _link_case()
    run = load_run_data(write_run(tmp_path / "run", recs + events))
    regs = link_regions([run])
    assert [(r.start, r.end, r.label) for r in regs] == [(10, 20, "link 0-1")]
    assert [p.label for p in run.whatif.phases if p.slow] == ["link 0-1 at 20"]
    assert draw([run], tmp_path / "p.png", "t").read_bytes()[:4] == b"\x89PNG"
    emu = [dict(r, link_rates={}, link_emulated_s=[0.1] * 4 if 10 <= r["step"] < 20 else [0.0] * 4)
           for r in recs]
    run2 = load_run_data(write_run(tmp_path / "emu", emu))
    assert [r.label for r in link_regions([run2])] == ["link (emulated)"]
