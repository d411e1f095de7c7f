"""The ds_config "malleus" section and stock fields, parsed without processes."""
import json

import pytest

from malleus_ds.engine.engine import MalleusSettings, _base_ds_config, _optimizer_settings
from malleus_ds.plan import Plan
from tests.dist.test_malleus_equivalence import HETERO


def test_plan_inline_path_and_unknown_keys(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps(HETERO))
    a = MalleusSettings.from_config({"plan": HETERO, "seed": 3})
    b = MalleusSettings.from_config({"plan": str(f), "straggler": {"schedule": [{"rank": 1, "rate": 2}]}})
    assert a.plan == b.plan == Plan.from_json(HETERO) and a.seed == 3
    assert b.straggler == ({"rank": 1, "rate": 2},)
    with pytest.raises(ValueError, match=r"unknown keys \['plann'\]"):
        MalleusSettings.from_config({"plann": "x"})


def test_stock_fields():
    zero, make = _optimizer_settings({"zero_optimization": {"stage": 2},
                                      "optimizer": {"type": "Adam", "params": {"lr": 0.1, "betas": [0.8, 0.9]}}})
    assert zero == 2
    import torch
    opt = make([torch.nn.Parameter(torch.zeros(2))])
    assert isinstance(opt, torch.optim.AdamW) and opt.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(ValueError, match="stage=3"):
        _optimizer_settings({"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="'SGD'"):
        _optimizer_settings({"optimizer": {"type": "SGD"}})
    plan = Plan.from_json(HETERO)
    base = _base_ds_config({"optimizer": {}, "zero_optimization": {}, "malleus": {},
                            "train_batch_size": 99, "gradient_clipping": 0.5}, plan, (0, 1))
    assert base == {"gradient_clipping": 0.5, "train_micro_batch_size_per_gpu": 1,
                    "gradient_accumulation_steps": 5, "train_batch_size": 5}
