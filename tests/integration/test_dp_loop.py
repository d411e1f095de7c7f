"""The data-parallel re-split loop on 2 gloo ranks (``dp/loop.py``, ``app/dp_loop.py``), built by
``malleus_ds.initialize`` from a plain torch.nn.Module, with the user's loop unchanged.

Under ZeRO-2 and ZeRO-3, rank 1 emulated 3x slower from step 2 (``malleus.straggler``, the
sleep emulation through the compute clock): within the run the split moves samples off rank 1
(its share per micro-batch drops below rank 0's; asserted by direction only, never on
timings), the re-split is an event, and the per-step losses, gradient norms and final
parameters still equal a stock ``deepspeed.initialize`` run on the same data (fp32, rtol 1e-5).
That direction needs the healthy rank not to read slow: its waits inside DeepSpeed's
collectives (ZeRO-2's gradient reduction, ZeRO-3's parameter all-gathers and gradient
reduce-scatters, whose wrapping is checked by name) are left out of its compute. A healthy run
re-splits nothing. The loop makes exactly one collective per
optimizer step (an all-reduce, at the step's boundary) and none per micro-step: counted on
``deepspeed.comm`` and ``torch.distributed`` by caller, and as the difference in DeepSpeed's
all-reduce count against a run with ``malleus.adaptive: false``. One ``run_distributed`` call
builds every engine; the tests read its results.
"""
from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.integration.test_dp_resplit import _Data as _Samples
from tests.integration.test_dp_resplit import _close, _ds_config, _model, _stock_loss, _train

#: the shared run (8 engines on 2 ranks), paid by the first test: 10 s on a quiet 2-core
#: machine, up to 25 s under load
pytestmark = pytest.mark.slow

STAGES, STEPS, GAS = (2, 3), 10, 2
#: the ZeRO-2 slowed run saves a checkpoint before this step; a second engine resumes from it
SAVE_AT = 8
N = 8 * STEPS
#: quick detection for a short run: a 3-step median, two detections in a row
DETECT = {"window": 3, "confirm": 2, "cooldown": 2}
SLOW = {"straggler": [{"rank": 1, "rate": 3.0, "start_step": 2}], "detect": DETECT}
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "broadcast", "barrier", "reduce", "all_to_all_single",
               "broadcast_object_list", "all_gather_object", "send", "recv", "isend", "irecv")


class _Count:
    """Collective calls of ``deepspeed.comm`` and ``torch.distributed``: those made from the
    loop's own files (with the engine's micro-step at each), and ``deepspeed.comm.all_reduce``
    in all."""

    LOOP_FILES = ("malleus_ds/dp/loop.py", "malleus_ds/app/dp_loop.py")

    def __init__(self):
        import sys

        import torch.distributed as tdist
        from deepspeed import comm

        self.loop: list[tuple[str, int]] = []
        self.all_reduce = 0
        for mod in (comm, tdist):
            for name in COLLECTIVES:
                fn = getattr(mod, name, None)
                if fn is not None:
                    setattr(mod, name, self._wrap(mod is comm and name == "all_reduce", name,
                                                  fn, sys))

    def _wrap(self, total, name, fn, sys):
        def call(*a, **k):
            f = sys._getframe(1)
            if f.f_code.co_filename.endswith(self.LOOP_FILES):
                self.loop.append((name, f.f_locals["self"].engine.micro_steps))
            if total:
                self.all_reduce += 1
            return fn(*a, **k)
        return call

    def take(self):
        out = (self.loop, self.all_reduce)
        self.loop, self.all_reduce = [], 0
        return out


