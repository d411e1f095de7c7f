"""Your own model and data through the app: one local token file and a Hugging Face model
(``model=hf model.hf_config=tiny-qwen2``: transformers' Qwen2 layers, grouped-query attention,
q/k/v biases) train to the same per-step losses on engine=torch (1 process, transformers' own
``Qwen2ForCausalLM``), engine=deepspeed (2 ranks, PipelineEngine pp=2 over the generated layer
list) and engine=malleus (2 ranks, pp=2), with samples shorter than the model's context
(data.seq_len=16 < max_seq_len=64: every engine sizes its batches and pipeline buffers by the
data), equal to the single-process reference on that data. A bad file stops every rank at
start-up (our own decoder, model=tiny)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

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


def _losses(cmd: list[str], out: Path, cwd: Path) -> list[float]:
    p = subprocess.run(cmd + HF + COMMON + [f"hydra.run.dir={out}"], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "event" not in r]


@pytest.mark.slow
def test_one_token_file_same_losses_on_every_engine(tmp_path):
    ids = np.random.default_rng(0).integers(0, 256, 3000).astype(np.uint16)   # vocabulary 256
    ids.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", ids)
    torch_l = _losses([sys.executable, TRAIN, "engine=torch", "data.path=train.bin"],
                      tmp_path / "torch", tmp_path)
    ds_l = _losses(_torchrun(2) + ["engine=deepspeed", "parallel.pp=2", "data.path=train.bin"],
                   tmp_path / "deepspeed", tmp_path)
    ml_l = _losses(_torchrun(2) + ["engine=malleus", "parallel.pp=2",
                                   f"data.path={tmp_path / 'train.npy'}"],
                   tmp_path / "malleus", tmp_path)
    from malleus_ds.data import DataConfig
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.app.reference import reference_run

    model = load_hf_model("tiny-qwen2")
    ref, _ = reference_run(model, seed=0, data_seed=3, steps=STEPS,
                           global_batch_size=8, micro_batch_size=2,
                           data=DataConfig("tokens", str(tmp_path / "train.bin"), seq_len=SEQ))
    assert len(torch_l) == STEPS
    for got in (torch_l, ds_l, ml_l):
        np.testing.assert_allclose(got, ref, rtol=1e-5)
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
