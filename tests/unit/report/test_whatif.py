"""malleus_ds/report/whatif.py: the what-if account of a run, checked against hand-computed numbers."""
from __future__ import annotations

import json

import pytest

from malleus_ds.cost import step_time
from malleus_ds.problem import Problem
from malleus_ds.report.whatif import (
    Layout,
    WhatIfError,
    account,
    account_of_run,
    closing_line,
    format_account,
    layout_from_config,
    static_keep,
    static_model)

# 2 ranks as 2 pipeline stages of 2 layers each, 4 micro-batches of 2 samples
PP2 = Layout(tp=1, pp=2, dp=1, num_layers=4, global_batch_size=8, micro_batch_size=2)


def hand_case(measured: bool = True) -> tuple[list[dict], list[dict]]:
    """Steps 0-9 healthy at 1 s, 0.8 s of it compute (the pipeline's busy share 8/10); steps
    10-19 rank 1 at rate 3: 2.9 s per step until the re-plan before step 13 (a 0.4 s
    migration), 1.5 s after it. 8 samples per step. The measured rates are null at first and
    lag the onset by two steps, as the loop's smoothing (adaptive/rates.py) does."""
    recs = []
    for s in range(20):
        slow = s >= 10
        rec = {"step": s, "loss": 1.0, "samples": 8,
               "step_time_s": 1.0 if not slow else (2.9 if s < 13 else 1.5),
               "compute_s": [0.8, 2.4 if slow else 0.8], "emulated_s": [0.0, 1.6 if slow else 0.0],
               "emulated_rates": {"1": 3.0} if slow else {}}
        if measured:
            rec["plan"] = "plan-a" if s < 13 else "plan-b"
            rec["measured_rates"] = [None, None] if s < 2 else [1.0, 3.0 if s >= 12 else 1.0]
        recs.append(rec)
    events = [{"event": "replan", "step": 13, "trigger": "onset", "adopted": True,
               "from": "plan-a", "to": "plan-b"},
              {"event": "migrate", "step": 13, "from": "plan-a", "to": "plan-b", "bytes": 10,
               "seconds": 0.4}]
    return recs, events


def test_static_step_time_by_hand():
    # healthy: stage times [2, 2] -> 2+2 + (4-1)*2 = 10; rank 1 (the last stage) at rate 3:
    # [2, 6] -> 2+6 + 3*6 = 26 (cost model = simulated 1F1B here): the static plan keeps 10/26
    prob = Problem(name="x", nodes=1, gpus_per_node=2, num_layers=4, global_batch_size=8,
                   micro_batch_size=2, tp=1, pp=2, dp=1, tp_slowdown={1: 1.0}, memory=None,
                   rates={})
    plan = prob.static_plan()
    assert step_time(prob, plan) == 10 and step_time(prob.with_rates({1: 3.0}), plan) == 26
    m = static_model(PP2, {1: 3.0}, 2)
    assert (m.healthy, m.slowed, m.busy) == pytest.approx((10, 26, 8))   # busy: 2 layers x 4
    assert "simulated 1F1B" in m.how and "pp=2" in m.how
    # a 1 s healthy step with 0.8 s of compute: 16 more units at 0.8/8 s each -> 2.6 s
    assert static_keep(m, 1.0, 0.8) == pytest.approx(1 / 2.6)
    assert static_keep(m, 1.0, 0.5) == pytest.approx(1 / 2.0)
    assert static_keep(m, 1.0, None) == pytest.approx(10 / 26)   # no compute_s: all scales
    # the first stage slow: the simulator's 1F1B (24) is below the cost model's bound (26)
    assert static_model(PP2, {0: 3.0}, 2).slowed == pytest.approx(24)
    # no layout, or one of another world size: the slowest rank sets the pace
    m = static_model(None, {1: 3.0}, 2)
    assert (m.healthy, m.slowed, m.busy) == (1, 3, 1)
    assert m.how == "slowest rank's pace (layout not recorded: exact for pp=1)"
    assert "has 2 ranks, the run 4" in static_model(PP2, {1: 3.0}, 4).how