def _ours(stage, malleus, count, ckpt=None):
    """``malleus_ds.initialize``'s engine trained STEPS steps; with ``ckpt``, saved there before
    step SAVE_AT and resumed from it by a second engine (:func:`_resume`)."""
    import malleus_ds

    m = _model()
    eng, _, loader, _ = malleus_ds.initialize(model=m, model_parameters=m.parameters(),
                                              training_data=_Samples(N),
                                              config={**_ds_config(stage), "malleus": malleus})
    count.take()
    seen, saved = [], []

    def record(eng, step):
        if eng.loop is not None and step:
            seen.append(list(eng.loop.last_seconds_per_sample))
        if ckpt is not None and step == SAVE_AT:
            eng.save_checkpoint(ckpt)
            saved.append(list(eng.split.shares))

    run = _train(eng, loader, eng.global_loss, record, steps=STEPS)
    record(eng, STEPS)
    eng.destroy()           # reads the last step's all-reduce (so would the process's exit)
    out = {"run": run, "events": list(eng.split_events), "sps": seen, "calls": count.take(),
           "left_out": eng.left_out_of_compute, "loop": eng.loop is not None}
    if ckpt is not None:
        out["saved"] = saved[0]
        out["resumed"] = _resume(stage, {k: v for k, v in malleus.items()
                                         if k != "metrics_dir"}, ckpt)
    return out


def _resume(stage, malleus, ckpt):
    """Another engine (other weights) loads the checkpoint and runs steps SAVE_AT and on."""
    import torch

    import malleus_ds

    m = _model()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    eng, _, loader, _ = malleus_ds.initialize(model=m, model_parameters=m.parameters(),
                                              training_data=_Samples(N),
                                              config={**_ds_config(stage), "malleus": malleus})
    eng.load_checkpoint(ckpt)
    first = list(eng.split.shares)
    run = _train(eng, loader, eng.global_loss, steps=STEPS - SAVE_AT, skip=SAVE_AT)
    return {"first": first, "run": run, "events": list(eng.split_events)}


def _ranks(rank, world, metrics_root):
    import deepspeed

    count = _Count()
    out = {}
    for stage in STAGES:
        m = _model()
        eng, _, loader, _ = deepspeed.initialize(model=m, model_parameters=m.parameters(),
                                                 training_data=_Samples(N),
                                                 config=_ds_config(stage))
        loader.num_local_io_workers = 0
        out[stage, "stock"] = _train(eng, loader, _stock_loss, steps=STEPS)
        out[stage, "slow"] = _ours(stage, {**SLOW, "metrics_dir": f"{metrics_root}/z{stage}"},
                                   count, ckpt=f"{metrics_root}/ck" if stage == 2 else None)
    out["healthy"] = _ours(2, {"detect": DETECT}, count)
    out["off"] = _ours(2, {"detect": DETECT, "adaptive": False}, count)
    return out


@functools.lru_cache(maxsize=1)
def _metrics_root() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="dp_loop_metrics_")


@functools.lru_cache(maxsize=1)
def _results():
    return run_distributed(_ranks, 2, _metrics_root(), timeout=150)


def test_a_slowed_rank_gets_fewer_samples_and_the_math_stays_stocks():
    res = _results()
    for stage in STAGES:
        stock = res[0][stage, "stock"]
        for r in range(2):
            got = res[r][stage, "slow"]
            _close(got["run"], stock, f"stage {stage} rank {r} re-split by speed")
            # one event, the same on both ranks: rank 1's share drops below rank 0's
            ev = got["events"]
            assert ev == res[0][stage, "slow"]["events"], (stage, r)
            assert len(ev) >= 1 and ev[0]["event"] == "resplit", ev
            assert ev[0]["from"] == [2, 2] and ev[0]["to"][1] < ev[0]["to"][0], ev
            assert ev[0]["rates"][1] > ev[0]["rates"][0], ev
            assert 3 <= ev[0]["step"] < STEPS, ev
            # the micro-batches each rank ran follow the events
            sizes = got["run"][2]
            first = ev[0]["step"]
            assert sizes[:first * GAS] == [2] * first * GAS
            assert sizes[first * GAS] == ev[0]["to"][r]


def test_zero3s_parameter_gathers_and_reductions_are_left_out_of_compute():
    for stage, want in ((2, {"engine.allreduce_gradients", "optimizer.reduce_ipg_grads",
                             "optimizer.independent_gradient_partition_epilogue"}),
                        (3, {"engine.allreduce_gradients", "coordinator.fetch_sub_module",
                             "optimizer.independent_gradient_partition_epilogue",
                             "optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition"
                             "_ipg_grads"})):
        assert set(_results()[0][stage, "slow"]["left_out"]) == want


