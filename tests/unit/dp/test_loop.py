"""dp/loop.py's step vector (each rank's seconds per sample in its slot, rank 0's decision and
its rates after them; read back as sums), dp/timing.py's wrapping of DeepSpeed's communication
in the compute clock, and dp/settings.py's reading of the ``malleus`` section. No process group:
a stand-in engine."""
from __future__ import annotations

import types

import pytest

from malleus_ds.dp.loop import ResplitLoop
from malleus_ds.dp.settings import DPSettings, split_config
from malleus_ds.dp.split import Split
from malleus_ds.dp.timing import exclude_communication
from malleus_ds.engine.clock import ComputeClock
from malleus_ds.interop.malleus_section import DetectConfig


def _loop(rank, world=3):
    eng = types.SimpleNamespace(dp_world_size=world, dp_rank=lambda: rank)
    return ResplitLoop(eng, policy=None)


def test_each_rank_fills_its_own_slot_and_rank_0_its_decision():
    loops = [_loop(r) for r in range(3)]
    loops[0]._pending = (Split((4, 1, 3), 2), (1.0, 3.5, 1.25))
    vecs = [lp.vector(0.5 * (r + 1), emulated_s=0.25 * r) for r, lp in enumerate(loops)]
    # [seconds per sample x3 | next shares x3 | their rates x3 | emulated seconds x3 | loss]
    assert vecs[1] == [0.0, 1.0, 0.0] + [0.0] * 6 + [0.0, 0.25, 0.0] + [0.0]
    assert vecs[0] == [0.5, 0.0, 0.0, 4.0, 1.0, 3.0, 1.0, 3.5, 1.25] + [0.0] * 4
    sums = [sum(v) for v in zip(*vecs)]
    assert sums[9:12] == [0.0, 0.25, 0.5]
    for lp in loops:                    # every rank reads the same
        sps, split, rates = lp.read(sums, 2)
        assert sps == [0.5, 1.0, 1.5]
        assert split == Split((4, 1, 3), 2) and rates == [1.0, 3.5, 1.25]


def test_no_decision_reads_as_none():
    lp = _loop(1, world=2)
    sps, split, rates = lp.read([0.25, 0.75] + [0.0] * 7, 4)
    assert sps == [0.25, 0.75] and split is None and rates == []


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
