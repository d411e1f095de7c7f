"""``malleus-export``: a trained model as a Hugging Face folder (``config.json`` + safetensors).

    malleus-export CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--force]

``CHECKPOINT_DIR`` is an app checkpoint (``launch/train.py checkpoint.dir=...``): the folder with
``latest`` (its newest checkpoint is exported) or one ``global_step{N}/`` tag folder. Its
``run.json`` names the engine and the model (``model.describe()``); the model must be a Hugging
Face one (``model=hf`` / ``model=hf_local``: ``"family": "hf"``). The weights come from

* engine=malleus: the per-rank slice files (``malleus_ds/engine/checkpoint.py``) of ANY plan,
  TP degree, ZeRO stage and world size: every full tensor is assembled from the slices the ranks
  stored (canonical flat intervals, ``malleus_ds/layout.py``), by reading files only (no process
  group). Under bf16/fp16 the fp32 master weights are exported, else the parameters;
* engine=torch: ``torch_state.pt`` (the reference model's state dict);
* engine=deepspeed: DeepSpeed's ``mp_rank_00_model_states.pt`` for ``pp=1`` fp32 runs (the module
  holds the full fp32 weights under ZeRO 0-2). Pipeline (per-layer files) and bf16/fp16 runs (the
  fp32 weights live only in the ZeRO optimizer files) are refused with a clear error.

``OUT_DIR`` gets ``config.json`` (the recorded transformers config rebuilt with
``AutoConfig.for_model``, ``use_cache`` back to its default, ``architectures`` and ``dtype`` set)
and ``model.safetensors`` under Hugging Face names (``malleus_ds.interop.names.hf_name``). A tied
model (``tie_word_embeddings``) stores ``model.embed_tokens.weight`` only: transformers re-ties
``lm_head.weight`` on load. For a ``model=hf_local`` run whose source folder still exists, its
tokenizer and generation-config files are copied along, so the folder is complete.
``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it. An existing non-empty ``OUT_DIR`` is
refused unless ``--force``.

:func:`export_engine` (``malleus_ds.export_engine(engine, out_dir)``) writes the same folder from a
running engine:
collective; each TP slice of each parameter is sent to rank 0 by one of its holders, rank 0 writes.

Bad input prints ``malleus-export: error: ...`` (one line naming the path) and exits with code 2
(the command line: ``malleus_ds/app/cli.py``, ``export_main``).
"""
from __future__ import annotations


from .hf_folder import (DTYPES, PROG, ExportError, Exported, _summary, build_config,
                        check_out_dir, hf_tensors, write_folder)
from .live import export_engine
from .readers import _export_checkpoint, export_checkpoint, find_checkpoint

__all__ = ["DTYPES", "PROG", "ExportError", "Exported", "build_config", "check_out_dir",
           "export_checkpoint", "export_engine", "find_checkpoint", "hf_tensors", "write_folder"]
