"""The model interface every engine, TP, gradient sync, the slice map and the migrator use.

A *model* here is a config object (our own :class:`~malleus_ds.models.llama.ModelConfig`, or
:class:`~malleus_ds.models.hf.HFModel` for Hugging Face Llama-family models) that can build the
pieces a pipeline stage holds, one at a time, without building the rest of the model:

* ``build_layer(layer_id, seed, init=True)``: the embedding (``EMBED``), decoder layer
  ``0..L-1`` or final norm + head (``HEAD``), with deterministic weights (a function of ``seed``
  and ``layer_id`` only, so any rank builds the same weights as one process) or loaded ones;
  ``init=False`` (on the meta device): no weights, for a stage whose weights arrive by migration;
* ``block_context(x)`` once per stage forward (e.g. the rotary tables), and
  ``run_block(block, x, ctx)``: how a stage calls a decoder layer; only hidden states travel
  between stages;
* ``tp_plan``: parameter name inside a decoder layer -> the dim TP splits (0 = column-parallel,
  1 = row-parallel; absent = replicated inside a TP group), as HF's ``base_model_tp_plan`` and
  torchtitan's ``apply_tp``; ``tp_regions(block)``: the sub-modules that get Megatron's ``f``
  before and ``g`` after (attention, MLP); ``check_tp(tp_size, where)``: a clear error for a TP
  size the model cannot be split by;
* ``tied_params()``: pairs of global parameter names that are ONE parameter of the model (tied
  input/output embeddings). The engines keep a copy on each holder and sum their gradients;
* ``loss(logits, targets)``, sizes (``num_layers``, ``hidden_size``, ``num_heads``,
  ``vocab_size``, ``max_seq_len``) and ``describe()`` (a JSON-able record for run.json and
  checkpoints).

:func:`param_table` reads the global parameter table off modules built on the meta device, so
the slice map never needs a model's parameter names.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

# Layer ids: EMBED for the embedding, 0..L-1 for decoder layers, HEAD for norm + head (the slice
# map's, defined once in layout.py)
from ..layout import EMBED, HEAD

class TPError(ValueError):
    """A TP group size the model cannot be split by."""


def check_tp_divides(tp_size: int, where: str, dims) -> None:
    """The one TP-size check of every model's ``check_tp``: raise :class:`TPError` unless
    ``tp_size >= 1`` divides each ``(name, value, why)`` of ``dims`` (``name``: the model's
    field as the user knows it; ``why``: words before the advice, or ""), naming the first
    that it does not divide."""
    pre = f"{where}: " if where else ""
    if tp_size < 1:
        raise TPError(f"{pre}TP size {tp_size} must be >= 1")
    for name, v, why in dims:
        if v % tp_size:
            raise TPError(f"{pre}TP group size {tp_size} does not divide the model's {name}={v}; "
                          f"{why}use TP groups whose size divides {v}")


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy of a micro-batch (every sample has T tokens, so this is also the
    mean over its samples of the per-sample mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


class StageModule(nn.Module):
    """Embedding (if first) + decoder layers ``[start, end)`` + head (if last), as one module.

    ``StageModule(cfg, 0, L, seed)`` is the whole model. Layer ``l`` is ``self.blocks[str(l)]``,
    so parameter names carry the *global* layer index (``blocks.5.<name inside the layer>``).
    """

    def __init__(self, cfg, start: int, end: int, seed: int,
                 with_embedding: bool | None = None, with_head: bool | None = None,
                 init: bool = True) -> None:
        super().__init__()
        if not 0 <= start < end <= cfg.num_layers:
            raise ValueError(f"stage layers [{start}, {end}) outside [0, {cfg.num_layers})")
        self.cfg = cfg
        self.start, self.end = start, end
        first = start == 0 if with_embedding is None else with_embedding
        last = end == cfg.num_layers if with_head is None else with_head
        self.embed = cfg.build_layer(EMBED, seed, init) if first else None
        self.blocks = nn.ModuleDict({str(l): cfg.build_layer(l, seed, init)
                                     for l in range(start, end)})
        self.head = cfg.build_layer(HEAD, seed, init) if last else None

    #: activation checkpointing (:func:`enable_activation_checkpointing`): a function
    #: ``(fn, x) -> fn(x)`` that keeps only ``x`` and recomputes ``fn`` in backward; None = off
    recompute: Callable | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) on the first stage, else hidden (B, T, H) -> hidden, or logits if last."""
        if self.embed is not None:
            x = self.embed(x)
        ctx = self.cfg.block_context(x)
        run, ckpt = self.cfg.run_block, self.recompute
        for blk in self.blocks.values():
            if ckpt is not None and torch.is_grad_enabled():
                x = ckpt(lambda h, blk=blk: run(blk, h, ctx), x)
            else:
                x = run(blk, x, ctx)
        if self.head is not None:
            x = self.head(x)
        return x


