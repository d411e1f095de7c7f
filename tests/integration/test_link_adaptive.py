"""The adaptive loop finds a slow link, plans around it, and notices it recover (issue 35): 4 gloo
ranks as 2 nodes of 2 (``malleus.gpus_per_node=2``), data parallel over both nodes, so every
gradient reduction crosses the link between them. From step ONSET the link is RATE-fold slow
(the slow-link emulation, ``emulation/links.py``, on the engine's clock). The ranks time their
reductions (``engine/comm_log.py``), the readings ride in the step's all-reduce, rank 0 reads the
link as slow (``adaptive/link_watch.py``), the planner gets the link's rate and the measured
costs of communication, and the job switches to two-stage pipelines cut at the link, whose
reductions stay inside the nodes. LAG steps after that the link recovers; the link probe
(``engine/link_probe.py``) sees it and the job goes back to data parallel. The phases follow
the events (the same on every rank), so the test does not depend on how fast this machine is.
Losses equal one single-process run."""
from __future__ import annotations

import numpy as np

from tests.cases import CFG, EPS, ds_config, plan_json, reference
from tests.integration.harness import run_distributed

STATIC = plan_json([(2, [([r], (0, 4))]) for r in range(4)])      # dp=4, 2 micro-batches each
ONSET, RATE, LAG, MAX_STEPS = 16, 30.0, 12, 80


def _link(start, end=None):
    from malleus_ds.emulation.links import LinkSchedule

    return LinkSchedule.parse([{"nodes": [0, 1], "rate": RATE, "start_step": start,
                                "end_step": end}], 4, 2)


def _run(rank, world):
    import malleus_ds
    from malleus_ds.plan import Plan

    cfg = ds_config(1)
    # detect.healthy 2.0: this test is about links; on a loaded 2-core host a healthy rank's
    # compute can read 1.5-1.8 for a few steps, and the compute loop's answer to that is
    # test_malleus_adaptive's business
    cfg["malleus"] = {"gpus_per_node": 2, "detect": {"probe_every": 1, "healthy": 2.0},
                      "planner_time_limit_s": 0.3}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(STATIC))
    eng.clock.links = _link(ONSET)
    losses, events, plans, until = [], [], [], None
    while len(losses) < MAX_STEPS:
        losses.append(eng.train_batch())
        plans.append(eng.plan.to_json())
        new = [dict(e, at=len(losses)) for e in eng.take_events()]
        events += new
        if until is None and any(e["event"] == "replan" and e.get("adopted") for e in new):
            until = len(losses) + LAG              # a step index LAG steps from now
            eng.clock.links = _link(ONSET, until)
        if until is not None and len(losses) > until and \
                any(e["event"] == "replan" and e.get("adopted") for e in new):
            break                                  # planned for the recovery
    eng.control.close()
    return losses, events, plans, until