def test_hand_computed_account():
    recs, ev = hand_case()
    a = account(recs, ev, PP2, warmup=1)
    assert a.rate_source == "measured" and a.adaptive and a.world == 2
    healthy, slow = a.phases
    assert (healthy.first, healthy.last, healthy.rates) == (1, 9, ())
    assert (slow.first, slow.last, slow.rates) == (10, 19, ((1, 3.0),))   # median of 3s
    H = 72 / 9                                          # steps 1-9: 72 samples in 9 s
    assert slow.healthy == healthy.healthy == pytest.approx(H)
    assert slow.static == pytest.approx(8 / 2.6)        # 2.6 s per step (above)
    # f = (1 + 1/3) / 2: the 0.8 s of compute spread over 2/3 of the compute: 1 + 0.4 s
    assert slow.f == pytest.approx((1 + 1 / 3) / 2)
    assert slow.bound == pytest.approx(8 / 1.4)
    assert slow.seconds == pytest.approx(3 * 2.9 + 7 * 1.5 + 0.4)   # 19.6 s
    assert slow.achieved == pytest.approx(80 / 19.6)
    assert slow.migrate_s == pytest.approx(0.4)
    # 3 steps before the switch took 8.7 s; at the after-switch pace they take 4.5 s
    assert slow.detect_s == pytest.approx(8.7 - 3 * 1.5)
    assert slow.lost_s == pytest.approx(19.6 - 10)
    assert healthy.detect_s is None and healthy.lost_s == pytest.approx(0)
    # over the run: healthy 152/8 = 19 s; static 9 + 10*2.6 = 35 s; bound 9 + 10*1.4 = 23 s;
    # the job 9 + 19.6 = 28.6 s
    assert (a.t_healthy, a.t_static, a.t_bound, a.t_job) == pytest.approx((19, 35, 23, 28.6))
    assert (a.x, a.y, a.z) == pytest.approx((16 / 35, 9.6 / 28.6, 4 / 23))
    assert closing_line(a) == ("stragglers would have cost a static job 45.7% of this run; "
                               "adaptive Malleus lost 33.6%; the bound is 17.4%")
    text = format_account(a)
    assert "rank 1 at rate 3" in text and "10-19" in text and "4.20" in text and "9.60" in text
    # without a layout: the slowest rank's pace, its compute 3x: 1 + 0.8*2 = 2.6 s per step
    b = account(recs, ev, None, warmup=1)
    assert b.t_static == pytest.approx(35) and "layout not recorded" in format_account(b)
    # without compute_s (older files): the whole step scales, the bound is f x healthy
    bare = [{k: v for k, v in r.items() if k != "compute_s"} for r in recs]
    c = account(bare, ev, PP2, warmup=1)
    assert (c.t_static, c.t_bound) == pytest.approx((9 + 26, 9 + 15))
    assert "no compute_s: the whole step scales" in format_account(c)
    d = account(bare, ev, None, warmup=1)
    assert (d.t_static, d.t_bound) == pytest.approx((9 + 30, 9 + 15))
    assert (d.x, d.z) == pytest.approx((20 / 39, 5 / 24))


def test_from_a_run_folder_with_its_hydra_config(tmp_path):
    recs, ev = hand_case()
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text(
        "train:\n  global_batch_size: 8\n  micro_batch_size: 2\n  warmup_steps: 1\n"
        "model:\n  num_layers: 4\nparallel:\n  tp: 1\n  pp: 2\n  dp: null\n")
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in recs[:13] + ev
                                                    + recs[13:]))
    a = account_of_run(tmp_path)
    assert (a.x, a.y, a.z) == pytest.approx((16 / 35, 9.6 / 28.6, 4 / 23))
    assert layout_from_config({"parallel": {"tp": 1, "pp": 2}}, 2) is None   # layers unknown
    assert layout_from_config({"parallel": {"tp": 2}}, 4) == Layout(2, 1, 2, 1, 8, 1)


