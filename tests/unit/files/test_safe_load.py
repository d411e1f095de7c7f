"""malleus_ds/files/safe_load.py and its users: files are data, never code; sizes and numbers are
bounded before anything large is read or built."""
import json
import os

import pytest
import torch

from malleus_ds.plan import Plan, PlanError
from malleus_ds.problem import Problem
from malleus_ds.files.safe_load import UnsafeFile, check_plain, load_plain, read_json


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _Opaque:
    pass


def test_check_plain_accepts_what_weights_only_loads_and_names_the_rest():
    ok = {"a": [1, 2.5, "x", None, True], (1, "k"): torch.zeros(2), "s": torch.Size([2]),
          "d": torch.float32}
    check_plain(ok, "state")
    with pytest.raises(UnsafeFile, match=r"state\['b'\]\[1\] holds a .*_Opaque: checkpoints hold "
                                         r"plain data only"):
        check_plain({"b": [1, _Opaque()]}, "state")
    with pytest.raises(UnsafeFile, match="key"):
        check_plain({_Opaque(): 1}, "state")
    with pytest.raises(UnsafeFile, match="nested more than"):
        deep = []
        for _ in range(100):
            deep = [deep]
        check_plain(deep, "state")


def test_load_plain_refuses_code_corruption_and_legacy_pickles(tmp_path):
    marker = tmp_path / "PWNED"
    f = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2), "evil": _Payload(marker)}, f)
    with pytest.raises(UnsafeFile, match=r"x.pt: refused: this checkpoint file is not plain data "
                                         r"\(it names posix.system"):
        load_plain(f)
    assert not marker.exists()
    torch.save({"w": torch.ones(2)}, f)
    assert torch.equal(load_plain(f)["w"], torch.ones(2))
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(UnsafeFile, match="truncated or corrupted"):
        load_plain(f)
    import pickle

    f.write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(UnsafeFile, match="legacy"):
        load_plain(f)
    with pytest.raises(UnsafeFile, match="no such"):
        load_plain(tmp_path / "missing.pt")


def test_huge_json_files_are_refused_unread(tmp_path):
    big = tmp_path / "plan.json"
    with open(big, "wb") as fh:          # a sparse 10 GB file: nothing is written or read
        fh.truncate(10 * 2**30)
    with pytest.raises(UnsafeFile, match=r"10240.0 MiB; refused unread"):
        read_json(big, "plan")
    with pytest.raises(PlanError, match="refused unread"):
        Plan.load(big)
    with pytest.raises(PlanError, match="refused unread"):
        Problem.load(big)
    from malleus_ds.app.config import ConfigError, load_ds_config

    with pytest.raises(ConfigError, match="refused unread"):
        load_ds_config(big)


def test_implausible_numbers_in_plans_and_problems_are_refused():
    plan = {"version": 1, "num_layers": 10**12, "global_batch_size": 8, "micro_batch_size": 1,
            "pipelines": [{"micro_batches": 8, "stages": [{"ranks": [0], "layers": [0, 10**12]}]}]}
    with pytest.raises(PlanError, match=r"=1000000000000 is out of range \(at most 99999\)"):
        Plan.from_json(plan)
    plan["num_layers"] = 4
    plan["pipelines"][0]["stages"][0]["ranks"] = [2**40]
    with pytest.raises(PlanError, match="out of range"):
        Plan.from_json(plan)
    from pathlib import Path

    ex = Path(__file__).resolve().parents[3] / "examples" / "problem_64gpu_one_slow.json"
    prob = json.loads(ex.read_text())
    prob["cluster"]["nodes"] = 10**9
    with pytest.raises(PlanError, match="out of range"):
        Problem.from_json(prob)


def test_a_checkpoint_record_claiming_a_huge_world_is_refused(tmp_path):
    from malleus_ds.engine.checkpoint import CheckpointError, check_compatible
    from malleus_ds.plan import static_plan

    plan = static_plan(2, 4, 1, 1, 1, 2)
    meta = {"num_layers": 2, "global_batch_size": 4, "micro_batch_size": 1, "params": {},
            "plan": plan.to_json(), "world_size": 10**12}
    with pytest.raises(CheckpointError, match="world_size=1000000000000"):
        check_compatible(tmp_path, meta, plan, [])


def test_hf_local_refuses_pickled_weights_and_says_how_to_convert(tmp_path):
    from malleus_ds.models.hf import HFError, check_safetensors_only

    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(HFError, match=r"only pickled weights \(pytorch_model.bin\).*"
                                      r"safe_serialization=True"):
        check_safetensors_only(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    check_safetensors_only(tmp_path)


def test_deepspeed_loader_is_weights_only_with_its_four_value_classes(tmp_path):
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import LossScaler

    from malleus_ds.interop.compat import load_weights_only

    class Eng:
        checkpoint_engine = TorchCheckpointEngine()

    e = Eng()
    assert load_weights_only(e) and not load_weights_only(e)     # swapped once
    f = tmp_path / "optim.pt"
    torch.save({"loss_scaler": LossScaler(scale=4.0), "w": torch.ones(1)}, f)
    assert e.checkpoint_engine.load(str(f))["loss_scaler"].cur_scale == 4.0
    marker = tmp_path / "PWNED"
    torch.save({"loss_scaler": LossScaler(scale=4.0), "evil": _Payload(marker)}, f)
    with pytest.raises(UnsafeFile, match="posix.system"):
        e.checkpoint_engine.load(str(f))
    assert not marker.exists()
