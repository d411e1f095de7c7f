"""The end-of-run summary describes what actually ran: a plan's layout and batch sizes win."""
from malleus_ds.plan import Plan
from malleus_ds.runners.base import RunSummary
from malleus_ds.runners.common import format_summary
from tests.unit.test_config import cfg

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
