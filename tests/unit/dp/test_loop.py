"""dp/loop.py's step vector (each rank's seconds per sample in its slot, the split every rank
ran; read back as sums) and when a decision takes effect, MalleusDPEngine's restore of a
checkpoint's split, dp/timing.py's wrapping of DeepSpeed's communication in the compute clock,
and dp/settings.py's reading of the ``malleus`` section. No process group: stand-in engines."""
from __future__ import annotations

import types

import pytest

from malleus_ds.dp.loop import ResplitLoop
from malleus_ds.dp.settings import DPSettings, split_config
from malleus_ds.dp.split import Split
from malleus_ds.dp.timing import exclude_communication
from malleus_ds.engine.clock import ComputeClock
from malleus_ds.interop.malleus_section import DetectConfig


def _loop(rank, world=3, policy=None):
    eng = types.SimpleNamespace(dp_world_size=world, dp_rank=lambda: rank)
    return ResplitLoop(eng, policy=policy)


def test_each_rank_fills_its_own_slots_and_every_rank_its_split():
    loops = [_loop(r) for r in range(3)]
    ran = Split((4, 1, 3), 2)
    vecs = [lp.vector(0.5 * (r + 1), ran, emulated_s=0.25 * r) for r, lp in enumerate(loops)]
    # [seconds per sample x3 | the split the step ran x3 | emulated seconds x3 | loss]
    assert vecs[1] == [0.0, 1.0, 0.0] + [4.0, 1.0, 3.0] + [0.0, 0.25, 0.0] + [0.0]
    sums = [sum(v) for v in zip(*vecs)]
    assert sums[6:9] == [0.0, 0.25, 0.5]
    for lp in loops:                    # every rank reads the same
        assert lp.read(sums, ran) == [0.5, 1.0, 1.5]


def test_ranks_that_ran_different_splits_are_named():
    loops = [_loop(r, world=2) for r in range(2)]
    vecs = [loops[0].vector(0.1, Split((3, 1), 2)), loops[1].vector(0.2, Split((2, 2), 2))]
    sums = [sum(v) for v in zip(*vecs)]
    with pytest.raises(RuntimeError, match=r"ran different splits: rank 0 ran \[3, 1\], the "
                                           r"ranks' shares sum to \[5.0, 3.0\] \(want "
                                           r"\[6.0, 2.0\]"):
        loops[0].read(sums, Split((3, 1), 2))


class _Done:
    """A finished collective's handle."""

    def wait(self):
        return True


def test_a_decision_read_one_step_late_takes_effect_two_steps_after_its_timings():
    """The all-reduce of step k is read at step k+1's boundary; the policy's answer from step
    k's timings is applied there (step k+2 runs it); a flush (a checkpoint's) reads it early
    and the state it gives carries the decision to the next boundary."""
    import torch

    class Policy:
        seen: list = []

        def decide(self, step, sps, split):
            self.seen.append((step, list(sps), split.shares))
            return (Split((3, 1), 2), [1.0, 3.0]) if step == 1 else None

    class Engine(types.SimpleNamespace):
        def set_split(self, s):
            self.split = s

    eng = Engine(dp_world_size=2, dp_rank=lambda: 0, split=Split((2, 2), 2), device="cpu",
                 data_parallel_group=None)
    lp = ResplitLoop(eng, Policy())
    issued = []

    def all_reduce(t, group=None, async_op=False):
        assert async_op
        t[1] = 0.5                      # rank 1's reading
        t[2:4] *= 2                     # both ranks ran this split
        issued.append(t)
        return _Done()

    import deepspeed.comm as dist

    saved, dist.all_reduce = dist.all_reduce, all_reduce
    try:
        for k in range(3):
            lp.after_step(k, eng.split, compute_s=0.4)
            assert len(issued) == k + 1
        # step 0's read at step 1's boundary, step 1's at step 2's: applied, step 3 runs it
        assert Policy.seen == [(0, [0.1, 0.5], (2, 2)), (1, [0.1, 0.5], (2, 2))]
        assert lp.events == [{"event": "resplit", "step": 3, "from": [2, 2], "to": [3, 1],
                              "rates": [1.0, 3.0]}] and eng.split == Split((3, 1), 2)
        state = lp.state_dict()         # reads step 2's all-reduce
        assert Policy.seen[-1] == (2, [0.1, 0.5], (3, 1)) and state["decided"] is None
        torch.testing.assert_close(issued[-1][-1], torch.tensor(0.0, dtype=torch.float64))
    finally:
        dist.all_reduce = saved


class _Coordinator:
    def __init__(self, log):
        self.log = log

    def fetch_sub_module(self, m, forward):
        self.log.append(("fetch", forward))


class DeepSpeedZeroOptimizer_Stage3:
    """DeepSpeed's ZeRO-3 optimizer's shape: a private reduce, which its epilogue calls through
    ``self`` (so Python looks up ``_DeepSpeedZeroOptimizer_Stage3__reduce_...``)."""

    def __init__(self, log):
        self.log = log
        self.parameter_offload = types.SimpleNamespace(param_coordinator=_Coordinator(log))

    def __reduce_and_partition_ipg_grads(self, dtype):
        self.log.append(("reduce", dtype))

    def independent_gradient_partition_epilogue(self):
        self.__reduce_and_partition_ipg_grads("last")