def test_old_format_file():
    # before the rename: "rates" instead of "emulated_rates", no measured rates, no plan ids,
    # a replan line without "adopted", a migrate line without "seconds"
    recs = [{"step": s, "loss": 1.0, "samples": 4, "step_time_s": 0.5 if s < 4 else 1.0,
             "compute_s": [0.5, 1.0 if s >= 4 else 0.5], "rates": {"1": 2.0} if s >= 4 else {}}
            for s in range(8)]
    ev = [{"event": "replan", "step": 6}, {"event": "migrate", "step": 6}]
    a = account(recs, ev, None, warmup=0)
    assert a.rate_source == "emulated" and [p.rates for p in a.phases] == [(), ((1, 2.0),)]
    slow = a.phases[1]
    assert slow.healthy == pytest.approx(8) and slow.static == pytest.approx(4)
    assert slow.migrate_s == 0 and slow.detect_s == pytest.approx(0)   # same pace around it
    # all compute: healthy 2 + 2 s; static and this run 2 + 4 s; the bound (f = 0.75) 2 + 16/6 s
    assert (a.x, a.y, a.z) == pytest.approx((2 / 6, 2 / 6, (2 / 3) / (14 / 3)))
    assert "adaptive Malleus lost 33.3%" in closing_line(a)   # it switched plans (migrate)


def test_deepspeed_run_emulated_and_real_straggler():
    # engine=deepspeed lines: compute_s / emulated_s per rank, emulated rates, no plan, no
    # measured rates; dp=2, rank 1 at rate 4 in steps 3-11 (9 steps: a measured straggler phase
    # must last phases.MIN_STEPS = 7): each step waits for it
    def ds(rates_of, compute_of):
        return [{"step": s, "loss": 1.0, "samples": 16, "step_time_s": 2.0 if s >= 3 else 0.5,
                 "compute_s": compute_of(s), "emulated_s": [0.0, 0.0],
                 "emulated_rates": rates_of(s)} for s in range(12)]

    # healthy steps all compute (0.5 s): the static step is 0.5 + 3 * 0.5 = 2 s
    emu = ds(lambda s: {"1": 4.0} if s >= 3 else {}, lambda s: [0.5, 2.0 if s >= 3 else 0.5])
    dp2 = Layout(1, 1, 2, 4, 16, 2)
    a = account(emu, [], dp2, warmup=1)
    assert a.rate_source == "emulated" and not a.adaptive
    assert a.phases[1].static == pytest.approx(a.phases[1].achieved)   # the model fits DS
    # healthy 32/s: 1 + 4.5 s; static = this run: 1 + 18 s; the bound (f = 0.625, 0.8 s per
    # step): 1 + 7.2 s
    assert (a.x, a.y, a.z) == pytest.approx((13.5 / 19, 13.5 / 19, 2.7 / 8.2))
    assert "this run (no plan switch) lost 71.1%" in closing_line(a)
    # no emulation: a real slow GPU shows in compute_s only, 4x the fastest rank's
    real = ds(lambda s: {}, lambda s: [0.5, 2.0 if s >= 3 else 0.5])
    b = account(real, [], dp2, warmup=1)
    assert b.rate_source == "compute_s"
    assert [(p.first, p.last, p.rates) for p in b.phases] == [(1, 2, ()), (3, 11, ((1, 4.0),))]
    assert (b.x, b.y, b.z) == pytest.approx((a.x, a.y, a.z))
    # the same straggler for 5 steps only (3-7): fewer than the loop needs to act on it, so no
    # straggler phase by measurement (the emulated schedule, when there is one, still counts)
    short = real[:8]
    assert not account(short, [], dp2, warmup=1).stragglers
    assert account(emu[:8], [], dp2, warmup=1).stragglers


def test_no_healthy_phase_is_estimated():
    # rank 1 at rate 2 from the first step, dp=2: 2 s per step; the healthy rank computes 1 s,
    # the slow one 1 s more: healthy = 8 samples / (2 - 1) s = 8/s
    recs = [{"step": s, "samples": 8, "step_time_s": 2.0, "compute_s": [1.0, 2.0],
             "emulated_rates": {"1": 2.0}} for s in range(5)]
    a = account(recs, [], Layout(1, 1, 2, 2, 8, 1), warmup=1)
    assert a.phases[0].healthy == pytest.approx(8) and "estimated" in a.healthy_source
    assert (a.x, a.y, a.z) == pytest.approx((0.5, 0.5, 0.25))


def test_no_straggler_is_said():
    recs = [{"step": s, "samples": 8, "step_time_s": 1.0} for s in range(4)]   # oldest shape
    a = account(recs, [], None, warmup=1)
    assert not a.stragglers and a.rate_source == "none" and (a.x, a.y, a.z) == (0, 0, 0)
    assert "no straggler in this run" in closing_line(a)
    assert format_account(a) == ("  what-if: no straggler in this run: nothing for a re-layout "
                                 "to win back (3 steps after the warm-up)")


