"""The adaptive loop keeps the math (DESIGN.md §6): one engine trains while an emulated straggler
appears, worsens and recovers; the engine measures it, re-plans in the background, migrates live,
comes back after recovery, and obeys a forced re-plan. Per-step losses, final parameters and Adam
states equal one single-process run; the events say what happened, the same on every rank."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.cases import CFG, check, ds_config, plan_json
from tests.integration.test_malleus_switch import _check_adam

STATIC = plan_json([(2, [([r], (0, 4))]) for r in range(4)])      # dp=4, 2 micro-batches each
# Losses match to 1e-5 at every step. Parameters: Adam normalises tiny gradient differences
# (fp32 summation order differs between layouts), so on rarely-seen embedding rows the error
# grows with steps even on a static plan: 1.3e-5 of the tensor's max after 56 steps (1.5e-4
# for exp_avg_sq), hence PARAM_RTOL (x10 for Adam states). 56 steps leave room for slow detection on a loaded 2-core machine.
ONSET, MILD, WORSE, MAX_STEPS = 3, 3.0, 8.0, 56
PARAM_RTOL = 5e-5
LAG = 2     # steps between an adopted re-plan and the next phase of the straggler schedule


def _adaptive(rank, world, max_steps):
    """Rank 3 slows to MILD at step ONSET; LAG steps after the loop adopts a plan for that, it
    worsens to WORSE; LAG steps after the loop adopts a plan for *that*, it recovers. The
    phases follow the events (identical on every rank), so the test does not depend on how
    fast this machine detects; only on detecting at all within MAX_STEPS."""
    import malleus_ds
    from malleus_ds.emulation.straggler import StragglerSchedule
    from malleus_ds.plan import Plan

    cfg = ds_config(1)
    # a short window for a short test; probes every step so a suspended rank's fastest probe
    # in the window is a fair reading on this oversubscribed machine
    cfg["malleus"] = {"straggler": [{"rank": 3, "rate": MILD, "start_step": ONSET}],
                      "detect": {"every": 1, "window": 3, "probe_every": 1}, "planner_time_limit_s": 0.2}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(STATIC))
    losses, events, forced_at, plans, phase = [], [], None, {}, "mild"
    while len(losses) < max_steps:
        losses.append(eng.train_batch())
        plans[eng.plan.id] = eng.plan.to_json()
        new = [dict(e, at=len(losses)) for e in eng.take_events()]
        events += new
        adopted = [e for e in new if e["event"] == "replan" and e.get("adopted")]
        nxt = len(losses) + LAG     # a step index (0-based) LAG steps from now
        if phase == "mild" and adopted:
            phase, worse_at = "worse", nxt
            eng.straggler.schedule = StragglerSchedule.parse([
                {"rank": 3, "rate": MILD, "start_step": ONSET, "end_step": nxt},
                {"rank": 3, "rate": WORSE, "start_step": nxt}])
        elif phase == "worse" and any(e["event"] == "replan" and e.get("detected", -1) > worse_at
                                      for e in new):
            # planned for the worsening (adopted, or "still the best" when the plan for the
            # mild phase already left rank 3 out)
            phase = "recovered"
            eng.straggler.schedule = StragglerSchedule.parse([
                {"rank": 3, "rate": MILD, "start_step": ONSET, "end_step": worse_at},
                {"rank": 3, "rate": WORSE, "start_step": worse_at, "end_step": nxt}])
        elif (phase == "recovered" and forced_at is None and adopted
              and eng.plan.locate(3) is not None):      # back to work: now a forced re-plan
            forced_at = len(losses) + 1
            eng.control.forced.append(forced_at)
        if forced_at is not None and len(losses) >= forced_at + 1:
            break
    eng.apply_scheduled_switch()
    events += eng.take_events()
    st = eng.local_state()
    shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
    adam = {n: (st["exp_avg"][n].numpy(), st["exp_avg_sq"][n].numpy()) for n in st["exp_avg"]}
    eng.control.close()
    return (losses, shards), events, eng.measured_rates, adam, plans, worse_at


def test_adaptive_run_detects_replans_migrates_recovers_and_keeps_the_math():
    from malleus_ds.plan import Plan
    from malleus_ds.adaptive.work import cost_units

    res = run_distributed(_adaptive, 4, MAX_STEPS, timeout=400)
    steps = len(res[0][0][0])
    events = res[0][1]
    for e in events:            # shown when an assertion fails
        print(e["step"], e["event"], e.get("trigger"), e.get("detected"), e.get("adopted"),
              e.get("measured_rates"), e.get("planning_s"), res[0][4].get(e.get("to")))
    assert all(len(r[0][0]) == steps for r in res)
    check(STATIC, [r[0] for r in res], steps=steps, param_rtol=PARAM_RTOL)
    _check_adam([(r[0], None, None, r[3]) for r in res], steps, rtol=10 * PARAM_RTOL)
    # every rank saw the same decisions (the plan checks are rank 0's: it decides)
    decisions = lambda evs: [e for e in evs if e["event"] != "check"]  # noqa: E731
    assert all(decisions(r[1]) == decisions(events) for r in res), \
        "every rank saw the same events"
    replans = [e for e in events if e["event"] == "replan"]
    adopted = [e for e in replans if e["adopted"]]
    migrates = [e for e in events if e["event"] == "migrate"]
    # nothing happens while everyone is healthy
    assert all(e["step"] > ONSET for e in replans), replans
    onset = next(e for e in adopted if e["trigger"] in ("onset", "change"))
    # read while the window fills with slow steps (or, when the first plan was not worth a
    # migration, a little later as a "change")
    assert onset["measured_rates"][3] > 1.5, onset
    assert onset["predicted_step_s"][1] < onset["predicted_step_s"][0]
    # detected in time: the window (3) must fill with slow steps, after one left out, plus one
    # to confirm. That first re-plan may be declined (a half-filled window read the rate-3
    # straggler as 1.49 once: not worth a migration) and the adopted one come a window later
    first = replans[0]
    assert first["trigger"] == "onset" and first["detected"] - ONSET <= 2 * 3 + 1, \
        f"detected late: {first}"
    assert onset["detected"] - first["detected"] <= 2 * 3 + 1, f"adopted late: {onset}"
    # the re-plan for the worsening is the first one whose window saw it (the phase logic
    # above recovers on the same condition). Its reading is not compared with the onset's:
    # on 4 ranks over 2 cores a rate-3 straggler has read 5.6 and a rate-8 one 7.3 (CI)
    worse_at = res[0][5]
    # (or a plan that missed its promise once the straggler worsened: re-planned at once)
    after = [e for e in replans if e["trigger"] in ("change", "missed")
             and e.get("detected", -1) > worse_at]
    # the adopted one if any (a missed promise may first re-plan to no avail, then the
    # detector's change moves the work)
    worse = next((e for e in after if e["adopted"]), after[0] if after else None)
    assert worse is not None, f"the worsening was never planned for: {replans}"
    assert worse["measured_rates"][3] > MILD, worse
    units = {e["to"]: cost_units(Plan.from_json(res[0][4][e["to"]]), 4, 1, {1: 1.0})
             for e in (onset, worse)}
    if worse["adopted"]:
        assert worse["predicted_step_s"][1] < worse["predicted_step_s"][0], worse

        def relative(e):    # rank 3's rate against the slowest other rank the plan was made for
            return e["measured_rates"][3] / max(e["measured_rates"][:3])

        # slower relative to the others -> no more work (on this oversubscribed machine another
        # rank sometimes reads slow too, e.g. [1.68, 1, 1, 3.29] after [1, 1, 1, 2.44]: rank 3
        # is then less slow relative to rank 0 and may rightly get more work)
        if relative(worse) >= relative(onset):
            assert units[worse["to"]][3] <= units[onset["to"]][3], units
    else:
        # declined only when the plan for the mild phase is still the plan for the worse rates:
        # it left rank 3 out, or gave it so little work that even at the worse rate it is not
        # the bottleneck (CI: 2 units at 4.9 against 12 on a healthy rank)
        assert worse["to"] == onset["to"], (worse, units)
        u, r = units[onset["to"]], worse["measured_rates"]
        assert u[3] * r[3] <= max(u[i] * r[i] for i in range(3)), (worse, units)
    # back to work after recovery (the trigger may be "change": a healthy rank can read just
    # above 1.2 in the same window on this noisy machine)
    rec = next((e for e in adopted if e["step"] > worse["step"] and cost_units(
        Plan.from_json(res[0][4][e["to"]]), 4, 1, {1: 1.0})[3] > 0), None)
    assert rec is not None, f"rank 3 never came back: {replans}"
    # it came back because its reading fell (a just-recovered rank's probe has read 3.1 on a
    # loaded machine: the fastest probe in the window still had slow neighbours)
    assert rec["trigger"] in ("recovery", "change", "missed"), rec
    assert rec["measured_rates"][3] < worse["measured_rates"][3], (rec, worse)
    forced = [e for e in adopted if e["trigger"] == "forced"]
    assert len(forced) == 1 and forced[0]["from"] != forced[0]["to"]
    # every adopted re-plan is followed by its migration, at the same step boundary
    for e in adopted:
        m = next(m for m in migrates if m["from"] == e["from"] and m["to"] == e["to"]
                 and m["step"] == e["step"])
        assert m["seconds"] > 0
    # the plan made for the straggler gives rank 3 less work (or none)
    assert units[onset["to"]][3] < units[onset["to"]][:3].min(), units
    # (no bound on the rates at the very end: a rank that just came back reads 2-4 for a few
    # steps on this oversubscribed machine; the events above carry the measured readings)
    assert len(res[0][2]) == 4


REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_forced_replans_from_the_command_line_log_events_and_plot(tmp_path):
    """A Hugging Face model (transformers' LlamaDecoderLayer) through the whole loop: measured
    rates, the planner on its parameter table, live migration, the events, the plot; the losses
    equal transformers' LlamaForCausalLM trained in one process."""
    out = tmp_path / "run"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        env.pop(k, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "launch" / "train.py"), "model=hf", "model.hf_config=tiny-llama",
           "model.max_seq_len=16",
           "progress=false", "engine=malleus", "train.steps=8", "malleus.replan_at=[3,6]",
           "malleus.adaptive=false", f"hydra.run.dir={out}",
           "straggler.schedule=[{rank:2,rate:2.0,start_step:1}]"]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "event" not in r]
    evs = [r for r in rows if "event" in r]
    assert [(e["event"], e["step"], e.get("trigger")) for e in evs] == [
        ("replan", 3, "forced"), ("migrate", 3, None), ("replan", 6, "forced"), ("migrate", 6, None)]
    assert evs[0]["to"] == evs[1]["to"] != evs[0]["from"] and evs[2]["from"] == evs[0]["to"]
    assert steps[2]["plan"] == evs[0]["from"] and steps[3]["plan"] == evs[0]["to"]
    assert steps[0]["emulated_rates"] == {} and steps[1]["emulated_rates"] == {"2": 2.0}
    assert len(steps[-1]["measured_rates"]) == 4 and steps[-1]["measured_rates"][2] > 1.3
    assert "replan before step 3 (forced" in p.stdout and "migrate before step 6" in p.stdout
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.app.reference import reference_run
    ref, _ = reference_run(load_hf_model("tiny-llama", max_seq_len=16), seed=0, steps=8,
                           global_batch_size=8, micro_batch_size=1)
    np.testing.assert_allclose([r["loss"] for r in steps], ref, rtol=1e-5)
    from malleus_ds.report.plot import main as plot_main
    assert plot_main([str(out), "-o", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
