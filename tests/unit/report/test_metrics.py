"""The one checked metrics.jsonl reader (``metrics.read_metrics_file``, ``metrics.read_run``) and
the four tools that use it (``malleus-plot``, ``launch/summarize.py``, ``compare.py``,
``whatif.py``): the same step/event split, one wording for a bad line, each tool's own error
class and prefix."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from malleus_ds.report import compare, plot, plot_data, whatif
from malleus_ds.report.metrics import (
    METRICS_FILE,
    MetricsError,
    MetricsFile,
    MetricsWriter,
    StepRecord,
    read_metrics,
    read_metrics_file,
    read_run)

REPO = Path(__file__).resolve().parents[3]


def _summarize():
    spec = importlib.util.spec_from_file_location("summarize", REPO / "launch" / "summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def step(s, **kw):
    return {"step": s, "loss": 1.0, "samples": 8, "step_time_s": 0.5, **kw}


def lines_of(*objs) -> str:
    return "".join((o if isinstance(o, str) else json.dumps(o)) + "\n" for o in objs)


def run_dir(tmp_path, text: str, name="run") -> Path:
    d = tmp_path / name
    d.mkdir(parents=True, exist_ok=True)
    (d / METRICS_FILE).write_text(text)
    return d


NEW = [step(0, compute_s=[0.1, 0.1], emulated_s=[0, 0], emulated_rates={}, plan="plan-a",
            measured_rates=[None, None]),
       step(1, compute_s=[0.1, 0.4], emulated_s=[0, 0.3], emulated_rates={"1": 4.0},
            plan="plan-a", measured_rates=[1.0, 3.9]),
       {"event": "replan", "step": 1, "trigger": "onset", "adopted": True, "planning_s": 0.5},
       {"event": "future_kind", "payload": [1, 2, 3]},               # unknown: kept
       {"event": "migrate", "step": 2, "bytes": 1024, "seconds": 0.1},
       step(2, compute_s=[0.1, 0.4], emulated_s=[0, 0.3], emulated_rates={"1": 4.0},
            plan="plan-b", measured_rates=[1.0, 4.0]),
       {"event": "hang", "stuck": [], "waiting": [], "reason": "x"},   # no step: fine
       step(3, compute_s=[0.1, 0.4], emulated_s=[0, 0.3], emulated_rates={"1": 4.0},
            plan="plan-b", measured_rates=[1.0, 4.0])]


def test_steps_events_and_an_unknown_kind(tmp_path):
    d = run_dir(tmp_path, lines_of(*NEW[:3]) + "\n   \n" + lines_of(*NEW[3:]))   # blank lines
    f = read_metrics_file(d / METRICS_FILE)
    assert isinstance(f, MetricsFile) and f.path == d / METRICS_FILE
    assert [r["step"] for r in f.steps] == [0, 1, 2, 3]
    assert [e["event"] for e in f.events] == ["replan", "future_kind", "migrate", "hang"]
    assert f.events_of("replan", "migrate") == [NEW[2], NEW[4]]
    assert f.events_of("future_kind") == [NEW[3]]
    with pytest.raises(AttributeError):
        f.steps = ()                                             # frozen
    # the wrappers: the same lines
    assert read_metrics(d) == list(f.steps) and read_metrics(d, events=True) == list(f.events)
    assert read_run(d) == read_run(d / METRICS_FILE) == (list(f.steps), list(f.events))


def test_a_folder_instead_of_a_file(tmp_path):
    d = run_dir(tmp_path, lines_of(*NEW))
    a, b = read_metrics_file(d), read_metrics_file(d / METRICS_FILE)
    assert a == b and a.path == d / METRICS_FILE


def test_writer_output_reads_back(tmp_path):
    w = MetricsWriter(tmp_path)
    w.write(StepRecord(0, 5.0, 8, 0.2, (0.1, 0.1), (0.0, 0.0), {}))
    w.write(StepRecord(1, 4.9, 8, 0.3, (0.1, 0.2), (0.0, 0.1), {"1": 2.0}, "plan-x",
                       (None, 2.0), (0.01, 0.0), probe_rates=(None, 1.8)))
    w.write(StepRecord(2, 4.8, 8, 0.3, (0.1, 0.2), (0.0, 0.1), {}, "plan-x",
                       probe_rates=(None, None)))
    w.write_event({"event": "checkpoint", "step": 1, "path": "/x", "seconds": 0.1})
    w.close()
    f = read_metrics_file(tmp_path)
    assert len(f.steps) == 3 and f.steps[1]["measured_rates"] == [None, 2.0]
    assert "wait_s" not in f.steps[0] and f.steps[1]["wait_s"] == [0.01, 0.0]
    # a probe read: its rate per rank; none read: no key
    assert f.steps[1]["probe_rates"] == [None, 1.8] and "probe_rates" not in f.steps[2]
    assert f.events[0]["event"] == "checkpoint"


def test_bad_json_names_file_and_line(tmp_path):
    d = run_dir(tmp_path, lines_of(step(0), step(1)) + '{"step": 2, "st')   # cut short
    p = d / METRICS_FILE
    with pytest.raises(MetricsError) as ei:
        read_metrics_file(d)
    e = ei.value
    assert isinstance(e, ValueError) and (e.path, e.line) == (p, 3)
    assert str(e).startswith(f"{p}: line 3 is not valid JSON (")
    assert "the file is corrupt or was cut short" in str(e)
    # in the middle of the file too
    run_dir(tmp_path, lines_of(step(0), "{not json", step(2)))
    with pytest.raises(MetricsError, match=r"metrics.jsonl: line 2 is not valid JSON"):
        read_metrics_file(d)


@pytest.mark.parametrize("line", ["[1, 2]", "3", '"step"', "null"])
def test_a_line_that_is_no_object(tmp_path, line):
    d = run_dir(tmp_path, lines_of(step(0), line))
    with pytest.raises(MetricsError) as ei:
        read_metrics_file(d)
    assert str(ei.value) == f"{d / METRICS_FILE}: line 2 is not a JSON object: {line}"


@pytest.mark.parametrize("obj, what", [
    ({"step": 1}, "a step line without ['step_time_s', 'samples']"),
    ({"loss": 1.0}, "a step line without ['step', 'step_time_s', 'samples']"),
    (step(1, samples="8"), "a step line without numeric ['samples'] (samples='8')"),
    (step(1, step=True), "a step line without numeric ['step'] (step=True)"),
    (step(1, compute_s="fast"), "a step line whose compute_s is 'fast', not a list of numbers"),
    (step(1, measured_rates=[1.0, "x"]), "a step line whose measured_rates is [1.0, 'x']"),
    (step(1, emulated_rates={"a": 2.0}), "a step line whose emulated_rates is {'a': 2.0}"),
    (step(1, rates=[2.0]), "a step line whose rates is [2.0], not an object"),
    (step(1, plan=3), "a step line whose plan is 3, not a plan id"),
    ({"event": "replan", "trigger": "onset"}, 'a replan event without "step"'),
    ({"event": "migrate", "step": "9"}, "a migrate event whose step is '9', not a number"),
    ({"event": "checkpoint", "step": None}, "a checkpoint event whose step is None"),
    ({"event": 7}, 'an event line whose "event" is 7, not a name'),
])
def test_bad_lines_say_what_is_wrong(tmp_path, obj, what):
    d = run_dir(tmp_path, lines_of(step(0), obj))
    with pytest.raises(MetricsError) as ei:
        read_metrics_file(d)
    assert ei.value.line == 2 and str(ei.value).startswith(f"{d / METRICS_FILE}: line 2 is {what}")


def test_unreadable_file(tmp_path):
    with pytest.raises(MetricsError) as ei:
        read_metrics_file(tmp_path / "nope")            # a folder without metrics.jsonl
    assert ei.value.line is None and str(ei.value).startswith(f"{tmp_path / 'nope'}: cannot read:")
    (tmp_path / METRICS_FILE).write_bytes(b'{"step": 0}\xff\xfe\n')
    with pytest.raises(MetricsError, match=r"metrics.jsonl: cannot read: .*codec"):
        read_metrics_file(tmp_path)


def test_empty_and_events_only_are_no_error_here(tmp_path):
    d = run_dir(tmp_path, "")
    assert read_metrics_file(d) == MetricsFile(d / METRICS_FILE, (), ())
    run_dir(tmp_path, lines_of({"event": "checkpoint", "step": 3}))
    f = read_metrics_file(d)
    assert f.steps == () and len(f.events) == 1


OLD = [  # an early run folder: "rates" (before the rename), no plan / measured_rates
    {"step": 0, "loss": 5.0, "samples": 8, "step_time_s": 0.2, "compute_s": [0.1, 0.1],
     "emulated_s": [0.0, 0.0], "rates": {}},
    {"step": 1, "loss": 4.9, "samples": 8, "step_time_s": 0.2, "compute_s": [0.1, 0.1],
     "emulated_s": [0.0, 0.0], "rates": {}},
    {"step": 2, "loss": 4.8, "samples": 8, "step_time_s": 0.5, "compute_s": [0.1, 0.4],
     "emulated_s": [0.0, 0.3], "rates": {"1": 4.0}},
    {"step": 3, "loss": 4.7, "samples": 8, "step_time_s": 0.5, "compute_s": [0.1, 0.4],
     "emulated_s": [0.0, 0.3], "rates": {"1": 4.0}},
]
OLDEST = [{"step": s, "samples": 8, "step_time_s": 1.0} for s in range(4)]


@pytest.mark.parametrize("recs", [OLD, OLDEST], ids=["rates", "bare"])
def test_an_old_run_folder_reads_everywhere(tmp_path, recs, capsys):
    d = run_dir(tmp_path, lines_of(*recs))
    f = read_metrics_file(d)
    assert list(f.steps) == recs and f.events == ()
    run = plot_data.load_run_data(d)
    assert run.steps.tolist() == [0, 1, 2, 3] and run.measured_rates is None
    a = whatif.account_of_run(d, warmup=1)
    assert a.rate_source == ("emulated" if recs is OLD else "none")
    assert read_run(d) == (recs, [])
    assert _summarize().main([str(d)]) == 0
    tput = "16.0" if recs is OLD else "8.0"                  # 8 samples / median step time
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[1:] == ["3", "0.500s" if recs is OLD else "1.000s", tput, "1.00x"]


def test_the_four_callers_split_one_file_alike(tmp_path):
    d = run_dir(tmp_path, lines_of(*NEW))
    f = read_metrics_file(d)
    steps, events = list(f.steps), list(f.events)
    assert plot_data.parse_metrics(d / METRICS_FILE) == (steps, events)
    assert read_run(d) == (steps, events)                    # summarize and compare read so
    assert whatif.read_lines(d) == (steps, events)
    assert whatif.read_lines(d / METRICS_FILE) == (steps, events)
    run = plot_data.load_run_data(d)                          # plot draws replan/migrate only
    assert run.steps.tolist() == [r["step"] for r in steps]
    assert [(e.kind, e.step) for e in run.events] == [("replan", 1), ("migrate", 2)]


def test_summarize_reads_a_run_once(tmp_path, monkeypatch, capsys):
    import malleus_ds.report.metrics as m

    d = run_dir(tmp_path, lines_of(*OLD))
    real, read = m.read_metrics_file, []
    monkeypatch.setattr(m, "read_metrics_file", lambda p: read.append(p) or real(p))
    assert _summarize().main([str(d)]) == 0
    assert read == [d]                                       # table and what-if: one read
    assert "what-if (rates: emulated" in capsys.readouterr().out


def test_each_caller_keeps_its_error_class_and_prefix(tmp_path, capsys):
    d = run_dir(tmp_path, lines_of(step(0), step(1)) + '{"step": 2, "st', name="cmp/x")
    p = d / METRICS_FILE
    with pytest.raises(plot_data.PlotError, match=rf"^{p}:3: corrupt line: not valid JSON \("):
        plot_data.parse_metrics(p)
    assert plot.main([str(d)]) == 2
    assert capsys.readouterr().err.startswith(f"malleus-plot: error: {p}:3: corrupt line: ")
    summ = _summarize()
    assert summ.main([str(d)]) == 2
    assert capsys.readouterr().err.startswith(f"summarize: {p}: line 3 is not valid JSON")
    with pytest.raises(compare.CompareError, match=rf"^{p}: line 3 is not valid JSON"):
        compare.report(d.parent, ["x"], warmup=0)
    with pytest.raises(whatif.WhatIfError, match=rf"^{p}: line 3 is not valid JSON"):
        whatif.account_of_run(d)
    # a file without step lines: each tool's own word for it
    run_dir(tmp_path, lines_of({"event": "checkpoint", "step": 3}), name="cmp/x")
    with pytest.raises(plot_data.PlotError, match=r"metrics.jsonl: no step lines$"):
        plot_data.parse_metrics(p)
    with pytest.raises(whatif.WhatIfError, match=r"no step lines \(1 event line\(s\)\)"):
        whatif.read_lines(d)
    assert summ.table([str(d)], skip=0) == []               # summarize leaves the run out
    with pytest.raises(compare.CompareError, match="run x has no step lines"):
        compare.report(d.parent, ["x"], warmup=0)


def test_one_healthy_threshold():
    from malleus_ds.adaptive import detect, rates

    assert detect.HEALTHY == 1.2 == detect.DetectConfig().healthy
    assert plot.HEALTHY is detect.HEALTHY and whatif.HEALTHY is detect.HEALTHY
    assert rates.HEALTHY is detect.HEALTHY
