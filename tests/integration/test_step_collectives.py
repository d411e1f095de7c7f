"""engine=malleus does one collective over the whole world per training step in steady state (no
switch, no checkpoint, no clipping, no probe): the step's all-reduce, which carries what the
step reporter writes to metrics.jsonl too (``engine/step_reduce.py``,
``StepReporter.step_done(sums=)``). Counted on 2 gloo ranks of the app's runner, with the
adaptive loop attached as a run attaches it; the gradient reductions run over the plan's own
groups and are not counted. And the sums' clock numbers are each rank's clock once the step is
done, except on the steps every rank marks ``late`` (a probe timed after the all-reduce); the
stop signal one rank raises is every rank's."""
from __future__ import annotations

import json

from tests.cases import CFG, ds_config, plan_json
from tests.integration.harness import run_distributed

STEPS = 6
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "broadcast", "broadcast_object_list", "barrier", "reduce", "gather",
               "scatter", "reduce_scatter", "reduce_scatter_tensor", "all_to_all")


def _run(rank, world, run_dir):
    import torch.distributed as dist

    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config
    from malleus_ds.app.runners.common import StepReporter

    counted: list[str] = []
    for name in COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue

        def world_counted(*a, _fn=fn, _name=name, **kw):
            group = kw.get("group")
            if group is None or group is dist.group.WORLD:
                counted.append(_name)
            return _fn(*a, **kw)

        setattr(dist, name, world_counted)
    per_step: list[list[str]] = []
    done = StepReporter.step_done

    def step_done(self, *a, **kw):
        done(self, *a, **kw)
        per_step.append(list(counted))      # this step's, boundary and report included
        counted.clear()

    StepReporter.step_done = step_done
    d = {"engine": "malleus", "progress": False,
         "model": {"name": "tiny", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                   "max_seq_len": 16},
         "train": {"steps": STEPS, "global_batch_size": 4, "micro_batch_size": 1, "seed": 3},
         "parallel": {"tp": 1, "pp": 1, "dp": None},
         "deepspeed": {"config": {"zero_optimization": {"stage": 1},
                                  "gradient_clipping": 0.0}}}
    cfg = build_run_config(d, world_size=world, run_dir=str(run_dir) if rank == 0 else None)
    runners.run(cfg, runners.DistEnv.from_environ("cpu"))
    return per_step


def test_a_steady_step_does_one_world_collective_and_reports_from_it(tmp_path):
    got = run_distributed(_run, 2, tmp_path, timeout=240)
    for rank, per_step in enumerate(got):
        assert len(per_step) == STEPS, per_step
        # the first step may set things up (groups, a first broadcast); then only the step's
        # all-reduce
        assert per_step[0].count("all_reduce") == 1 and "all_gather" not in per_step[0]
        assert per_step[1:] == [["all_reduce"]] * (STEPS - 1), (rank, per_step)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [x for x in lines if "step_time_s" in x]
    assert [x["step"] for x in steps] == list(range(STEPS))
    for x in steps:     # every rank's numbers, from the all-reduce
        assert len(x["compute_s"]) == 2 and all(c > 0 for c in x["compute_s"]), x
        assert len(x["emulated_s"]) == 2 and len(x["wait_s"]) == 2, x


#: rank 1 without work: it probes every ``probe_every`` steps after the all-reduce, and rank 0
#: (the calibrating rank) beside it
IDLE = plan_json([(8, [([0], (0, 4))])], suspended=[1])
PROBE_EVERY, STOP_AT = 2, 3


def _probing(rank, world, steps):
    import malleus_ds
    from malleus_ds.plan import Plan

    cfg = ds_config(1)
    cfg["malleus"] = {"adaptive": False, "detect": {"probe_every": PROBE_EVERY},
                      "straggler": [{"rank": 1, "rate": 2.0, "start_step": 0}]}
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(IDLE))
    eng.set_stop_source(lambda: 15 if rank == 1 and eng.global_steps >= STOP_AT else 0)
    out = []
    for _ in range(steps):
        eng.train_batch()
        s, c = eng.last_sums, eng.clock
        carried = tuple(float(x[rank]) for x in (s.compute_s, s.emulated_s, s.wait_s, s.link_s))
        done = (c.compute_s, c.emulated_s, c.wait_s, c.link_emulated_s)
        out.append((s.late, s.stop, carried == done))
    eng.control.close()
    return out


def test_the_sums_are_each_ranks_step_unless_every_rank_marks_them_late():
    got = run_distributed(_probing, 2, 6, timeout=240)
    for step, (r0, r1) in enumerate(zip(*got)):
        assert r0[:2] == r1[:2], (step, got)       # late and stop: the same on every rank
        late, stop, _ = r0
        assert late == (step % PROBE_EVERY == 0), (step, got)
        assert stop == (15 if step >= STOP_AT else 0), (step, got)
        if late:        # the probes' seconds came after: the reporter gathers the clocks
            assert not (r0[2] and r1[2]), (step, got)
        else:
            assert r0[2] and r1[2], (step, got)