def test_bad_input_is_a_message(tmp_path):
    f = tmp_path / "metrics.jsonl"
    f.write_text("")
    with pytest.raises(WhatIfError, match=r"metrics.jsonl: no step lines \(0 event"):
        account_of_run(tmp_path)
    f.write_text('{"event": "checkpoint", "step": 3}\n\n{"event": "migrate", "step": 3}\n')
    with pytest.raises(WhatIfError, match=r"no step lines \(2 event line\(s\)\)"):
        account_of_run(f)
    f.write_text('{"step": 0, "samples": 8, "step_time_s": 1}\n{"step": 1, "samp')
    with pytest.raises(WhatIfError, match="line 2 is not valid JSON"):
        account_of_run(tmp_path)
    f.write_text('{"step": 0, "samples": "8", "step_time_s": 1}\n')
    with pytest.raises(WhatIfError, match=r"line 1 is a step line without numeric \['samples'\]"):
        account_of_run(tmp_path)
    with pytest.raises(WhatIfError, match="no step lines"):
        account([{"event": "migrate", "step": 1}])
    with pytest.raises(WhatIfError, match="all 2 step lines are warm-up steps"):
        account([{"step": 0, "samples": 8, "step_time_s": 1},
                 {"step": 1, "samples": 8, "step_time_s": 1}], warmup=2)
    with pytest.raises(WhatIfError, match="healthy steps' step_time_s add up to 0"):
        account([{"step": 0, "samples": 8, "step_time_s": 0.0}])


def test_plan_checks_line(tmp_path):
    """The adaptive loop's check events: one line under the account, a miss with what the
    re-plan after it did; no line for a run without them (DeepSpeed, static)."""
    recs, ev = hand_case()
    checks = [{"event": "check", "step": 15, "plan": "plan-b", "outcome": "kept",
               "expected_s": 1.45, "measured_s": 1.5, "ratio": 1.034, "margin": 0.3,
               "expected_from": "re-plan calibration"},
              {"event": "check", "step": 17, "plan": "plan-b", "outcome": "missed",
               "expected_s": 0.43, "measured_s": 0.9, "ratio": 2.093, "margin": 0.3,
               "expected_from": "healthy pace"},
              {"event": "replan", "step": 18, "trigger": "missed", "from": "plan-b",
               "to": "plan-a", "adopted": True, "rates_for": [1.0, 1.0],
               "reason": "missed its promise and the planner found nothing better (the running "
                         "plan is still the best); back to plan-a, measured 1.000 s/step "
                         "against 1.500 s now"}]
    plain = account(recs, ev, PP2, warmup=1)
    a = account(recs, ev + checks, PP2, warmup=1)
    line = ("  plan checks: 1 kept, 1 missed (step 17: 2.09x its promise of 0.430 s -> "
            "re-planned: back to plan-a)")
    assert format_account(a).splitlines()[-1] == line
    assert format_account(a).splitlines()[:-1] == format_account(plain).splitlines()
    assert "plan checks" not in format_account(plain) and plain.checks == ()
    assert (a.x, a.y, a.z) == pytest.approx((plain.x, plain.y, plain.z))    # numbers unchanged
    # not adopted: the running plan stays; from a run folder (events read from the file)
    checks[2] = {"event": "replan", "step": 18, "trigger": "missed", "from": "plan-b",
                 "to": "plan-b", "adopted": False, "reason": "the running plan is still the best"}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n"
                                                    for x in recs + ev + checks))
    text = format_account(account_of_run(tmp_path, warmup=1, layout=PP2))
    assert text.endswith("(step 17: 2.09x its promise of 0.430 s -> re-planned: kept plan-b)")
    # a run without stragglers still says how its checks went
    flat = [{"step": s, "samples": 8, "step_time_s": 1.0} for s in range(4)]
    assert format_account(account(flat, checks[:2], None, warmup=1)).splitlines() == [
        "  what-if: no straggler in this run: nothing for a re-layout to win back (3 steps after "
        "the warm-up)", "  plan checks: 1 kept, 1 missed (step 17: 2.09x its promise of 0.430 s "
        "-> not re-planned)"]


