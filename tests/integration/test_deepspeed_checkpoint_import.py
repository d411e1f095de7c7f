"""engine=malleus continues a checkpoint that stock DeepSpeed wrote, under another plan
(``engine/ds_checkpoint.py``): engine=deepspeed for N steps, then engine=malleus from its files
under a non-uniform plan of another world size and TP, gives the per-step losses of stock
DeepSpeed running N+M steps (weights, Adam moments and step, LR schedule, counters all carried).
ZeRO-0, 1 and 2 saves, bf16, PipelineEngine; bad folders refused with a message."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tests.integration.harness import run_distributed

N, M, G = 3, 3, 8
MODEL = {"name": "tiny", "num_layers": 4, "hidden_size": 32, "num_heads": 4, "max_seq_len": 32}
# the LR moves every step (warm-up over 2 steps, then a linear decay to step 8): a continued
# run that lost the schedule's position steps at other rates
SCHED = {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 3e-3,
                                             "warmup_num_steps": 2, "total_num_steps": 8,
                                             "warmup_type": "linear"}}


def _ds(zero: int, bf16: bool = False) -> dict:
    return {"zero_optimization": {"stage": zero}, "gradient_clipping": 0.0, "scheduler": SCHED,
            "steps_per_print": 10**9, **({"bf16": {"enabled": True}} if bf16 else {})}


def _run(rank, world, engine, zero, steps, ckpt, resume, plan=None, bf16=False, pp=1):
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    d = {"engine": engine, "progress": False, "model": MODEL,
         "train": {"steps": steps, "global_batch_size": G, "micro_batch_size": 1, "seed": 3,
                   "lr": 3e-3},
         "deepspeed": {"config": _ds(zero, bf16)}, "malleus": {"adaptive": False},
         "checkpoint": {"dir": str(ckpt), "resume": resume, "background": False}}
    if plan is not None:
        d["plan"] = str(plan)
    if pp > 1:
        d["parallel"] = {"tp": 1, "pp": pp, "dp": None}
    cfg = build_run_config(d, world_size=world)
    return list(runners.run(cfg, runners.DistEnv.from_environ("cpu")).losses)


def _other_plan(tmp):
    """4 ranks: a TP=2 pipeline of two stages (layers 0-2 | 3) with 5 micro-batches beside a
    one-rank pipeline with 3: another world size, TP and layout than the saving ZeRO run."""
    from tests.cases import plan_json

    p = tmp / "plan.json"
    p.write_text(json.dumps(plan_json([(5, [([0, 1], (0, 3)), ([2], (3, 4))]),
                                       (3, [([3], (0, 4))])], G=G)))
    return p


@pytest.fixture(scope="session")
def ds_zero1(tmp_path_factory):
    """engine=deepspeed ZeRO-1 on 2 ranks: its losses over N+M steps, and the checkpoint
    folder of its first N (shared by the tests here and test_deepspeed_universal_export.py;
    a test that changes it works on a copy, :func:`zero1_copy`)."""
    tmp = tmp_path_factory.mktemp("ds_zero1")
    full = run_distributed(_run, 2, "deepspeed", 1, N + M, tmp / "full", False, timeout=300)[0]
    first = run_distributed(_run, 2, "deepspeed", 1, N, tmp / "ck", False, timeout=300)[0]
    np.testing.assert_allclose(first, full[:N], rtol=1e-6)
    return tmp / "ck", full


def zero1_copy(ds_zero1, tmp_path):
    import shutil

    shutil.copytree(ds_zero1[0], tmp_path / "ck")
    return tmp_path / "ck"


@pytest.mark.parametrize("zero,bf16", [(0, False), (1, False), (2, False), (1, True)],
                         ids=["zero0", "zero1", "zero2", "zero1-bf16"])
def test_malleus_continues_a_deepspeed_checkpoint_under_another_plan(tmp_path, zero, bf16,
                                                                    ds_zero1):
    """bf16: DeepSpeed's bf16 optimizer files (fp32 masters beside bf16 weights), continued in
    bf16 under TP=2, whose partial sums round differently: losses within bf16's rounding
    (observed 2e-5; test_malleus_precision.py's bound)."""
    if (zero, bf16) == (1, False):
        ck, full = zero1_copy(ds_zero1, tmp_path), ds_zero1[1]
    else:
        full = run_distributed(_run, 2, "deepspeed", zero, N + M, tmp_path / "full", False,
                               None, bf16, timeout=300)[0]
        ck = tmp_path / "ck"
        first = run_distributed(_run, 2, "deepspeed", zero, N, ck, False, None, bf16,
                                timeout=300)[0]
        np.testing.assert_allclose(first, full[:N], rtol=1e-6)
    got = run_distributed(_run, 4, "malleus", zero, N + M, ck, True, _other_plan(tmp_path), bf16,
                          timeout=300)
    for r, losses in enumerate(got):
        assert len(losses) == M, (r, losses)
        np.testing.assert_allclose(losses, full[N:], rtol=1e-3 if bf16 else 2e-5,
                                   err_msg=f"rank {r}")
    meta = json.loads((ck / f"global_step{N}" / "malleus" / "meta.json").read_text())
    assert meta["from"]["zero_stage"] == zero and meta["from"]["dp"] == 2
    assert meta["adam_step"] == N and meta["global_steps"] == N
    if zero and not bf16:           # ZeRO's files carry the (here static, 1.0) loss scaler
        import torch

        rank0 = torch.load(ck / f"global_step{N}" / "malleus" / "malleus_rank00000.pt",
                           weights_only=True)
        assert rank0["engine"]["loss_scaler"]["cur_scale"] == 1.0


def test_malleus_continues_a_pipeline_engine_checkpoint(tmp_path):
    """PipelineEngine (pp=2 x dp=2, ZeRO-1): each layer's weights in a file of its own, each
    stage's ZeRO partitions in its own files; continued on 4 ranks under the non-uniform TP=2
    plan with stock DeepSpeed's losses."""
    full = run_distributed(_run, 4, "deepspeed", 1, N + M, tmp_path / "full", False, None,
                           False, 2, timeout=300)[0]
    ck = tmp_path / "ck"
    run_distributed(_run, 4, "deepspeed", 1, N, ck, False, None, False, 2, timeout=300)
    assert (ck / f"global_step{N}" / "layer_01-model_states.pt").is_file()
    got = run_distributed(_run, 4, "malleus", 1, N + M, ck, True, _other_plan(tmp_path),
                          timeout=300)
    for r, losses in enumerate(got):
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5, err_msg=f"rank {r}")
    meta = json.loads((ck / f"global_step{N}" / "malleus" / "meta.json").read_text())
    assert meta["from"]["dp"] == 2 and meta["from"]["pipeline_stages"] == 2
    assert meta["adam_step"] == N


