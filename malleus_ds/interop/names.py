"""One parameter naming, three spellings: ours (the global name), Hugging Face's and DeepSpeed
PipelineModule's. Each function maps one way; each pair is a round trip.

* ours: ``embed.<name>`` (the embedding piece), ``blocks.<l>.<name>`` (decoder layer ``l``),
  ``head.<name>`` (the final norm and the output projection), e.g. ``embed.embed_tokens.weight``,
  ``blocks.0.self_attn.q_proj.weight``, ``head.norm.weight``, ``head.lm_head.weight``;
* Hugging Face's Llama family (:func:`hf_name`, :func:`global_name`): ``model.<name>`` for the
  embedding, ``model.layers.<l>.<name>``, ``model.norm.<name>`` and ``lm_head.<name>``;
* engine=deepspeed's PipelineModule (:func:`pipeline_name`, :func:`from_pipeline`) for an untied
  model of ``num_layers`` decoder layers: ``{piece}.layer.<name>``, piece 0 the embedding,
  1..``num_layers`` the decoder layers, ``num_layers + 1`` the head.
"""
from __future__ import annotations

import re

_PIECE = re.compile(r"^(\d+)\.layer\.(.+)$")


#: the Hugging Face prefix of our embedding and decoder-layer pieces (the head's is per name)
_HF_PREFIX = {"embed": "model.", "blocks": "model.layers."}


def hf_name(name: str) -> str:
    """Our global parameter name -> the Hugging Face checkpoint name."""
    piece, _, rest = name.partition(".")
    if piece == "head":
        return f"model.{rest}" if rest.startswith("norm.") else rest
    if piece not in _HF_PREFIX:
        raise KeyError(f"not a model parameter name: {name!r}")
    return _HF_PREFIX[piece] + rest


def global_name(hf: str) -> str:
    """Inverse of :func:`hf_name`."""
    if hf.startswith("model.layers."):
        return "blocks." + hf[len("model.layers."):]
    if hf.startswith("model.norm."):
        return "head." + hf[len("model."):]
    if hf.startswith("model."):
        return "embed." + hf[len("model."):]
    if hf.startswith("lm_head."):
        return "head." + hf
    raise KeyError(f"not a Llama-family parameter name: {hf!r}")


def pipeline_name(name: str, num_layers: int) -> str | None:
    """Our global name -> engine=deepspeed's PipelineModule name for an untied model (module
    doc); None for a name outside those pieces."""
    first, _, rest = name.partition(".")
    if first == "embed":
        return f"0.layer.{rest}"
    if first == "head":
        return f"{num_layers + 1}.layer.{rest}"
    if first == "blocks":
        i, _, r = rest.partition(".")
        return f"{int(i) + 1}.layer.{r}" if i.isdigit() else None
    return None


def from_pipeline(name: str, num_layers: int) -> str | None:
    """Inverse of :func:`pipeline_name`; None for a name that is not ``{piece}.layer.<name>``."""
    m = _PIECE.match(name)
    if m is None:
        return None
    i = int(m.group(1))
    return ("embed" if i == 0 else f"blocks.{i - 1}" if i <= num_layers
            else "head") + "." + m.group(2)