def test_a_healthy_run_is_not_re_split():
    for r in range(2):
        got = _results()[r]["healthy"]
        assert got["events"] == [], got["sps"]
        assert got["run"][2] == [2] * STEPS * GAS
        _close(got["run"], _results()[0][2, "stock"], f"rank {r} healthy")


def test_the_loop_makes_one_collective_per_optimizer_step():
    for r in range(2):
        res = _results()[r]
        for key in ((2, "slow"), (3, "slow"), "healthy"):
            loop, _ = res[key]["calls"]
            # one all-reduce per step, each at the step's boundary (after its GAS micro-steps)
            assert loop == [("all_reduce", GAS * (k + 1)) for k in range(STEPS)], (key, loop)
        off = res["off"]
        assert not off["loop"] and off["calls"][0] == [] and off["events"] == []
        # DeepSpeed's own all-reduces are the same with the loop and without
        assert res["healthy"]["calls"][1] - off["calls"][1] == STEPS


def test_metrics_jsonl_has_every_step_and_resplit_and_the_reports_read_it():
    """``malleus.metrics_dir``: rank 0 writes a line per step (the loss over the global batch,
    every rank's compute seconds, the emulated rates, the split as the step's ``plan``) and one
    per re-split; summarize's reader, the what-if and the plot take it."""
    from pathlib import Path

    from malleus_ds.report.metrics import read_metrics_file
    from malleus_ds.report.plot import main as plot_main
    from malleus_ds.report.whatif import account_of_run, format_account

    res = _results()
    for stage in STAGES:
        run = Path(_metrics_root()) / f"z{stage}"
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "event" not in r]
        assert [r["step"] for r in steps] == list(range(STEPS)), rows
        stock = res[0][stage, "stock"][0]
        np.testing.assert_allclose([r["loss"] for r in steps], stock, rtol=1e-5)
        assert all(len(r["compute_s"]) == 2 and r["samples"] == 8 for r in steps), steps[0]
        assert steps[0]["plan"] == "split-2-2" and steps[-1]["plan"] != "split-2-2", steps[-1]
        assert steps[-1]["emulated_rates"] == {"1": 3.0}
        assert sum(steps[-1]["emulated_s"]) > 0 and steps[-1]["emulated_s"][0] == 0
        events = [r for r in rows if r.get("event") == "resplit"]
        assert events == res[0][stage, "slow"]["events"], events
        at = rows.index(events[0])      # after the step that decided it, before its first
        assert rows[at - 1]["step"] == events[0]["step"] - 1, rows[at - 2:at + 2]
        read_metrics_file(run / "metrics.jsonl")
        assert "stragglers would have cost" in format_account(account_of_run(run, warmup=1))
        assert plot_main([str(run)]) in (0, None) and (run / "throughput.png").is_file()


def test_a_resumed_run_goes_on_with_the_split_and_decision_it_saved():
    """ZeRO-2, rank 1 slowed: saved before step SAVE_AT (after the re-split), loaded by an engine
    with other weights. Its first step runs the saved split, its second the decision read from
    the step before the save (saved with it), and the losses and weights are stock's."""
    res = _results()
    stock = res[0][2, "stock"]
    for r in range(2):
        got = res[r][2, "slow"]
        resumed = got["resumed"]
        sizes = got["run"][2]
        assert resumed["first"] == got["saved"] and got["saved"][r] == sizes[SAVE_AT * GAS]
        # the saved split, then the held decision: the uninterrupted run's micro-batches
        assert resumed["run"][2] == sizes[SAVE_AT * GAS:], (resumed["run"][2], sizes)
        assert [e for e in resumed["events"] if e["step"] == SAVE_AT + 1] == \
            [e for e in got["events"] if e["step"] == SAVE_AT + 1]
        (gl, gp, _, gn), (wl, wp, _, wn) = resumed["run"], stock
        np.testing.assert_allclose(gl, wl[SAVE_AT:], rtol=1e-5, err_msg=f"rank {r}: losses")
        np.testing.assert_allclose(gn, wn[SAVE_AT:], rtol=1e-5, err_msg=f"rank {r}: norms")
        for k in wp:
            np.testing.assert_allclose(gp[k].numpy(), wp[k].numpy(), rtol=1e-5, atol=1e-7,
                                       err_msg=f"rank {r} resumed: {k}")