def test_zero3s_gathers_and_reduce_scatters_are_left_out_of_compute():
    class Clock(ComputeClock):
        depth_seen: list = []

        def excluded(self):
            self.depth_seen.append(self._ex_depth)
            return super().excluded()

    log: list = []
    opt = DeepSpeedZeroOptimizer_Stage3(log)
    eng = types.SimpleNamespace(optimizer=opt, allreduce_gradients=lambda: log.append("ar"))
    clock = Clock()
    done = exclude_communication(eng, clock)
    assert done == ["engine.allreduce_gradients",
                    "optimizer.independent_gradient_partition_epilogue",
                    "optimizer._DeepSpeedZeroOptimizer_Stage3__reduce_and_partition_ipg_grads",
                    "coordinator.fetch_sub_module"]
    with clock.compute():
        opt.parameter_offload.param_coordinator.fetch_sub_module(None, forward=True)
        eng.allreduce_gradients()
        opt.independent_gradient_partition_epilogue()
    assert log == [("fetch", True), "ar", ("reduce", "last")]
    # every call went through clock.excluded(); the epilogue's own call to the private reduce
    # too, inside it (depth 1)
    assert Clock.depth_seen == [0, 0, 0, 1]
    assert clock._excluded > 0


def test_zero2s_reduction_and_an_engine_without_optimizer():
    log = []
    opt = types.SimpleNamespace(reduce_ipg_grads=lambda: log.append("ipg"))
    clock = ComputeClock()
    eng = types.SimpleNamespace(optimizer=opt, allreduce_gradients=lambda: None)
    assert exclude_communication(eng, clock) == ["engine.allreduce_gradients",
                                                 "optimizer.reduce_ipg_grads"]
    with clock.compute():
        opt.reduce_ipg_grads()
    assert log == ["ipg"] and clock._excluded > 0
    assert exclude_communication(types.SimpleNamespace(optimizer=None), clock) == []


def test_the_section_as_the_data_parallel_engine_reads_it():
    cfg, s = split_config({"train_batch_size": 8, "malleus": {
        "straggler": {"schedule": [{"rank": 1, "rate": 3.0, "start_step": 2}],
                      "method": "sleep"},
        "adaptive": False, "detect": {"window": 3, "confirm": 1}}})
    assert cfg == {"train_batch_size": 8}               # DeepSpeed never sees the section
    assert s.adaptive is False and s.detect == DetectConfig(window=3, confirm=1)
    assert list(s.straggler) == [{"rank": 1, "rate": 3.0, "start_step": 2}]
    assert s.straggler.method == "sleep"
    assert split_config({"train_batch_size": 8})[1] == DPSettings()


@pytest.mark.parametrize("sec,match", [
    ("fast", r"ds_config.malleus must be a mapping, got 'fast'"),
    ({"seed": 3, "tp": 2}, r"ds_config.malleus: seed, tp not read by the data-parallel engine"),
    ({"detect": {"change": 0}}, r"ds_config.malleus.detect.change=0.0 must be > 0"),
    ({"detect": {"speed": 1}}, r"ds_config.malleus.detect: unknown keys \['speed'\]"),
    ({"straggler": [{"rank": -1, "rate": 2.0}]}, r"straggler.schedule\[0\].rank=-1"),
])
def test_a_bad_section_names_the_key(sec, match):
    with pytest.raises(ValueError, match=match):
        split_config({"malleus": sec})


def test_the_sections_keys_and_a_bad_metrics_dir():
    import pytest

    from malleus_ds.dp.settings import DPSettings

    s = DPSettings.from_config({"metrics_dir": "runs/a", "adaptive": False})
    assert s.metrics_dir == "runs/a" and not s.adaptive
    assert DPSettings.from_config(None).metrics_dir is None
    for bad in ("", 3, ["a"]):
        with pytest.raises(ValueError, match=r"ds_config\.malleus\.metrics_dir=.* must be a "
                                             r"folder's path"):
            DPSettings.from_config({"metrics_dir": bad})
    with pytest.raises(ValueError, match="plan not read by the data-parallel engine"):
        DPSettings.from_config({"plan": "p.json"})


def test_a_checkpoints_split_for_another_world_is_left_with_one_line(caplog):
    """MalleusDPEngine.load_resplit_state on a stand-in engine: the saved split taken when the
    world and batch match; for another world, one warning naming both and the split kept."""
    import logging

    from malleus_ds.dp.engine import MalleusDPEngine

    class Engine(types.SimpleNamespace):
        def set_split(self, s):
            self._split = s

    def engine(world):
        return Engine(dp_world_size=world, train_batch_size=lambda: 16,
                      gradient_accumulation_steps=lambda: 2, dp_rank=lambda: 0, loop=None,
                      _split=Split.equal(world, 16, 2))

    saved = {"world": 2, "global_batch": 16, "micro_batches": 2, "shares": [7, 1],
             "loop": None}
    two = engine(2)
    assert MalleusDPEngine.load_resplit_state(two, saved) and two._split == Split((7, 1), 2)
    four = engine(4)
    with caplog.at_level(logging.WARNING):
        assert not MalleusDPEngine.load_resplit_state(four, saved)
    assert four._split == Split((2, 2, 2, 2), 2)
    assert [r.getMessage() for r in caplog.records] == [
        "the checkpoint's split [7, 1] is for 2 data-parallel ranks, a batch of 16 in 2 "
        "micro-batches; this job has 4 ranks, 16 in 2: resuming from the split [2, 2, 2, 2] "
        "instead, the ranks' speeds re-measured"]
    with pytest.raises(ValueError, match=r"'malleus_dp' state must hold world, global_batch, "
                                         r"micro_batches and shares; got \{'world': 2\}"):
        MalleusDPEngine.load_resplit_state(two, {"world": 2})


def test_a_teardowns_flush_gives_up_on_an_all_reduce_a_peer_never_joined():
    from malleus_ds.dp.loop import _InFlight

    class Never:
        def is_completed(self):
            return False

    lp = _loop(0, world=2)
    lp._inflight = _InFlight(Never(), None, 7, Split((2, 2), 2), 0.1)
    assert lp.flush(timeout_s=0.01) is False and lp._inflight.step == 7
