"""Raw text and a model folder's own tokenizer through the app: a ``.jsonl`` of documents and a
local Llama folder (``model=hf_local``) holding a tokenizer trained here train to the same
per-step losses on engine=malleus (4 ranks, pp=2 x dp=2), engine=deepspeed (2 ranks,
PipelineEngine pp=2) and engine=torch (1 process), equal to the single-process reference on that
text. The 4 ranks of the first run all start at once on an empty cache: one tokenizes, the
others wait and read its file; the later runs tokenize nothing.

As in test_data_tokens_engines.py, the config is composed from conf/ by Hydra with the command
line's overrides and each engine runs on harness ranks (the ranks of a run are forked at once,
as a launcher starts them); the launchers with ``data=text`` are docs/getting-started.md's
commands (tests/test_readme_commands.py)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.integration.harness import run_distributed
from tests.integration.app_run import compose
from tests.integration.test_data_tokens_engines import run_app
from tests.unit.data.test_text import docs, make_tokenizer, write_jsonl

STEPS, SEQ = 3, 16
COMMON = ["progress=false", f"train.steps={STEPS}", "train.global_batch_size=8",
          "train.micro_batch_size=2", "train.data_seed=3", "data=text", "data.path=train.jsonl",
          f"data.seq_len={SEQ}", "model=hf_local", "model.hf_path=my-llama"]
TOKENIZING = "[malleus_ds] data: tokenizing 1 file(s)"


def _run(world: int, overrides: list[str], cwd) -> list[tuple[list[float], str]]:
    """[(per-step losses, stderr)] per rank of one job on ``world`` harness ranks."""
    return [r[0] for r in run_distributed(run_app, world, cwd, [compose(COMMON + overrides)],
                                          True, timeout=240)]


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
    ml = _run(4, ["engine=malleus", "parallel.pp=2", "parallel.dp=2"], tmp_path)
    ds = _run(2, ["engine=deepspeed", "parallel.pp=2"], tmp_path)
    (torch_l, torch_err), = _run(1, ["engine=torch"], tmp_path)
    ml_err = "".join(err for _, err in ml)
    assert ml_err.count(TOKENIZING) == 1, ml_err[-3000:]            # one of 4 ranks tokenized
    others = "".join(err for _, err in ds) + torch_err
    assert TOKENIZING not in others, others[-3000:]                  # the others found the cache
    assert len(list((tmp_path / "train.jsonl.malleus-tokens").glob("*.npy"))) == 1

    from malleus_ds.data import DataConfig
    from malleus_ds.models.hf import load_hf_model
    from malleus_ds.app.reference import reference_run

    ref, _ = reference_run(load_hf_model(hf_path=str(model)), seed=0, data_seed=3, steps=STEPS,
                           global_batch_size=8, micro_batch_size=2,
                           data=DataConfig("text", str(tmp_path / "train.jsonl"), seq_len=SEQ))
    assert len(torch_l) == STEPS
    np.testing.assert_allclose(torch_l, ref, rtol=1e-5, err_msg="engine=torch")
    for engine, per_rank in (("deepspeed", ds), ("malleus", ml)):
        for r, (losses, _) in enumerate(per_rank):
            np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"engine={engine} rank {r}")
