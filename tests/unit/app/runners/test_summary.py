"""The end-of-run summary describes what actually ran: a plan's layout and batch sizes win."""
from malleus_ds.plan import Plan
from malleus_ds.app.runners.base import RunSummary
from malleus_ds.app.runners.common import format_summary
from tests.configs import cfg

HETERO = {"version": 1, "num_layers": 4, "global_batch_size": 8, "micro_batch_size": 1,
          "pipelines": [{"micro_batches": 5, "stages": [{"ranks": [0, 1], "layers": [0, 4]}]},
                        {"micro_batches": 3, "stages": [{"ranks": [2], "layers": [0, 2]},
                                                        {"ranks": [3], "layers": [2, 4]}]}],
          "suspended": [4]}


def test_describe_plan():
    assert Plan.from_json(HETERO).describe() == (
        "2 pipelines: [TP2 0-4] x5 | [TP1 0-2, TP1 2-4] x3; suspended [4]")


def test_summary_uses_plan_layout_and_batch():
    c = cfg(world=5, train={"global_batch_size": 20, "micro_batch_size": 2})
    s = RunSummary(engine="malleus", losses=(5.5, 5.0), step_times_s=(0.2, 0.1),
                   samples_per_step=8, extra={"plan": HETERO})
    text = format_summary(c, s)
    assert "global_batch=8 micro_batch=1" in text
    assert "tp=" not in text.splitlines()[0]
    assert "plan: 2 pipelines: [TP2 0-4] x5 | [TP1 0-2, TP1 2-4] x3; suspended [4]" in text


def test_summary_without_plan_shows_parallel_degrees():
    c = cfg(world=2)
    s = RunSummary(engine="torch", losses=(5.5,), step_times_s=(0.2,), samples_per_step=8)
    assert "(tp=1 pp=1 dp=2)" in format_summary(c, s)


