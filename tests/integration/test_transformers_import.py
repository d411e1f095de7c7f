"""Our Triton kernels (the repository's ``kernels/`` folder) install as ``malleus_ds_kernels``, so
they can never shadow Hugging Face's hub-kernels package ``kernels``, which newer transformers
require. The suite runs with HF's ``kernels`` installed (dev extras): ``import kernels`` must be
HF's, ``transformers`` and its hub-kernels integration must import, and a Llama-family model must
run -- from another folder and from the repository root (where ``kernels/`` is on ``sys.path``
through the CWD). Inside the training app (``launch/train.py`` runs from the root too, with the
root on ``sys.path``): docs/getting-started.md's ``model=hf`` command, run from a copy of the
repository by tests/test_readme_commands.py, must train (its EXPECT entry)."""
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.metadata as md
import kernels, transformers, torch
from pathlib import Path
assert Path(kernels.__file__).resolve().parent != Path(REPO) / "kernels", kernels.__path__
assert md.version("kernels"), "HF's kernels package is not installed (dev extras)"
import transformers.integrations.hub_kernels  # noqa: F401 - imports HF's kernels when usable
import malleus_ds_kernels.pack as P
assert Path(P.__file__).resolve() == Path(REPO) / "kernels" / "pack.py", P.__file__
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
for Cfg, Model in ((LlamaConfig, LlamaForCausalLM), (Qwen2Config, Qwen2ForCausalLM)):
    m = Model(Cfg(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2))
    assert m(torch.zeros(1, 5, dtype=torch.long)).logits.shape == (1, 5, 64)
print("ok", transformers.__version__, md.version("kernels"))
"""


@pytest.mark.parametrize("where", ["elsewhere", "repo_root"])
def test_hf_kernels_package_is_not_shadowed(tmp_path, where):
    cwd = REPO if where == "repo_root" else tmp_path
    p = subprocess.run([sys.executable, "-c", f"REPO = {str(REPO)!r}\n" + SCRIPT], cwd=cwd,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "ok" in p.stdout, p.stderr[-3000:]


def test_no_kernels_package_at_the_repository_root():
    # an __init__.py would make kernels/ a regular package that wins over HF's on sys.path
    assert not (REPO / "kernels" / "__init__.py").exists()
    assert (REPO / "kernels" / "pack.py").exists()
