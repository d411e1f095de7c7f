"""A LLaMA-style decoder (RMSNorm, rotary attention, SwiGLU) as embedding + N blocks + head.

The model knows nothing about parallelism. Every piece is built and initialised on its own from
``(seed, global layer index)``, so any rank can build exactly the layers its stage holds and get
the same weights as a single-process run. Tensor parallelism is applied afterwards by slicing
weights (see ``malleus_ds.engine.tensor_parallel``): attention derives its local head count from
its weight shapes, so a column-sharded block runs unchanged.

Shapes: B = micro-batch, T = sequence length, H = hidden, nh = heads, hd = H / nh, F = FFN hidden.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from .base import EMBED, HEAD, StageModule, TPError, check_tp_divides, lm_loss, param_table

__all__ = ["EMBED", "HEAD", "PRESETS", "TP_PLAN", "Block", "Embedding", "Head", "ModelConfig",
           "StageModule", "TPError", "build_layer", "build_model", "lm_loss", "model_config",
           "param_table"]


@dataclass(frozen=True)
class ModelConfig:
    """Decoder hyper-parameters (all sizes in elements, not bytes)."""

    name: str = "tiny"
    vocab_size: int = 256          # byte-level tokens
    hidden_size: int = 64
    num_heads: int = 4
    num_layers: int = 4
    ffn_hidden_size: int = 0       # 0 -> LLaMA rule: 2/3 * 4H rounded up to a multiple of 8
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f in ("vocab_size", "hidden_size", "num_heads", "num_layers", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"model.{f}={v!r} must be a positive integer")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}")
        if (self.hidden_size // self.num_heads) % 2:
            raise ValueError(f"model head dim {self.hidden_size // self.num_heads} must be even "
                             f"for rotary embeddings (hidden_size / num_heads)")
        if self.ffn_hidden_size < 0:
            raise ValueError(f"model.ffn_hidden_size={self.ffn_hidden_size} must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def ffn(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        f = int(2 * 4 * self.hidden_size / 3)
        return 8 * math.ceil(f / 8)

    def params_per_layer(self) -> int:
        h = self.hidden_size
        return 4 * h * h + 3 * h * self.ffn + 2 * h

    def num_params(self) -> int:
        return (self.num_layers * self.params_per_layer()
                + 2 * self.vocab_size * self.hidden_size + self.hidden_size)

    # ---- the model interface (malleus_ds/models/base.py) ----

    family = "malleus"

    @property
    def tp_plan(self) -> dict[str, int]:
        return TP_PLAN

    def build_layer(self, layer_id: int, seed: int, init: bool = True) -> nn.Module:
        return build_layer(self, layer_id, seed, init)

    def block_context(self, x: torch.Tensor) -> None:
        return None             # each block computes its rotary tables itself

    @staticmethod
    def run_block(block: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
        return block(x)

    @staticmethod
    def tp_regions(block: nn.Module) -> tuple[nn.Module, ...]:
        return (block.attn, block.mlp)

    def check_tp(self, tp_size: int, where: str = "") -> None:
        """Raise ``TPError`` unless ``tp_size`` divides the heads and the FFN width."""
        check_tp_divides(tp_size, where, (("num_heads", self.num_heads, ""),
                                          ("FFN width ffn", self.ffn, "")))

    @staticmethod
    def tied_params() -> tuple:
        return ()

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def build_reference(self, seed: int) -> StageModule:
        """The whole model on one process (the reference)."""
        return StageModule(self, 0, self.num_layers, seed)

    def describe(self) -> dict:
        from dataclasses import asdict
        return asdict(self)


#: Presets. tiny/small run on CPU in tests; 7b/13b/70b are for planning and GPU runs.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig("tiny", hidden_size=64, num_heads=4, num_layers=4, max_seq_len=64),
    "small": ModelConfig("small", hidden_size=256, num_heads=8, num_layers=8, max_seq_len=128),
    "medium": ModelConfig("medium", hidden_size=512, num_heads=8, num_layers=16, max_seq_len=256),
    "7b": ModelConfig("7b", vocab_size=32000, hidden_size=4096, num_heads=32, num_layers=32,
                      ffn_hidden_size=11008, max_seq_len=4096),
    "13b": ModelConfig("13b", vocab_size=32000, hidden_size=5120, num_heads=40, num_layers=40,
                       ffn_hidden_size=13824, max_seq_len=4096),
    "70b": ModelConfig("70b", vocab_size=32000, hidden_size=8192, num_heads=64, num_layers=80,
                       ffn_hidden_size=28672, max_seq_len=4096),
}


def model_config(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"model={name!r} is not a known model size; choose one of "
                         f"{sorted(PRESETS)}")
    return replace(PRESETS[name], **{k: v for k, v in overrides.items() if v is not None})


# ----------------------------------------------------------------------------------------------
# building blocks
# ----------------------------------------------------------------------------------------------


#: The TP plan of a block (torchtitan's ``apply_tp`` / HF's ``base_model_tp_plan``): parameter name
#: inside a block -> the dim TP splits (absent: replicated). Column-parallel (out, in) weights split
#: dim 0 (attention by whole heads), row-parallel ones dim 1.
TP_PLAN: dict[str, int] = {
    "attn.wq.weight": 0, "attn.wk.weight": 0, "attn.wv.weight": 0, "attn.wo.weight": 1,
    "mlp.w_gate.weight": 0, "mlp.w_up.weight": 0, "mlp.w_down.weight": 1,
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in fp32 and cast back, as Meta's LLaMA does (``_norm(x.float()).type_as(x)``):
        # under fp16 the backward of rsqrt (~ rms^-3) overflows for small hidden states; in fp32
        # training both casts are no-ops, so the arithmetic is unchanged
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary_tables(seq_len: int, head_dim: int, theta: float, device=None):
    """cos, sin of shape (T, hd/2)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    freqs = torch.outer(t, inv)
    return freqs.cos(), freqs.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hd); rotate pairs (x[2i], x[2i+1])
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = cos.to(x.dtype), sin.to(x.dtype)
    out = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.head_dim = cfg.head_dim
        self.rope_theta = cfg.rope_theta
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, h, bias=False)
        self.wv = nn.Linear(h, h, bias=False)
        self.wo = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.wq(x), self.wk(x), self.wv(x)          # (B, T, nh_local*hd)
        nh = q.shape[-1] // self.head_dim                     # local heads (fewer under TP)
        q, k, v = (t.view(B, T, nh, self.head_dim).transpose(1, 2) for t in (q, k, v))
        cos, sin = rotary_tables(T, self.head_dim, self.rope_theta, x.device)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, nh * self.head_dim)
        return self.wo(y)                                     # (B, T, H) (partial sum under TP)


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.ffn
        self.w_gate = nn.Linear(h, f, bias=False)
        self.w_up = nn.Linear(h, f, bias=False)
        self.w_down = nn.Linear(f, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """One decoder layer: pre-norm attention and pre-norm SwiGLU, both residual."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Embedding(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.tok(tokens)                               # (B, T) -> (B, T, H)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))                         # (B, T, H) -> (B, T, V)


# ----------------------------------------------------------------------------------------------
# deterministic per-layer construction
# ----------------------------------------------------------------------------------------------

def _layer_seed(seed: int, layer_id: int) -> int:
    return (seed * 1_000_003 + (layer_id + 7) * 7919) % (2**63 - 1)


@torch.no_grad()
def _init_module(mod: nn.Module, cfg: ModelConfig, seed: int, layer_id: int) -> None:
    g = torch.Generator().manual_seed(_layer_seed(seed, layer_id))
    # residual output projections get the GPT-2 style 1/sqrt(2L) scaling
    resid_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
    for name, p in mod.named_parameters():
        if name.endswith("norm.weight") or name == "norm.weight":
            p.fill_(1.0)
        else:
            std = resid_std if name.endswith(("wo.weight", "w_down.weight")) else cfg.init_std
            p.copy_(torch.randn(p.shape, generator=g) * std)


def build_layer(cfg: ModelConfig, layer_id: int, seed: int, init: bool = True) -> nn.Module:
    """Build one piece (``EMBED``, a block index, or ``HEAD``) with its deterministic init
    (``init=False``: skip it, for a stage whose weights arrive by migration)."""
    if layer_id == EMBED:
        mod: nn.Module = Embedding(cfg)
    elif layer_id == HEAD:
        mod = Head(cfg)
    elif 0 <= layer_id < cfg.num_layers:
        mod = Block(cfg)
    else:
        raise ValueError(f"layer {layer_id} outside 0..{cfg.num_layers - 1}")
    if init:
        _init_module(mod, cfg, seed, layer_id)
    return mod


def build_model(cfg, seed: int):
    """The whole model on one process (the reference for every equivalence test): our decoder
    as a ``StageModule``; a Hugging Face model as transformers' own ``*ForCausalLM``."""
    return cfg.build_reference(seed)