def test_summary_and_summarize_give_the_whatif_account(tmp_path, capsys):
    import importlib.util
    import json

    from tests.unit.report.test_whatif import hand_case

    recs, ev = hand_case()
    f = tmp_path / "metrics.jsonl"
    f.write_text("".join(json.dumps(x) + "\n" for x in recs + ev))
    line = ("stragglers would have cost a static job 45.7% of this run; adaptive Malleus lost "
            "33.6%; the bound is 17.4%")
    # the end-of-run summary: the static layout of parallel.* (here pp=2: 2 layers per stage)
    c = cfg(world=2, parallel={"pp": 2, "dp": None}, model={"name": "tiny", "num_layers": 4},
            train={"global_batch_size": 8, "micro_batch_size": 2})
    s = RunSummary(engine="malleus", losses=(1.0,) * 20, step_times_s=(1.0,) * 20,
                   samples_per_step=8, metrics_path=str(f))
    text = format_summary(c, s)
    assert "what-if (rates: measured; static: simulated 1F1B step" in text and line in text
    # launch/summarize.py: no .hydra/config.yaml in the folder -> the slowest rank's pace
    spec = importlib.util.spec_from_file_location("summarize", "launch/summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout not recorded" in out and line in out     # the same numbers here
    f.write_text('{"event": "migrate", "step": 1}\n')
    assert mod.main([str(tmp_path)]) == 1
    assert "no step lines" in capsys.readouterr().err
    assert "what-if: " in format_summary(c, s) and "no step lines" in format_summary(c, s)


def test_summarize_prints_the_overrides_hydra_wrote(tmp_path, capsys):
    """One reader of .hydra/overrides.yaml (``run_folder.read_overrides``, YAML): a quoted
    override prints as typed; hydra.* and nproc_per_node are left out."""
    import importlib.util
    import json

    from omegaconf import OmegaConf

    from malleus_ds.report.run_folder import read_overrides

    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "samples": 8, "step_time_s": 0.5}) + "\n" for s in range(3)))
    ov = ["engine=malleus", "hydra.run.dir=x", "nproc_per_node=2", "train.note=a: b", "~foo"]
    OmegaConf.save(OmegaConf.create(ov), run / ".hydra" / "overrides.yaml")   # as Hydra does
    assert read_overrides(run) == ov
    spec = importlib.util.spec_from_file_location("summarize", "launch/summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main([str(run)]) == 0
    row = capsys.readouterr().out.splitlines()[1]
    assert row.endswith("1.00x  engine=malleus train.note=a: b ~foo")
    assert mod.overrides(tmp_path) == "" and read_overrides(tmp_path) is None


def test_summarize_and_plot_find_the_same_runs(tmp_path, capsys):
    """One search (``run_folder.find_runs``): at any depth (a sweep of compare runs is two deep),
    in natural order; a folder holding metrics.jsonl is one run."""
    import importlib.util
    import json

    from malleus_ds.report.plot_data import load_runs
    from malleus_ds.report.run_folder import find_runs

    sweep = tmp_path / "sweep"
    jobs = [sweep / j / e for j in ("0", "2", "10") for e in ("deepspeed", "malleus")]
    for d in reversed(jobs):
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text(json.dumps({"step": 1, "samples": 8,
                                                     "step_time_s": 0.5}) + "\n")
    (sweep / "multirun.yaml").write_text("hydra: {}\n")
    assert find_runs(sweep) == jobs
    assert find_runs(jobs[0]) == [jobs[0]] and find_runs(tmp_path / "nope") == []
    assert [r.path for r in load_runs(sweep)] == jobs
    spec = importlib.util.spec_from_file_location("summarize", "launch/summarize.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.run_dirs([str(sweep)]) == jobs
    assert mod.run_dirs([str(jobs[1] / "metrics.jsonl")]) == [jobs[1]]
    assert mod.main([str(sweep), "--skip", "0"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > len(jobs)


def test_one_text_per_event():
    """``metrics.format_event``: the summary's and progress bar's line, and (short) the label
    malleus-plot draws; app/runners/common.py and plot.py both use it."""
    from malleus_ds.report import plot_data
    from malleus_ds.report.metrics import format_event
    from malleus_ds.app.runners import common

    rp = {"event": "replan", "step": 20, "trigger": "change", "measured_rates": [1.0, 5.3],
          "from": "plan-b", "to": "plan-c", "planning_s": 0.7, "predicted_step_s": [0.26, 0.25],
          "adopted": False, "reason": "no gain"}
    mg = {"event": "migrate", "step": 9, "from": "plan-a", "to": "plan-b", "bytes": 3 * 2**30,
          "seconds": 1.5, "peak_extra_bytes": 2**31}
    assert format_event(rp) == ("replan before step 20 (change; measured rank 1 5.3): planned "
                                "in 0.70 s, step 0.26 s -> 0.25 s predicted, kept plan-b "
                                "(no gain)")
    assert format_event(mg) == ("migrate before step 9: plan-a -> plan-b, 3072.00 MiB sent in "
                                "1.500 s, 2048.00 MiB extra at peak")
    assert format_event(rp, short=True) == "replan (change)\nnot adopted\n0.7 s plan"
    assert format_event(mg, short=True) == "migrate 3.00 GiB, 1.50 s"
    assert [e.label for e in plot_data.extract_events([rp, mg])] == [     # in step order
        format_event(mg, short=True), format_event(rp, short=True)]
    assert common.format_event is format_event


def test_check_events_in_the_summary_and_live():
    """A plan check is one line in the end-of-run summary; the progress bar prints a missed one
    when it happens (a kept one only goes to metrics.jsonl and the summary)."""
    from malleus_ds.app.runners.common import shown_live

    missed = {"event": "check", "step": 14, "plan": "plan-f02193b9", "outcome": "missed",
              "expected_s": 0.43, "measured_s": 0.9, "ratio": 2.093, "margin": 0.3,
              "expected_from": "healthy pace"}
    kept = dict(missed, step=30, outcome="kept", measured_s=0.42, ratio=0.977)
    s = RunSummary(engine="malleus", losses=(5.5,), step_times_s=(0.2,), samples_per_step=8,
                   extra={"events": [missed, kept]})
    lines = format_summary(cfg(world=2), s).splitlines()
    assert ("  check at step 14: plan-f02193b9 missed its promise: 0.900 s/step measured, "
            "0.430 s promised (2.09x, margin 30%, promise from healthy pace)") in lines
    assert any(x.startswith("  check at step 30: plan-f02193b9 kept its promise") for x in lines)
    assert not any("{" in x for x in lines)                  # no event printed as a dict
    assert shown_live(missed) and not shown_live(kept)
    assert shown_live({"event": "replan"}) and shown_live({"event": "migrate"})
    assert not shown_live({"event": "checkpoint", "step": 3})