def test_bad_deepspeed_folders_are_refused(tmp_path, ds_zero1):
    """A partial save (an optimizer file missing), a truncated file, a poisoned pickle and a
    folder that is not a DeepSpeed checkpoint: each refused by name, nothing run."""
    import pickle
    import shutil

    from malleus_ds.engine.ds_checkpoint import read_state
    from malleus_ds.files.ckpt_format import CheckpointError

    ck = zero1_copy(ds_zero1, tmp_path)
    tag = ck / f"global_step{N}"
    assert read_state(ck).adam_step == N and read_state(tag).zero_stage == 1
    with pytest.raises(CheckpointError, match=r"is not a DeepSpeed checkpoint: it has no "
                                              r"mp_rank_00_model_states.pt"):
        read_state(tmp_path)
    bad = tmp_path / "partial"
    shutil.copytree(tag, bad)
    (bad / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"lacks the optimizer file\(s\) of rank\(s\) \[1\]: "
                                              r"a partial save"):
        read_state(bad)
    cut = tmp_path / "cut"
    shutil.copytree(tag, cut)
    f = cut / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    f.write_bytes(f.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=r"cannot read this DeepSpeed checkpoint file|"
                                              r"not a complete"):
        read_state(cut)

    class Boom:
        def __reduce__(self):
            return (print, ("ran code",))

    evil = tmp_path / "evil"
    shutil.copytree(tag, evil)
    import torch

    torch.save({"module": {"x": Boom()}}, evil / "mp_rank_00_model_states.pt",
               pickle_module=pickle)
    with pytest.raises(CheckpointError, match=r"refused: this DeepSpeed checkpoint file is not "
                                              r"plain data"):
        read_state(evil)


def test_another_model_is_refused(tmp_path, ds_zero1):
    """A DeepSpeed checkpoint of another model shape: engine=malleus refuses it naming the
    parameter, before training."""
    ck = zero1_copy(ds_zero1, tmp_path)
    rec = ck / f"global_step{N}" / "run.json"
    meta = json.loads(rec.read_text())
    meta["model"]["hidden_size"] = 64                 # the run.json check would catch it:
    rec.write_text(json.dumps(meta))                  # make it agree
    with pytest.raises(Exception, match=r"another model"):
        run_distributed(_big, 2, ck, timeout=300)


def _big(rank, world, ck):
    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    d = {"engine": "malleus", "progress": False, "model": dict(MODEL, hidden_size=64),
         "train": {"steps": N + 1, "global_batch_size": G, "micro_batch_size": 1, "seed": 3},
         "deepspeed": {"config": _ds(1)}, "malleus": {"adaptive": False},
         "checkpoint": {"dir": str(ck), "resume": True}}
    return runners.run(build_run_config(d, world_size=world), runners.DistEnv.from_environ("cpu"))


def _initialize_and_load(rank, world, ck, plan):
    """A ``malleus_ds.initialize`` user's engine loads a DeepSpeed folder itself."""
    from malleus_ds import initialize
    from malleus_ds.app.config import build_run_config
    from malleus_ds.data import build_dataset
    from malleus_ds.plan import Plan

    d = {"engine": "malleus", "model": MODEL,
         "train": {"steps": N + M, "global_batch_size": G, "micro_batch_size": 1, "seed": 3}}
    cfg = build_run_config(d, world_size=world)
    eng, *_ = initialize(model=cfg.model, plan=Plan.load(plan), data=build_dataset(cfg),
                         config=dict(_ds(1), optimizer={"type": "AdamW", "params": {
                             "lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8}},
                             malleus={"seed": 3, "adaptive": False}))
    eng.load_checkpoint(str(ck))
    return eng.global_steps, [eng.train_batch(step=s) for s in range(N, N + M)]


def test_initialize_users_load_a_deepspeed_folder(tmp_path, ds_zero1):
    ck, full = zero1_copy(ds_zero1, tmp_path), ds_zero1[1]
    got = run_distributed(_initialize_and_load, 4, ck, _other_plan(tmp_path), timeout=300)
    for steps, losses in got:
        assert steps == N
        np.testing.assert_allclose(losses, full[N:], rtol=2e-5)
