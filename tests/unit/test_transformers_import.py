"""Our top-level ``kernels`` package (Triton shard packing) shares its name with Hugging Face's
hub-kernels package, which ``transformers`` probes for. With ours installed, ``transformers``
must still import, must not take ours for HF's, and must run a Llama-family model."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

SCRIPT = r"""
import kernels, transformers, torch
from pathlib import Path
assert Path(kernels.__file__).resolve().parent == Path(REPO) / "kernels", kernels.__file__
from transformers.utils import is_kernels_available
assert not is_kernels_available(), "transformers took our kernels package for HF's"
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
for Cfg, Model in ((LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)):
    m = Model(Cfg(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2))
    assert m(torch.zeros(1, 5, dtype=torch.long)).logits.shape == (1, 5, 64)
print("ok", transformers.__version__)
"""


def test_transformers_imports_and_runs_beside_our_kernels_package(tmp_path):
    repo = Path(__file__).resolve().parents[2]
    # from another folder: ``kernels`` comes from the installed (editable) malleus_ds
    p = subprocess.run([sys.executable, "-c", f"REPO = {str(repo)!r}\n" + SCRIPT], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]