def _link_case(adaptive: bool = True):
    """4 ranks as 2 nodes of 2, dp=4. Steps 0-9 healthy at 1 s; from step 10 the link 0-1 is
    slow (measured 20x): 3 s a step on the first plan until
    a switch before step 13 (0.3 s migration), 1.2 s after it; steps 20-24 healthy again."""
    recs, events = [], []
    for s in range(25):
        slow = 10 <= s < 20
        plan = "plan-a" if not adaptive or s < 13 or s >= 20 else "plan-b"
        t = 1.0 if not slow else (3.0 if plan == "plan-a" else 1.2)
        rec = {"step": s, "loss": 1.0, "samples": 16, "step_time_s": t,
               "compute_s": [0.6] * 4, "emulated_s": [0.0] * 4, "emulated_rates": {},
               "plan": plan, "measured_rates": [1.0] * 4,
               "link_rates": {"0-1": 20.0 if 10 <= s < 20 else 1.0}}
        recs.append(rec)
    if adaptive:
        events = [{"event": "replan", "step": 13, "trigger": "link", "adopted": True,
                   "from": "plan-a", "to": "plan-b", "link_rates": {"0-1": 20.0},
                   "comm": {"layer_ms": 60.0, "activation_mb": 10.0, "intra_node_gbps": 1.0,
                            "inter_node_gbps": 1.0, "grad_mb": 50.0}},
                  {"event": "migrate", "step": 13, "from": "plan-a", "to": "plan-b",
                   "bytes": 10, "seconds": 0.3}]
    return recs, events


def test_a_slow_link_is_a_phase_with_its_static_and_bound():
    """The measured slow link splits the run; its static pace is what the first plan measured
    under the link before the switch (3 s a step: 1/3 of healthy), and with the loop's measured
    comm section the bound takes the link into account (below the compute bound of 1.0)."""
    recs, events = _link_case()
    layout = Layout(tp=1, pp=1, dp=4, num_layers=4, global_batch_size=16, micro_batch_size=1)
    a = account(recs, events, layout, warmup=1, cluster=(2, 2))
    slow = [p for p in a.phases if p.links]
    assert len(slow) == 1 and slow[0].label == "link 0-1 at 20"
    p = slow[0]
    assert (p.first, p.last) == (10, 19)
    assert p.healthy == pytest.approx(16.0)
    assert p.static == pytest.approx(16.0 / 3.0)            # steps 10-12 on plan-a
    assert p.static < p.achieved < p.healthy
    # capacity.link_capacity by hand: T_c = 16 units, W = 64; the cut carries 1/20 MB/ms, 1/3
    # unit a MB: activations 16 x 10 MB = 53 units; one layer on both sides: max(24, 8, 16.7)
    assert p.bound == pytest.approx(16.0 * 16 / 24)
    assert p.achieved < p.bound < p.healthy
    assert a.stragglers and "link 0-1" in format_account(a)
    # a static run (no switch): its own steps under the link are the static pace
    recs, _ = _link_case(adaptive=False)
    b = account(recs, [], layout, warmup=1, cluster=(2, 2))
    q = [p for p in b.phases if p.links][0]
    assert q.static == pytest.approx(q.achieved)
    # no comm section measured (no link event): the bound is the compute bound
    assert q.bound == pytest.approx(q.healthy)


def test_a_slow_gpu_link_is_a_phase_of_its_own():
    """A slow link between two GPUs of a node (``gpu_link_rates``) splits the run like a node
    link, labelled by its GPUs; the bound leaves GPU links out (the compute bound: loose, still
    a bound)."""
    recs, events = _link_case()
    for r in recs:
        r["gpu_link_rates"] = r.pop("link_rates")
    events[0]["gpu_link_rates"] = events[0].pop("link_rates")
    events[0]["link_rates"] = {}
    layout = Layout(tp=1, pp=1, dp=4, num_layers=4, global_batch_size=16, micro_batch_size=1)
    a = account(recs, events, layout, warmup=1, cluster=(2, 2))
    slow = [p for p in a.phases if p.links]
    assert len(slow) == 1 and slow[0].label == "link GPUs 0-1 at 20", slow
    assert (slow[0].first, slow[0].last) == (10, 19)
    assert slow[0].static == pytest.approx(16.0 / 3.0)
    assert slow[0].bound == pytest.approx(slow[0].healthy)
