"""The ``model.*`` section of a run: which model it names, and the layout checks only the model
can answer (stages need layers; TP must split the heads and the FFN).

Plain values in, a model (``ModelConfig``, or ``HFModel`` for ``model=hf``) out, so the app's
``config.build_run_config`` stays a parser and this package stays in the core: every refusal is
a :class:`ModelError` (or the model's ``TPError``) whose text the app passes on unchanged.
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any, Mapping

from .llama import ModelConfig, model_config


class ModelError(ValueError):
    """A ``model.*`` section (or a layout) that names no model this package can build."""


#: ``model=hf`` keys (conf/model/hf.yaml, hf_local.yaml)
HF_MODEL_KEYS = ("hf_config", "hf_path", "max_seq_len", "num_layers")


def parse_model(m: Mapping[str, Any]):
    """``model.*`` -> the model: a preset of ours (``name``, with field overrides) or
    ``name=hf``. Raises :class:`ModelError` naming the field."""
    m = dict(m)
    name = m.pop("name", "tiny")
    if name == "hf":
        return _hf_model(m)
    allowed = {f.name for f in fields(ModelConfig)} - {"name"}
    unknown = sorted(set(m) - allowed)
    if unknown:
        raise ModelError(f"model has unknown fields {unknown}; allowed: {sorted(allowed)}")
    try:
        return model_config(str(name), **m)
    except (ValueError, TypeError) as e:
        raise ModelError(str(e)) from None


def _hf_model(m: Mapping[str, Any]):
    """``model=hf``: a Hugging Face Llama-family model (malleus_ds/models/hf.py; transformers is
    imported only here, when such a model is named)."""
    from .hf import HFError, load_hf_model

    unknown = sorted(set(m) - set(HF_MODEL_KEYS))
    if unknown:
        raise ModelError(f"model=hf has unknown fields {unknown}; allowed: {sorted(HF_MODEL_KEYS)}")
    for k in ("max_seq_len", "num_layers"):
        if m.get(k) is not None and (isinstance(m[k], bool) or not isinstance(m[k], int) or m[k] < 1):
            raise ModelError(f"model.{k}={m[k]!r} must be a positive integer")
    for k in ("hf_config", "hf_path"):
        if m.get(k) is not None and not isinstance(m[k], str):
            raise ModelError(f"model.{k}={m[k]!r} must be a string (a preset name or a path)")
    try:
        return load_hf_model(m.get("hf_config"), m.get("hf_path"), max_seq_len=m.get("max_seq_len"),
                             num_hidden_layers=m.get("num_layers"))
    except (HFError, OSError, ValueError, TypeError) as e:
        raise ModelError(str(e)) from None


def check_layout(model, tp: int, pp: int) -> None:
    """``parallel.pp`` stages each need a layer of ``model``; ``parallel.tp`` must split its heads
    and FFN width. Raises :class:`ModelError` / the model's ``TPError`` (both ValueErrors)."""
    if pp > model.num_layers:
        raise ModelError(f"parallel.pp={pp} stages cannot hold model.num_layers="
                         f"{model.num_layers} layers (each stage needs >= 1 layer)")
    model.check_tp(tp, "parallel.tp")