def torch_checkpoint(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    """``torch.utils.checkpoint`` without re-entrance: autograd keeps ``x`` only and re-runs
    ``fn`` when backward first needs one of its tensors. Non-reentrant because a first stage's
    input (the embedding output) and a later stage's received activation both work, any
    ``backward(out, grad)`` works, and parameter gradients reach their hooks (ZeRO, the engine's
    buckets) as in a plain backward; the RNG state is restored for the recompute (the models
    have no dropout, so the recompute is bitwise the forward either way)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(fn, x, use_reentrant=False)


def enable_activation_checkpointing(model: nn.Module, fn: Callable | None = None) -> nn.Module:
    """Recompute every decoder layer's activations in backward (``train.activation_checkpointing``):
    a layer keeps only its input through the forward, and its backward runs its forward again
    first. The losses and gradients are those of the plain run; memory per layer and micro-batch
    in flight drops from its whole activations to its input, at the cost of one more forward
    (``cost.RECOMPUTE_FACTOR``).

    ``model``: a :class:`StageModule` (our decoder, or a Hugging Face model's pieces; ``fn``
    defaults to :func:`torch_checkpoint`, e.g. DeepSpeed's ``non_reentrant_checkpoint``
    instead), or a reference model with its own switch (``enable_activation_checkpointing()``:
    transformers' ``gradient_checkpointing_enable``). Returns ``model``."""
    if isinstance(model, StageModule):
        model.recompute = fn or torch_checkpoint
        return model
    own = getattr(model, "enable_activation_checkpointing", None)
    if own is None or fn is not None:
        raise TypeError(f"activation checkpointing: {type(model).__name__} is neither a "
                        f"StageModule nor a model with its own enable_activation_checkpointing()")
    own()
    return model


_INIT_FNS = ("uniform_", "normal_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
             "xavier_uniform_", "xavier_normal_", "constant_", "ones_", "zeros_")


@contextmanager
def on_meta() -> Iterator[None]:
    """Build modules on the meta device with ``torch.nn.init``'s fills as no-ops (what
    transformers' ``no_init_weights`` does): a meta tensor holds no values, yet torch's layers
    still run ``reset_parameters``, and ``normal_`` on a meta tensor goes through
    ``torch._refs``, whose first call imports ``torch._dynamo`` (seconds of start-up in every
    process that reads a model's shapes). Module construction happens on the main thread only."""
    saved = {n: getattr(torch.nn.init, n) for n in _INIT_FNS if hasattr(torch.nn.init, n)}
    try:
        for n in saved:
            setattr(torch.nn.init, n, lambda t, *a, **k: t)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)


def param_table(cfg):
    """The whole model's :class:`~malleus_ds.layout.ParamTable` (global name, full shape, TP
    split dim, owner), read off pieces built on the meta device (no memory, no init). Every
    decoder layer has the parameters of layer 0 (true of the Llama family)."""
    from ..layout import ParamSpec, ParamTable

    with on_meta():
        emb, blk, head = [cfg.build_layer(i, 0, init=False) for i in (EMBED, 0, HEAD)]
    plan = cfg.tp_plan
    specs = [ParamSpec(f"embed.{n}", tuple(p.shape), None, EMBED) for n, p in emb.named_parameters()]
    block = [(n, tuple(p.shape), plan.get(n)) for n, p in blk.named_parameters()]
    for layer in range(cfg.num_layers):
        specs += [ParamSpec(f"blocks.{layer}.{n}", s, d, layer) for n, s, d in block]
    specs += [ParamSpec(f"head.{n}", tuple(p.shape), None, HEAD) for n, p in head.named_parameters()]
    return ParamTable(tuple(specs))


def global_state_dict(model) -> dict:
    """A reference model's weights by global parameter name (both names of a tied pair)."""
    fn = getattr(model, "global_state_dict", None)
    return fn() if fn is not None else model.state_dict()


def global_named_parameters(model) -> list:
    """``(global name, parameter)`` of a reference model, each parameter once."""
    fn = getattr(model, "global_named_parameters", None)
    return fn() if fn is not None else list(model.named_parameters())


def head_layer_units(table, seq_len: int, hidden_size: int) -> float:
    """The output head's compute per token in decoder-layer units, for the cost model: the head's
    matmul weights over a layer's matmul weights plus its causal attention (``T·H`` multiply-adds
    per token for scores and weighted sum). 0.30 for the tiny test models, 0.60 for a 7B Llama
    (vocabulary 32k), 2.09 for Llama 3 8B (128k): the last stage's extra work."""
    block = sum(s.numel for s in table.owned(0) if len(s.shape) == 2)
    head = sum(s.numel for s in table.owned(HEAD) if len(s.shape) == 2)
    denom = block + seq_len * hidden_size
    return round(head / denom, 4) if denom > 0 else 0.0


def tied_params(cfg) -> tuple[tuple[str, str], ...]:
    """The model's tied pairs (embedding name, head name); () for models without ties."""
    fn = getattr(cfg, "tied_params", None)
    return tuple(fn()) if fn is not None else ()
