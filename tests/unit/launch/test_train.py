"""launch/train.py's launcher plumbing and DistEnv, without processes."""
from __future__ import annotations

import importlib.util
from pathlib import Path

from malleus_ds.app.runners import DistEnv

TRAIN = Path(__file__).resolve().parents[3] / "launch" / "train.py"


def _train_module():
    spec = importlib.util.spec_from_file_location("malleus_train_app", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_strip_local_rank(monkeypatch):
    app = _train_module()
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert app.strip_local_rank(["train.py", "--local_rank=3", "engine=deepspeed"]) == \
        ["train.py", "engine=deepspeed"]
    import os
    assert os.environ["LOCAL_RANK"] == "3"
    assert app.strip_local_rank(["t.py", "--local-rank", "1", "a=b"]) == ["t.py", "a=b"]
    assert app.strip_local_rank(["t.py", "model=tiny"]) == ["t.py", "model=tiny"]


def test_non_zero_ranks_get_no_output_dir():
    o = _train_module()._non_zero_rank_overrides()
    assert "hydra.output_subdir=null" in o and "hydra.run.dir=." in o


def test_dist_env_from_launchers(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        monkeypatch.delenv(k, raising=False)
    assert DistEnv.from_environ("cpu") == DistEnv()
    # the deepspeed launcher: LOCAL_SIZE instead of torchrun's LOCAL_WORLD_SIZE
    monkeypatch.setenv("RANK", "5"), monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1"), monkeypatch.setenv("LOCAL_SIZE", "4")
    e = DistEnv.from_environ("cpu")
    assert (e.rank, e.world_size, e.local_rank, e.local_world_size, e.backend) == (5, 8, 1, 4, "gloo")
    assert not e.is_rank0