def test_a_slow_link_is_detected_planned_around_and_its_recovery_noticed():
    got = run_distributed(_run, 4, timeout=400)
    losses, events, plans, until = got[0]
    for r in range(1, 4):                   # the same decisions on every rank
        assert [e for e in got[r][1] if e["event"] == "replan"] == \
            [e for e in events if e["event"] == "replan"], r
    replans = [e for e in events if e["event"] == "replan"]
    why = "\n".join(map(str, replans))
    # nothing is planned for a slow link, nor switched, before the link slows (a loaded host
    # may make a rank read slow in compute for a few steps: that planning keeps the plan)
    assert not [e for e in replans if e["detected"] <= ONSET
                and (e.get("link_rates") or e["adopted"])], why
    # the first switch is made for the link, read as slow (by how much: its rate), within 8
    # steps (its trigger may be the pace check's: the slow steps miss the healthy pace too)
    onset = next((e for e in replans if e["adopted"]), None)
    assert onset is not None, f"no switch in {len(losses)} steps: {why}"
    assert onset["detected"] <= ONSET + 8 and onset["link_rates"]["0-1"] >= 2.0, why
    # the layout it switched to: two-stage pipelines cut at the link (ranks 0-1 on node 0)
    cut = plans[onset["step"]]
    for p in cut["pipelines"]:
        assert [{r // 2 for r in st["ranks"]} for st in p["stages"]] in ([{0}, {1}],
                                                                         [{1}, {0}]), cut
    # the recovery, read by the link probe (no reduction crosses the link any more)
    # (typically 5-8 steps; up to 18 seen with a busy-loop process beside the 4 ranks on 2
    # cores, where the probes' round trips scatter)
    back = [e for e in replans if e["adopted"] and e["detected"] > until]
    assert back and back[0]["link_rates"] == {} and back[0]["detected"] <= until + 22, why
    assert plans[-1] == STATIC
    ref, _ = reference(STATIC["global_batch_size"], STATIC["micro_batch_size"], len(losses), EPS,
                       0.0)
    for r, (lo, *_) in enumerate(got):
        np.testing.assert_allclose(lo, ref, rtol=1e-5, err_msg=f"rank {r}")


TP_PAIRS = plan_json([(4, [([0, 1], (0, 4))]), (4, [([2, 3], (0, 4))])])    # TP=2, dp=2
# the tiny model's TP all-reduces move 4 KB (a real model's, megabytes): 30x their wire time
# is 2% of a step, which the planner rightly finds not worth a migration; at 200x it predicted
# 5-7%, at the margin (min_improvement 5%: kept the plan once in 4 under load); 1000x, ~25%
GPU_ONSET, GPU_RATE = 14, 1000.0


def _gpu_link(start, end=None):
    from malleus_ds.emulation.links import LinkSchedule

    return LinkSchedule.parse([{"ranks": [0, 1], "rate": GPU_RATE, "start_step": start,
                                "end_step": end}], 4, 4)


def _run_gpu(rank, world):
    """One node of 4 ranks, TP=2 groups (0, 1) and (2, 3); from GPU_ONSET the link between
    GPUs 0 and 1 is GPU_RATE-fold slow (the emulation slows group (0, 1)'s TP collectives), until
    LAG steps after the loop's first adopted re-plan; the run stops once the loop planned for
    its recovery (a plan made without the link)."""
    import malleus_ds
    from malleus_ds.plan import Plan

    cfg = ds_config(1)
    cfg["malleus"] = {"detect": {"probe_every": 1, "healthy": 2.0},
                      "planner_time_limit_s": 0.3}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(TP_PAIRS))
    eng.clock.links = _gpu_link(GPU_ONSET)
    losses, events, plans, until = [], [], [], None
    while len(losses) < MAX_STEPS:
        losses.append(eng.train_batch())
        plans.append(eng.plan.to_json())
        new = [e for e in eng.take_events() if e["event"] == "replan"]
        events += new
        if until is None and any(e.get("adopted") for e in new):
            until = len(losses) + LAG
            eng.clock.links = _gpu_link(GPU_ONSET, until)
        if until is not None and any(e["detected"] > until and "0-1" not in
                                     e.get("gpu_link_rates", {}) for e in new):
            break                                  # planned for the recovery
    eng.control.close()
    return losses, events, plans, until


def test_a_slow_gpu_link_is_read_from_tp_collectives_and_the_groups_re_formed_off_it():
    """The TP collectives' timings ride in the step's all-reduce; rank 0 reads the GPU link
    (not GPUs 0 or 1) as slow, and the planner re-forms the TP groups so that neither holds
    both GPUs; the probes between them see it recover. Losses equal one single-process run."""
    got = run_distributed(_run_gpu, 4, timeout=400)
    losses, events, plans, until = got[0]
    for r in range(1, 4):
        assert got[r][1] == events, r
    why = "\n".join(map(str, events))
    assert not [e for e in events if e["detected"] <= GPU_ONSET and e["adopted"]], why
    onset = next((e for e in events if e["adopted"]), None)
    assert onset is not None, f"no switch in {len(losses)} steps: {why}"
    assert onset["detected"] <= GPU_ONSET + 8 and onset["link_rates"] == {}, why
    assert onset["gpu_link_rates"]["0-1"] >= 2.0 and max(onset["measured_rates"]) < 2.0, why
    groups = [st["ranks"] for p in plans[onset["step"]]["pipelines"] for st in p["stages"]]
    assert not any({0, 1} <= set(g) for g in groups), groups
    # the recovery, read by the probes between GPUs 0 and 1 (no TP group holds both now)
    back = [e for e in events if e["detected"] > until and "0-1" not in
            e.get("gpu_link_rates", {})]
    assert back and back[0]["detected"] <= until + 22, why
    ref, _ = reference(TP_PAIRS["global_batch_size"], TP_PAIRS["micro_batch_size"],
                       len(losses), EPS, 0.0)
    for r, (lo, *_) in enumerate(got):
        np.testing.assert_allclose(lo, ref, rtol=1e-5, err_msg=f"rank {r}")
