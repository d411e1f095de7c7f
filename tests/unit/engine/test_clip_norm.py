"""Which gradients the clipping norm counts (``engine/clip_norm.py``): all of them, except under
fp32 ZeRO-0 with every pipeline two or more stages deep and their first stages alike, where
stock DeepSpeed's PipelineEngine counts only what the first stage holds."""
from __future__ import annotations

import pytest

from malleus_ds.engine.clip_norm import first_stage_layers, norm_skip
from malleus_ds.models.base import param_table
from malleus_ds.plan import Plan
from tests.cases import CFG, HETERO, plan_json

TABLE = param_table(CFG)            # 4 layers
#: 2 pipelines x 2 stages, the first stages holding the embedding and layer 0
TWO_BY_TWO = Plan.from_json(plan_json([(4, [([0], (0, 1)), ([1], (1, 4))]),
                                       (4, [([2], (0, 1)), ([3], (1, 4))])]))


def test_fp32_zero0_pipelines_count_the_first_stage_only():
    skip = norm_skip(TWO_BY_TWO, TABLE, zero_stage=0, mixed=False)
    counted = {s.name for s in TABLE} - skip
    assert first_stage_layers(TWO_BY_TWO) == (0, 1)
    assert counted == {s.name for s in TABLE if s.name.startswith(("embed.", "blocks.0."))}
    assert any(n.startswith("head.") for n in skip) and any(n.startswith("blocks.3.") for n in skip)


@pytest.mark.parametrize("zero,mixed", [(1, False), (2, False), (0, True)])
def test_zero_1_2_and_mixed_precision_count_everything(zero, mixed):
    """DeepSpeed's ZeRO optimizer and its fp16/bf16 optimizers take the tensor-parallel rank,
    not the pipeline's, for the same rule: the whole norm."""
    assert norm_skip(TWO_BY_TWO, TABLE, zero_stage=zero, mixed=mixed) == frozenset()


@pytest.mark.parametrize("plan", [
    HETERO,                                                       # a one-stage pipeline beside
    plan_json([(8, [([0], (0, 4))]), ]),                          # no pipeline at all
    plan_json([(4, [([0], (0, 1)), ([1], (1, 4))]),               # first stages differ
               (4, [([2], (0, 2)), ([3], (2, 4))])])],
    ids=["hetero", "one-stage", "first-stages-differ"])
def test_layouts_stock_deepspeed_does_not_run_count_everything(plan):
    p = Plan.from_json(plan)
    assert first_stage_layers(p) is None
    assert norm_skip(p, TABLE, zero_stage=0, mixed=False) == frozenset()
