"""Raw text and a model folder's own tokenizer through the app: a ``.jsonl`` of documents and a
local Llama folder (``model=hf_local``) holding a tokenizer trained here train to the same
per-step losses on engine=malleus (4 ranks, pp=2 x dp=2), engine=deepspeed (2 ranks,
PipelineEngine pp=2) and engine=torch (1 process), equal to the single-process reference on that
text. The 4 ranks of the first run all start at once on an empty cache: one tokenizes, the
others wait and read its file; the later runs tokenize nothing."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.integration.test_data_tokens_engines import _env, _torchrun
from tests.unit.data.test_text import docs, make_tokenizer, write_jsonl

REPO = Path(__file__).resolve().parents[2]
TRAIN = str(REPO / "launch" / "train.py")
STEPS, SEQ = 3, 16
COMMON = ["progress=false", f"train.steps={STEPS}", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.data_seed=3", "data=text", "data.path=train.jsonl",
          f"data.seq_len={SEQ}", "model=hf_local", "model.hf_path=my-llama"]
TOKENIZING = "[malleus_ds] data: tokenizing 1 file(s)"


def _run(cmd: list[str], out: Path, cwd: Path) -> tuple[list[float], str]:
    p = subprocess.run(cmd + COMMON + [f"hydra.run.dir={out}"], cwd=cwd, env=_env(),
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "event" not in r], p.stderr


@pytest.mark.slow
def test_raw_text_same_losses_on_every_engine(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = tmp_path / "my-llama"
    LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, max_position_embeddings=SEQ)
                     ).save_pretrained(str(model))
    make_tokenizer(model, kind="bpe", vocab_size=300)               # the model's own tokenizer
    write_jsonl(tmp_path / "train.jsonl", docs(40))
    ml_l, ml_err = _run(_torchrun(4) + ["engine=malleus", "parallel.pp=2", "parallel.dp=2"],
                        tmp_path / "malleus", tmp_path)
    ds_l, ds_err = _run(_torchrun(2) + ["engine=deepspeed", "parallel.pp=2"],
                        tmp_path / "deepspeed", tmp_path)
    torch_l, torch_err = _run([sys.executable, TRAIN, "engine=torch"], tmp_path / "torch", tmp_path)
    assert ml_err.count(TOKENIZING) == 1, ml_err[-3000:]            # one of 4 ranks tokenized
    assert TOKENIZING not in ds_err + torch_err                    # the others found the cache
    assert len(list((tmp_path / "train.jsonl.malleus-tokens").glob("*.npy"))) == 1

    from malleus_ds.data import DataConfig
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.app.reference import reference_run

    ref, _ = reference_run(load_hf_model(hf_path=str(model)), seed=0, data_seed=3, steps=STEPS,
                           global_batch_size=8, micro_batch_size=2,
                           data=DataConfig("text", str(tmp_path / "train.jsonl"), seq_len=SEQ))
    assert len(torch_l) == STEPS
    for got in (torch_l, ds_l, ml_l):
        np.testing.assert_allclose(got, ref, rtol=1e-5)
