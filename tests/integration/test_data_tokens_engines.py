"""Your own model and data through the app: one local token file and a Hugging Face model
(``model=hf model.hf_config=tiny-qwen2``: transformers' Qwen2 layers, grouped-query attention,
q/k/v biases) train to the same per-step losses on engine=torch (1 process, transformers' own
``Qwen2ForCausalLM``), engine=deepspeed (2 ranks, PipelineEngine pp=2 over the generated layer
list) and engine=malleus (2 ranks, pp=2), with samples shorter than the model's context
(data.seq_len=16 < max_seq_len=64: every engine sizes its batches and pipeline buffers by the
data), equal to the single-process reference on that data. A bad file stops every rank at
start-up (our own decoder, model=tiny).

The app's config is composed from conf/ by Hydra (the command line's overrides: ``data=tokens
data.path=train.bin`` relative to the working directory) and each engine runs on harness ranks
(tests/integration/harness.py: one 2-rank run holds both distributed engines, one after the
other); the launchers themselves with ``data=tokens`` are docs/getting-started.md's commands
(tests/test_readme_commands.py) and the bad-file test below."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.app_run import CONF, compose
from tests.integration.harness import run_distributed

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
STEPS, SEQ = 4, 16
COMMON = ["progress=false", f"train.steps={STEPS}", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.data_seed=3", "data=tokens", f"data.seq_len={SEQ}"]
HF = ["model=hf", "model.hf_config=tiny-qwen2"]


def _env():
    e = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        e.pop(k, None)
    return e


def _torchrun(n: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}",
            TRAIN]


def run_app(rank, world, cwd, jobs, capture_stderr=False):
    """On a harness rank: each composed config of ``jobs`` in turn (``build_run_config`` in
    ``cwd``, so relative paths are the working directory's, then the app's runner), as
    ``launch/train.py`` runs it on a launched rank. Returns [(per-step losses, this rank's
    stderr when ``capture_stderr``)] per job."""
    import contextlib
    import io

    from malleus_ds.app import runners
    from malleus_ds.app.config import build_run_config

    os.chdir(cwd)
    out = []
    for plain in jobs:
        err = io.StringIO()
        with contextlib.redirect_stderr(err) if capture_stderr else contextlib.nullcontext():
            cfg = build_run_config(plain, world_size=world, local_world_size=world,
                                   ds_search_dirs=(CONF / "deepspeed",))
            s = runners.run(cfg, runners.DistEnv.from_environ("cpu"))
        out.append((list(s.losses), err.getvalue()))
    return out


@pytest.mark.slow
def test_one_token_file_same_losses_on_every_engine(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)   # vocabulary 256
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids)
    torch_job = compose(HF + COMMON + ["engine=torch", "data.path=train.bin"])
    (torch_l, _), = run_distributed(run_app, 1, tmp_path, [torch_job], timeout=180)[0]
    jobs = [compose(HF + COMMON + ["engine=deepspeed", "parallel.pp=2", "data.path=train.bin"]),
            compose(HF + COMMON + ["engine=malleus", "parallel.pp=2",
                                   f"data.path={tmp_path / 'train.npy'}"])]
    per_rank = run_distributed(run_app, 2, tmp_path, jobs, timeout=180)
    from malleus_ds.data import DataConfig
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.app.reference import reference_run

    model = load_hf_model("tiny-qwen2")
    ref, _ = reference_run(model, seed=0, data_seed=3, steps=STEPS,
                           global_batch_size=8, micro_batch_size=2,
                           data=DataConfig("tokens", str(tmp_path / "train.bin"), seq_len=SEQ))
    assert len(torch_l) == STEPS
    np.testing.assert_allclose(torch_l, ref, rtol=1e-5, err_msg="engine=torch")
    for r, ((ds_l, _), (ml_l, _)) in enumerate(per_rank):
        np.testing.assert_allclose(ds_l, ref, rtol=1e-5, err_msg=f"engine=deepspeed rank {r}")
        np.testing.assert_allclose(ml_l, ref, rtol=1e-5, err_msg=f"engine=malleus rank {r}")
    byte_ref, _ = reference_run(model, seed=0, data_seed=3, steps=STEPS,
                                global_batch_size=8, micro_batch_size=2)
    assert not np.allclose(ref, byte_ref)                          # not the byte corpus


def test_ids_outside_the_vocabulary_stop_every_rank_at_start_up(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)
    ids[123] = 4000
    ids.tofile(tmp_path / "bad.bin")
    p = subprocess.run(_torchrun(2) + ["model=tiny"] + COMMON
                       + ["engine=malleus", "data.path=bad.bin", f"hydra.run.dir={tmp_path / 'run'}"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    msg = (f"data.path='{tmp_path / 'bad.bin'}': token id 4000 (at token index 123) is >= "
           f"model.vocab_size=256")
    for rank in (0, 1):
        assert f"config error (rank {rank}): {msg}" in p.stderr, p.stderr[-3000:]
    assert "malleus_ds/app/config.py" not in p.stderr                  # a message, not a traceback
