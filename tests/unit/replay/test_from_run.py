"""``malleus-sim replay --from-run``: the replay built from a recorded run's own files
(``replay/from_run.py``), on a run folder written here by hand, where every number is known."""
from __future__ import annotations

import json

import pytest
import yaml

from malleus_ds.app.cli import sim_main
from malleus_ds.replay.from_run import FromRunError, build, compare

STEP, COMPUTE = 0.2, 0.1          # a healthy step and its busiest rank's compute (seconds)


def _run(tmp_path, engine="malleus", migrations=True):
    """4 ranks, the tiny model, 24 steps: healthy to step 8, rank 3 at rate 3 for 8 steps, then
    healthy; the job switched before step 11 (0 B, 0.02 s) and back before step 19 (1 MB,
    0.03 s); warm-up steps 0-1."""
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    cfg = {"engine": engine, "plan": "static",
           "model": {"name": "tiny", "num_layers": 4, "hidden_size": 128, "max_seq_len": 128},
           "train": {"global_batch_size": 16, "micro_batch_size": 1, "warmup_steps": 2},
           "parallel": {"tp": 1, "pp": 1, "dp": None}, "cluster": {"nodes": None},
           "malleus": {"detect": {"every": 1}}, "data": {"seq_len": None}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    lines = []
    for k in range(24):
        slow = 8 <= k < 16
        comp = [COMPUTE] * 4
        if slow:
            comp[3] = 3 * COMPUTE
        lines.append({"step": k, "samples": 16, "step_time_s": STEP + (2 * COMPUTE if slow else 0),
                      "compute_s": comp, "emulated_rates": {"3": 3.0} if slow else {},
                      "plan": "plan-a" if k < 11 or k >= 19 else "plan-b"})
    if migrations:
        lines.insert(11, {"event": "replan", "step": 11, "trigger": "onset", "planning_s": 0.5,
                          "measured_rates": [1.0, 1.0, 1.0, 3.0], "adopted": True})
        lines.insert(12, {"event": "migrate", "step": 11, "bytes": 0, "seconds": 0.02})
        lines.append({"event": "replan", "step": 19, "trigger": "recovery", "planning_s": 0.1,
                      "measured_rates": [1.0, 1.0, 1.0, 1.0], "adopted": True})
        lines.append({"event": "migrate", "step": 19, "bytes": 10 ** 6, "seconds": 0.03})
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return run


def test_the_replay_is_built_from_the_runs_own_files(tmp_path):
    rr = build(_run(tmp_path))
    assert rr.problem.num_gpus == 4 and rr.plan.global_batch_size == 16
    assert rr.step_s == pytest.approx(STEP) and rr.compute_share == pytest.approx(COMPUTE / STEP)
    # the straggler starts with step 8 (steps 2-7 healthy) and ends with 16: on the step clock,
    # from the run's first step (the loop saw the warm-up steps 0-1 too)
    (ev,) = rr.trace.events
    assert ev.gpu == 3 and ev.rate == 3.0
    assert (ev.start_s, ev.end_s) == (8, 16) and rr.trace.horizon_s == pytest.approx(24)
    # switch costs: 0 B in 0.02 s and 1 MB in 0.03 s: 0.02 s fixed + 1 MB per 0.01 s
    assert rr.costs.fixed_s == pytest.approx(0.02) and rr.costs.communicators_s == 0.0
    assert rr.costs.network_gbps == pytest.approx(1e6 / 0.01 / 1e9)
    assert rr.planning_s == {"search": 0.5, "healthy": 0.1}
    assert [p["steps"] for p in rr.phases] == [[2, 7], [8, 15], [16, 23]]
    assert [(p["lo"], p["hi"]) for p in rr.phases] == [(2, 8), (8, 16), (16, 24)]
    assert rr.phases[1]["start_s"] == pytest.approx(8 * STEP)
    assert rr.phases[0]["measured_samples_per_s"] == pytest.approx(16 / STEP)


def test_a_batch_the_run_took_from_its_ds_config(tmp_path):
    """train.global_batch_size / micro_batch_size null (the default now): the batch the app
    took from the run's ds_config."""
    run = _run(tmp_path)
    cfg = yaml.safe_load((run / ".hydra" / "config.yaml").read_text())
    cfg["train"].update(global_batch_size=None, micro_batch_size=None)
    cfg["deepspeed"] = {"config": {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 1}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    rr = build(run)
    assert (rr.plan.global_batch_size, rr.plan.micro_batch_size) == (16, 1)
    cfg["deepspeed"] = {"config": {"train_batch_size": 15}}
    (run / ".hydra" / "config.yaml").write_text(yaml.safe_dump(cfg))
    with pytest.raises(FromRunError, match=r"the batch: ds_config train_batch_size=15: 15 is "
                                           r"not a multiple of 1 x dp=4"):
        build(run)


def test_compare_predicts_each_phase_and_names_its_error(tmp_path):
    res = compare(build(_run(tmp_path)))
    healthy, slow, after = res["phases"]
    assert healthy["predicted_samples_per_s"] == pytest.approx(16 / STEP, rel=1e-3)
    assert healthy["error"] == pytest.approx(0.0, abs=1e-3)
    # the static step under rank 3 at rate 3: 0.1 s not compute + 0.3 s of rank 3's compute
    assert slow["predicted_samples_per_s"] > 16 / (STEP + 2 * COMPUTE) * 0.99
    assert res["switches"] >= 1 and res["worst_error"] == max(
        abs(p["error"]) for p in res["phases"])


def test_bad_run_folders_are_named(tmp_path, capsys):
    with pytest.raises(FromRunError, match="no .hydra/config.yaml"):
        build(tmp_path)
    with pytest.raises(FromRunError, match="engine='deepspeed'; --from-run replays an "
                                           "engine=malleus run"):
        build(_run(tmp_path, engine="deepspeed"))
    run = _run(tmp_path / "x")
    assert sim_main(["replay", "--from-run", str(run), "--json", str(tmp_path / "o.json")]) == 0
    out = capsys.readouterr().out
    assert "measured" in out and "predicted" in out and "worst error" in out
    assert json.loads((tmp_path / "o.json").read_text())["phases"]
    assert sim_main(["replay", "--from-run", str(run), "p.json"]) == 2
    assert "give no PROBLEM.json" in capsys.readouterr().err
    assert sim_main(["replay"]) == 2
    assert "or --from-run RUN_DIR" in capsys.readouterr().err


def _edit(run, fn):
    """Rewrite the run's metrics.jsonl line by line (``fn(line) -> line``)."""
    p = run / "metrics.jsonl"
    rows = [fn(json.loads(x)) for x in p.read_text().splitlines()]
    p.write_text("\n".join(json.dumps(x) for x in rows) + "\n")


def test_the_trace_holds_the_slowdown_the_rank_really_ran_at_on_each_plan(tmp_path):
    """Scheduled at 3, rank 3 measured 3.3 on the first plan and 3.6 on the light share of the
    second (an emulated CPU straggler finds its caches cold after each sleep): the trace holds
    the loop's measured rate of each stretch, read once its window holds only that stretch (or
    its last step, in a stretch shorter than the window: ``malleus.detect.window`` 5)."""
    run = _run(tmp_path)

    def measured(x):
        if "event" not in x:
            k = x["step"]
            x["measured_rates"] = [1.0, 1.0, 1.0, 3.3 if k < 11 else 3.6] if 8 <= k < 16 \
                else [1.0] * 4
        return x
    _edit(run, measured)
    rr = build(run)
    a, b = rr.trace.events
    assert (a.gpu, a.rate, b.gpu, b.rate) == (3, 3.3, 3, 3.6)
    assert (a.start_s, a.end_s, b.start_s) == (8, 11, 11)
    assert rr.phases[1]["condition"] == {"3": 3.0}
    assert [(pc.phase, pc.plan, pc.rates) for pc in rr.pieces[1:3]] == \
        [(1, "plan-a", {3: 3.3}), (1, "plan-b", {3: 3.6})]
    # no measured rates (engine=malleus before they were written): the schedule's rate
    (ev,) = build(_run(tmp_path / "plain")).trace.events
    assert ev.rate == 3.0


def test_a_search_on_the_ranks_cores_is_measured_as_a_stall(tmp_path):
    """Step 10 ran while the planner searched (detected at 10, answered before 11): 25% longer
    than steps 8-9 of the same plan and condition; a healthy re-plan (no search, before 19)
    stalls nothing, however slow the steps before it."""
    run = _run(tmp_path)

    def searched(x):
        if x.get("event") == "replan":
            x["detected"] = 10 if x["step"] == 11 else 18
        elif "event" not in x and x["step"] == 10:
            x["step_time_s"] *= 1.25
        elif "event" not in x and x["step"] == 18:     # against 16-17: would count 2x
            x["step_time_s"] *= 2.0
        return x
    _edit(run, searched)
    assert build(run).planner_stall == pytest.approx(0.25)
    assert build(_run(tmp_path / "plain")).planner_stall == 0.0      # no detection recorded


def test_a_run_with_waits_is_replayed_on_its_shared_cores(tmp_path):
    """Step lines with ``wait_s`` (each rank waited as long as it computed: 4 ranks on 2
    cores) give the replay a shared host (``replay/host.py``); its healthy phase is the run's
    own, and the planner's stall is then the host's, not a factor."""
    run = _run(tmp_path)
    _edit(run, lambda x: x if "event" in x else dict(x, wait_s=[COMPUTE] * 4))
    rr = build(run)
    assert rr.host is not None and rr.host.cores == pytest.approx(2.0)
    assert rr.host.other_s == pytest.approx(0.0) and rr.host.ranks_per_host == 4
    res = compare(rr)
    assert res["host"]["cores"] == pytest.approx(2.0)
    assert res["phases"][0]["error"] == pytest.approx(0.0, abs=1e-3)
    assert build(_run(tmp_path / "plain")).host is None


def test_on_a_plan_the_replay_ran_too_the_rate_comes_from_the_runs_own_compute(tmp_path):
    """The run's first plan is the replay's (the static layout, by its id): on it, rank 3's
    rate is its compute per unit over its healthy peers' in the run's own steps (3.0 here:
    three times their compute on the same share), not the loop's lagging reading (3.3);
    steps that held a probe (even) or followed a switch do not count."""
    from malleus_ds.plan import static_plan

    run = _run(tmp_path)
    first = static_plan(4, 16, 1, 1, 1, 4).id

    def named(x):
        if "event" not in x:
            x["plan"] = first if x["plan"] == "plan-a" else x["plan"]
            k = x["step"]
            x["measured_rates"] = [1.0, 1.0, 1.0, 3.3] if 8 <= k < 16 else [1.0] * 4
        return x
    _edit(run, named)
    rr = build(run)
    assert rr.pieces[1].plan == first and rr.pieces[1].rates == {3: 3.3}
    res = compare(rr)
    assert rr.pieces[1].rates == {3: 3.0}
    assert res["phases"][1]["realized"][0] == {"3": 3.0}


def test_each_request_is_charged_the_seconds_of_the_runs_own_request_in_its_turn(tmp_path):
    """A search's seconds vary with what shares the host (1.0-1.8 s in one run): the replay's
    k-th search is charged the run's k-th, past them the median; a request with every rank
    healthy (no search) likewise from the healthy ones, else the wall time here."""
    from malleus_ds.replay.run_costs import charge

    search, healthy = {"problem": {"rates": {"1": 3.0}}}, {"problem": {"rates": {"1": 1.0}}}
    c = charge({"search": 1.5}, {"search": [1.4, 1.8, 1.5]})
    assert [c(0.01, search) for _ in range(4)] == [1.4, 1.8, 1.5, 1.5]
    assert c(0.01, healthy) == 0.01
    c = charge({"search": 1.5, "healthy": 0.2}, {"search": [1.4], "healthy": [0.3]})
    assert (c(0.0, healthy), c(0.0, search), c(0.0, healthy)) == (0.3, 1.4, 0.2)
    # build() keeps the run's own, in order
    assert build(_run(tmp_path)).planning_seq == {"search": [0.5], "healthy": [0.1]}


def _paced(tmp_path, probed_after_10=False):
    """``_run`` on the replay's first plan (the static layout, by its id), rank 0 at 1.5x and
    rank 3 at 3.3x at steps 9 and 10; with ``probed_after_10``, step 11's line says rank 3's
    probe read 3.1 (timed after step 10)."""
    from malleus_ds.plan import static_plan

    run = _run(tmp_path)
    first = static_plan(4, 16, 1, 1, 1, 4).id

    def named(x):
        if "event" not in x:
            x["plan"] = first if x["plan"] == "plan-a" else x["plan"]
            if x["step"] in (9, 10):
                x["compute_s"] = [1.5 * COMPUTE, COMPUTE, COMPUTE, 3.3 * COMPUTE]
            if probed_after_10 and x["step"] == 11:
                x["probe_rates"] = [None, None, None, 3.1]
        return x
    _edit(run, named)
    return run


def test_on_the_runs_plans_every_rank_runs_at_its_own_pace_step_by_step(tmp_path):
    """Rank 0, which the schedule leaves alone, computed 1.5x its healthy pace at step 9 (on
    the replay's first plan) and step 10 (a probe step: not read): the trace holds rank 0 at
    1.5 for step 9 alone, and rank 3 at its own pace there (3.3 at step 9, the only step read:
    the piece's median too, steps 8-10 of that plan in one event)."""
    rr = build(_paced(tmp_path))
    compare(rr)
    assert rr.pieces[1].each[9] == {0: 1.5, 1: 1.0, 2: 1.0, 3: 3.3}
    assert 10 not in rr.pieces[1].each                   # step 10 held a probe
    ev = [(e.start_s, e.end_s, e.gpu, e.rate) for e in rr.trace.events]
    assert (9.0, 10.0, 0, 1.5) in ev and (8.0, 11.0, 3, 3.3) in ev
    assert not [e for e in ev if e[2] == 0 and e != (9.0, 10.0, 0, 1.5)]


def test_the_runs_probe_readings_are_kept_by_the_step_they_were_timed_after(tmp_path):
    """Step 19's line read rank 3's probe at 1.22 (timed after step 18), step 21's at 0.97:
    the pieces keep them by step index (``RunReplay.record`` too, for the replay's loop); the
    trace does not hold them (a probe's reading is not its rank's compute rate)."""
    run = _run(tmp_path)

    def probes(x):
        if "event" not in x and x["step"] in (19, 21):
            x["probe_rates"] = [None, None, None, 1.22 if x["step"] == 19 else 0.97]
        return x
    _edit(run, probes)
    rr = build(run)
    assert rr.pieces[-2].probes == {18: {3: 1.22}} and rr.pieces[-1].probes == {20: {3: 0.97}}
    assert [(e.start_s, e.end_s, e.gpu, e.rate) for e in rr.trace.events] == [(8, 16, 3, 3.0)]


def test_the_healthy_step_is_the_median_of_the_first_plans_steady_healthy_steps(tmp_path):
    """Steps 2-3 ran 1.6x slow while the job started, steps 20-23 (the first plan again, after
    the straggler; 19 followed a switch) 0.9x: the start-up is left out (slower than 1.1x the
    median of them all), and the healthy step is the median of steps 4-7 and 20-23. The
    host knows the stragglers slept (the default ``straggler.method``): its probes do not
    sustain."""
    run = _run(tmp_path)

    def paced(x):
        if "event" not in x:
            k = x["step"]
            f = 1.6 if k in (2, 3) else 0.9 if k >= 19 else 1.0
            x["step_time_s"] = round(x["step_time_s"] * f, 6)
            x["wait_s"] = [0.0] * 4
        return x
    _edit(run, paced)
    rr = build(run)
    assert rr.step_s == pytest.approx(0.95 * STEP)
    assert rr.host is not None and rr.host.sleeps and not rr.host.probes_sustain
    cfg = run / ".hydra" / "config.yaml"
    cfg.write_text(yaml.safe_dump(dict(yaml.safe_load(cfg.read_text()),
                                       straggler={"method": "quota"})))
    assert not build(run).host.sleeps and build(run).host.probes_sustain


def test_the_record_holds_what_the_runs_loop_read_on_its_plans(tmp_path):
    """``RunReplay.record``: each step's plan and compute; where the run wrote its probes, who
    probed after each step on that plan (none: an empty dict) and what they read; nothing on
    another plan, nor anywhere in a run that wrote no probes."""
    run = _run(tmp_path)
    _edit(run, lambda x: x if "event" in x or x["step"] != 13 else
          dict(x, probe_rates=[None, None, None, 2.9]))
    rec = build(run).record
    assert rec.compute_s(0, "plan-a") == (COMPUTE,) * 4 and rec.compute_s(0, "plan-b") is None
    assert rec.probes(12, "plan-b") == {3: 2.9}               # timed after step 12
    assert rec.probes(13, "plan-b") == {} and rec.probes(12, "plan-a") is None
    plain = build(_run(tmp_path / "plain")).record
    assert plain.probes(12, "plan-b") is None and plain.compute_s(12, "plan-b") is not None
    # the seconds its pace check read; when it took each answer (detected at step 10, the step
    # after the request, answered before 11; detected at 18, answered before 19): by index,
    # from the run's first step
    assert rec.step_s(0, "plan-a") == pytest.approx(STEP) and rec.step_s(0, "plan-b") is None
    _edit(run, lambda x: dict(x, detected=10 if x["step"] == 11 else 18)
          if x.get("event") == "replan" else x)
    rec = build(run).record
    assert rec.answers == {9: 11, 17: 19}
    assert rec.answered(9, "plan-a") == 11 and rec.answered(9, "plan-b") is None
    assert rec.answered(17, "plan-b") == 19 and rec.answered(10, "plan-a") is None


def test_where_the_run_wrote_its_probes_only_the_ranks_that_probed_are_left_out(tmp_path):
    """As in ``test_on_the_runs_plans_every_rank_runs_at_its_own_pace_step_by_step``, rank 0
    computed 1.5x at steps 9 and 10; the run wrote its probes and none probed after step 10
    but rank 3: that step is read for every rank but rank 3 (a probe's seconds ride in its
    rank's ``compute_s``), and so is step 8 (no probe)."""
    rr = build(_paced(tmp_path, probed_after_10=True))
    compare(rr)
    assert rr.pieces[1].each[10] == {0: 1.5, 1: 1.0, 2: 1.0}
    assert rr.pieces[1].each[8] == {0: 1.0, 1: 1.0, 2: 1.0, 3: 3.0}
    assert rr.pieces[1].rates == {3: 3.15}                   # steps 8 and 9: 3.0 and 3.3


def test_on_a_probe_step_the_calibrating_ranks_compute_is_not_read():
    """``refine``: a plan with held rank 3 (at 3x) and rank 0 calibrating its probes
    (``refs``); the run wrote its probes. After even step 10 rank 0 timed the probe block
    twice, and those seconds ride in its ``compute_s`` (1.5x): that step is not read for
    rank 0, step 11 is; without ``refs`` rank 0 reads 1.5 at step 10."""
    from malleus_ds.replay.run_trace import Piece, refine

    u, s = [4.0, 8.0, 8.0, 2.0], 0.01

    def line(k, f0):
        return {"step": k, "compute_s": [f0 * 4 * s, 8 * s, 8 * s, 3 * 2 * s]}

    def pieces():
        return [Piece(1, "p", (line(10, 1.5), line(11, 1.0)), 10, 12, {3: 3.0},
                      probes={11: {3: 3.1}})]
    with_ref, without = pieces(), pieces()
    refine(with_ref, {"p": u}, s, 2, refs={"p": 0})
    refine(without, {"p": u}, s, 2)
    assert with_ref[0].each == {10: {1: 1.0, 2: 1.0, 3: 3.0}, 11: {0: 1.0, 1: 1.0, 2: 1.0}}
    assert without[0].each[10][0] == pytest.approx(1.5)
    assert with_ref[0].rates == {3: 3.0}


def test_bench_from_run_reads_a_set_of_runs(tmp_path, capsys):
    """``bench/bench_from_run.py``: a row per run it can replay, the count within the bound,
    an engine=deepspeed folder named and skipped; exit 0 only when every run is within it."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "bench" / "bench_from_run.py"
    spec = importlib.util.spec_from_file_location("bench_from_run", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    good, ds = _run(tmp_path / "a"), _run(tmp_path / "b", engine="deepspeed")
    rc = bench.main([str(good), str(ds), "--json", str(tmp_path / "out.json")])
    out, err = capsys.readouterr()
    assert "engine='deepspeed'" in err and "runs within 15% in every phase: " in out
    rows = json.loads((tmp_path / "out.json").read_text())
    assert list(rows) == [str(good)] and len(rows[str(good)]) == 2
    assert rc == (0 if all(abs(e) <= 0.15 for e in rows[str(good)]) else 1)
    assert bench.main([str(ds)]) == 2
