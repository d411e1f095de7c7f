"""Hugging Face Llama-family models (Llama, Mistral, Qwen2) behind our model interface.

``HFModel`` implements ``malleus_ds/models/base.py`` with transformers' own modules, so a stage
runs exactly the code ``AutoModelForCausalLM`` runs:

* embedding piece ``embed.embed_tokens`` (``nn.Embedding`` with the config's ``pad_token_id``),
  decoder layer ``l`` = transformers' ``<Family>DecoderLayer(config, l)`` (global names
  ``blocks.<l>.self_attn.q_proj.weight`` ...), head piece ``head.norm`` + ``head.lm_head``;
  :func:`hf_name` maps them to the checkpoint names (``model.layers.<l>...``, ``lm_head.weight``);
* each stage computes the rotary tables once per forward (``<Family>RotaryEmbedding``) and passes
  ``position_embeddings`` to its layers; only hidden states travel between stages. Attention is
  transformers' SDPA path with no mask (causal), which is what the whole model does without
  padding;
* TP (``tp_plan``): q/k/v and gate/up are column-parallel (q/k/v biases split with them), o/down
  row-parallel, as transformers' ``base_model_tp_plan``; grouped-query attention splits whole KV
  heads, so TP must divide ``num_key_value_heads`` too;
* tied embeddings (``tie_word_embeddings``, e.g. Qwen2-0.5B): the head's ``lm_head.weight`` is a
  copy of the embedding that the engines keep equal (``malleus_ds/engine/tied.py``).

Weights: ``init`` draws them deterministically from ``(seed, layer id)`` like transformers'
``_init_weights`` (normal(0, initializer_range), zero biases, unit norms, a zero padding row), or
reads them from a local folder (``path``: ``config.json`` + ``*.safetensors``); a rank opens only
the tensors of the pieces it builds. :meth:`HFModel.build_reference` is transformers' own
``<Family>ForCausalLM`` with the same weights: the one-process reference every engine equals.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..interop.names import global_name, hf_name  # noqa: F401  (models.hf.hf_name: callers)
from .base import EMBED, HEAD, TPError, check_tp_divides, lm_loss, on_meta
from .llama import _layer_seed        # the same per-layer seeding as our decoder

#: model_type -> class-name prefix in transformers (``LlamaDecoderLayer`` ...).
FAMILIES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2"}

_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
             rms_norm_eps=1e-5, tie_word_embeddings=False)

#: ``model.hf_config=<name>``: small configs that run on CPU (random init, nothing downloaded).
#: Any other value is a path to a ``config.json``.
HF_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-llama": dict(_TINY, model_type="llama"),
    "tiny-qwen2": dict(_TINY, model_type="qwen2", num_key_value_heads=2),   # GQA + q/k/v biases
    "tiny-qwen2-tied": dict(_TINY, model_type="qwen2", num_key_value_heads=2,
                            tie_word_embeddings=True),
    "tiny-mistral": dict(_TINY, model_type="mistral", num_key_value_heads=2, sliding_window=None),
    "small-llama": dict(_TINY, model_type="llama", hidden_size=256, intermediate_size=688,
                        num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                        max_position_embeddings=128),
}


#: ``model.max_seq_len`` when not set: the config's ``max_position_embeddings``, but at most this
#: (as transformers' ``run_clm.py`` caps its default block size): a Llama 3 folder says 131072,
#: and samples that long would make the first step of a run that set nothing take hours.
DEFAULT_MAX_SEQ_LEN = 2048


class HFError(ValueError):
    """A Hugging Face config or folder this adapter cannot train."""


def _modeling(model_type: str):
    import importlib

    return importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")


class HFEmbed(nn.Module):
    def __init__(self, config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(tokens)                      # (B, T) -> (B, T, H)


class HFHead(nn.Module):
    def __init__(self, config, norm_cls) -> None:
        super().__init__()
        self.norm = norm_cls(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.norm(x))                     # (B, T, H) -> (B, T, V)


class HFCausalLM(nn.Module):
    """transformers' ``<Family>ForCausalLM`` as ``tokens -> logits`` (the reference model)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=tokens, use_cache=False).logits

    def enable_activation_checkpointing(self) -> None:
        """transformers' own switch (``models.base.enable_activation_checkpointing``): each
        decoder layer through ``torch.utils.checkpoint`` without re-entrance, as our stages do.
        It acts in training mode only, which a reference model is in (``nn.Module``'s default)."""
        self.model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The weights by our global names (both names of a tied pair)."""
        sd = self.model.state_dict()
        out = {global_name(k): v for k, v in sd.items()}
        if "head.lm_head.weight" not in out:              # tied: transformers keeps one
            out["head.lm_head.weight"] = out["embed.embed_tokens.weight"]
        return out

    def global_named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """``(global name, parameter)``, each parameter once (a tied one under its embedding
        name)."""
        return [(global_name(n), p) for n, p in self.model.named_parameters()]


class HFModel:
    """A Hugging Face Llama-family model as a malleus_ds model (``malleus_ds/models/base.py``).

    ``config``: a transformers config; ``name``: how runs record it (a preset name or the config
    path); ``path``: a local folder whose safetensors weights replace the random init;
    ``max_seq_len``: the longest sample (default ``max_position_embeddings``, at most
    :data:`DEFAULT_MAX_SEQ_LEN`)."""

    family = "hf"

    def __init__(self, config, name: str = "hf", path: str | None = None,
                 max_seq_len: int | None = None) -> None:
        src = f"model.hf_path={path}" if path is not None else f"model.hf_config={name}"
        mt = getattr(config, "model_type", None)
        if mt not in FAMILIES:
            raise HFError(f"{src}: model_type={mt!r} is not supported; supported: "
                          f"{sorted(FAMILIES)} (Llama-family decoders)")
        if path is not None:
            check_safetensors_only(Path(path))
        if float(getattr(config, "attention_dropout", 0.0) or 0.0) != 0.0:
            raise HFError(f"{src}: attention_dropout={config.attention_dropout} must be "
                          f"0 (dropout would make every layout's math differ)")
        config.use_cache = False
        config._attn_implementation = "sdpa"
        self.hf_config, self.name, self.path = config, name, path
        self.model_type = mt
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(getattr(config, "num_key_value_heads", None) or self.num_heads)
        self.vocab_size = int(config.vocab_size)
        self.ffn = int(config.intermediate_size)
        ctx = int(config.max_position_embeddings)
        self.max_seq_len = int(max_seq_len or min(ctx, DEFAULT_MAX_SEQ_LEN))
        #: said at start-up when the default cut the config's context (Llama 3: 131072)
        self.seq_len_note = (f"model.max_seq_len={self.max_seq_len} (the default; the config "
                             f"allows {ctx}: set model.max_seq_len to train longer samples)"
                             if not max_seq_len and ctx > DEFAULT_MAX_SEQ_LEN else None)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if self.max_seq_len > int(config.max_position_embeddings):
            raise HFError(f"model.max_seq_len={self.max_seq_len} > the config's "
                          f"max_position_embeddings={config.max_position_embeddings}")
        window = getattr(config, "sliding_window", None)
        if window is not None and _uses_sliding(config) and window < self.max_seq_len:
            raise HFError(f"{src}: sliding_window={window} < max_seq_len="
                          f"{self.max_seq_len}; sliding-window attention is not supported: set "
                          f"model.max_seq_len <= {window}")
        mod = _modeling(mt)
        pre = FAMILIES[mt]
        self._layer_cls = getattr(mod, f"{pre}DecoderLayer")
        self._norm_cls = getattr(mod, f"{pre}RMSNorm")
        self._rotary_cls = getattr(mod, f"{pre}RotaryEmbedding")
        self._lm_cls = getattr(mod, f"{pre}ForCausalLM")
        self._rotary: dict[str, nn.Module] = {}
        self._index: dict[str, str] | None = None
        #: what this process read of ``path`` so far (the app's start-up line reports it)
        self.load_stats = {"tensors": 0, "bytes": 0, "files": set(), "of_files": 0, "seconds": 0.0}
        with on_meta():
            attn = self._layer_cls(config, 0)
        self._biases = {n for n, _ in attn.named_parameters() if n.endswith(".bias")}

    # ---- identity -------------------------------------------------------------------------

    def __repr__(self) -> str:
        return (f"HFModel({self.name!r}, {self.model_type}, layers={self.num_layers}, "
                f"hidden={self.hidden_size}, heads={self.num_heads}/{self.num_kv_heads} kv, "
                f"vocab={self.vocab_size}, tied={self.tied})")

    def describe(self) -> dict:
        return {"family": "hf", "name": self.name, "hf_path": self.path,
                "max_seq_len": self.max_seq_len, "config": self.hf_config.to_diff_dict()}

    def num_params(self) -> int:
        from .base import param_table
        return sum(s.numel for s in param_table(self)) - (
            self.vocab_size * self.hidden_size if self.tied else 0)

    # ---- the model interface ---------------------------------------------------------------

    @property
    def tp_plan(self) -> dict[str, int]:
        plan = {"self_attn.q_proj.weight": 0, "self_attn.k_proj.weight": 0,
                "self_attn.v_proj.weight": 0, "self_attn.o_proj.weight": 1,
                "mlp.gate_proj.weight": 0, "mlp.up_proj.weight": 0, "mlp.down_proj.weight": 1}
        for b in ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias",
                  "mlp.gate_proj.bias", "mlp.up_proj.bias"):
            if b in self._biases:
                plan[b] = 0
        return plan

    @staticmethod
    def tp_regions(block: nn.Module) -> tuple[nn.Module, ...]:
        return (block.self_attn, block.mlp)

    def check_tp(self, tp_size: int, where: str = "") -> None:
        check_tp_divides(tp_size, where, (
            ("num_attention_heads", self.num_heads, "TP splits whole num_attention_heads, "),
            ("num_key_value_heads", self.num_kv_heads, "TP splits whole KV heads, "),
            ("intermediate_size", self.ffn, "TP splits whole intermediate_size, ")))
        pre = f"{where}: " if where else ""
        rowbias = sorted(self._biases & {"self_attn.o_proj.bias", "mlp.down_proj.bias"})
        if tp_size > 1 and rowbias:
            raise TPError(f"{pre}TP size {tp_size}: the model has biases on row-parallel "
                          f"projections ({', '.join(rowbias)}: attention_bias / mlp_bias); only "
                          f"TP=1 is supported for it")

    def tied_params(self) -> tuple[tuple[str, str], ...]:
        return (("embed.embed_tokens.weight", "head.lm_head.weight"),) if self.tied else ()

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return lm_loss(logits, targets)

    def build_layer(self, layer_id: int, seed: int, init: bool = True) -> nn.Module:
        c = self.hf_config
        if layer_id == EMBED:
            mod: nn.Module = HFEmbed(c)
            prefix = "embed."
        elif layer_id == HEAD:
            mod = HFHead(c, self._norm_cls)
            prefix = "head."
        elif 0 <= layer_id < self.num_layers:
            mod = self._layer_cls(c, layer_id)
            prefix = f"blocks.{layer_id}."
        else:
            raise ValueError(f"layer {layer_id} outside 0..{self.num_layers - 1}")
        if init:
            if self.path is not None:
                self._load(mod, prefix)
            else:
                self._init(mod, seed, layer_id)
        return mod

    def block_context(self, x: torch.Tensor):
        """``(cos, sin)`` of positions ``0..T-1`` (once per stage forward)."""
        key = str(x.device)
        rot = self._rotary.get(key)
        if rot is None:
            with torch.device("cpu"):
                rot = self._rotary_cls(config=self.hf_config)
            rot = self._rotary[key] = rot.to(x.device)
        pos = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        return rot(x, pos)

    @staticmethod
    def run_block(block: nn.Module, x: torch.Tensor, ctx) -> torch.Tensor:
        out = block(x, attention_mask=None, position_embeddings=ctx)
        return out[0] if isinstance(out, tuple) else out

    # ---- weights ----------------------------------------------------------------------------

    @torch.no_grad()
    def _init(self, mod: nn.Module, seed: int, layer_id: int) -> None:
        std = float(getattr(self.hf_config, "initializer_range", 0.02))
        if layer_id == HEAD and self.tied:
            emb = self.build_layer(EMBED, seed)          # the tied copy starts equal
            mod.lm_head.weight.copy_(emb.embed_tokens.weight)
            mod.norm.weight.fill_(1.0)
            return
        g = torch.Generator().manual_seed(_layer_seed(seed, layer_id))
        for name, p in mod.named_parameters():
            if name.endswith(".bias"):
                p.zero_()
            elif p.dim() == 1:                            # RMSNorm weights
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        if layer_id == EMBED and self.hf_config.pad_token_id is not None:
            mod.embed_tokens.weight[self.hf_config.pad_token_id].zero_()

    def _weights_index(self) -> dict[str, str]:
        """Checkpoint name -> safetensors file, from the folder's index (or its single file)."""
        if self._index is None:
            d = Path(self.path)
            idx = d / "model.safetensors.index.json"
            if idx.is_file():
                from ..files.safe_load import UnsafeFile, read_json

                try:
                    wm = read_json(idx, "safetensors index")["weight_map"]
                    self._index = {str(k): str(d / str(v)) for k, v in wm.items()}
                except (UnsafeFile, KeyError, TypeError, AttributeError) as e:
                    raise HFError(f"model.hf_path={self.path}: unreadable {idx.name} "
                                  f"({type(e).__name__}: {e})") from None
            else:
                files = sorted(d.glob("*.safetensors"))
                if not files:
                    raise HFError(f"model.hf_path={self.path}: no *.safetensors files (and no "
                                  f"model.safetensors.index.json)")
                from safetensors import safe_open
                self._index = {}
                for f in files:
                    with safe_open(str(f), "pt") as fh:
                        self._index.update({k: str(f) for k in fh.keys()})
        return self._index

    @torch.no_grad()
    def _load(self, mod: nn.Module, prefix: str) -> None:
        from safetensors import safe_open

        index = self._weights_index()
        wanted: dict[str, list[tuple[str, nn.Parameter]]] = {}
        for n, p in mod.named_parameters():
            key = hf_name(prefix + n)
            if key not in index and key == "lm_head.weight" and self.tied:
                key = "model.embed_tokens.weight"
            if key not in index:
                raise HFError(f"model.hf_path={self.path}: no tensor {key!r} in its safetensors "
                              f"files (needed for {prefix + n})")
            wanted.setdefault(index[key], []).append((key, p))
        st, t0 = self.load_stats, time.perf_counter()
        st["of_files"] = len(set(index.values()))
        for f, items in wanted.items():              # only the files this piece needs
            with safe_open(f, "pt") as fh:
                for key, p in items:
                    t = fh.get_tensor(key)
                    if tuple(t.shape) != tuple(p.shape):
                        raise HFError(f"model.hf_path={self.path}: {key} has shape "
                                      f"{tuple(t.shape)}, the config says {tuple(p.shape)}")
                    p.copy_(t.to(p.dtype))
                    st["tensors"] += 1
                    st["bytes"] += t.numel() * t.element_size()
            st["files"].add(f)
        st["seconds"] += time.perf_counter() - t0

    def build_reference(self, seed: int) -> HFCausalLM:
        """transformers' ``<Family>ForCausalLM`` with exactly the weights our pieces get."""
        from .base import StageModule

        full = StageModule(self, 0, self.num_layers, seed)
        lm = self._lm_cls(self.hf_config)
        sd = {hf_name(n): p.detach() for n, p in full.named_parameters()}
        missing, unexpected = lm.load_state_dict(sd, strict=False)
        bad = [k for k in missing if not (self.tied and k == "lm_head.weight")]
        if bad or unexpected:
            raise HFError(f"{self.name}: weights do not match {type(lm).__name__}: missing "
                          f"{bad[:4]}, unexpected {list(unexpected)[:4]}")
        if self.tied:
            lm.tie_weights()
        return HFCausalLM(lm)


def _uses_sliding(config) -> bool:
    types = getattr(config, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    if getattr(config, "use_sliding_window", None) is False:
        return False
    return True


def check_safetensors_only(d: Path) -> None:
    """Weights are read from safetensors only: a pickled ``pytorch_model*.bin`` can run code when
    loaded, so a folder that has nothing else is refused with the way to convert it."""
    if (d / "model.safetensors.index.json").is_file() or any(d.glob("*.safetensors")):
        return
    bins = sorted(p.name for p in d.glob("*.bin")) + sorted(p.name for p in d.glob("*.pt"))
    if bins:
        raise HFError(
            f"model.hf_path={d}: only pickled weights ({', '.join(bins[:3])}"
            f"{', ...' if len(bins) > 3 else ''}), no *.safetensors: malleus_ds reads "
            f"safetensors only, because loading a pickle can run code. Convert the folder once, "
            f"where you trust the file: python -c \"from transformers import AutoModelForCausalLM "
            f"as M; M.from_pretrained('{d}', torch_dtype='auto').save_pretrained('{d}-st', "
            f"safe_serialization=True)\" (then copy the tokenizer files), or download the "
            f"model's safetensors files")
    raise HFError(f"model.hf_path={d}: no *.safetensors files (and no "
                  f"model.safetensors.index.json)")


def load_hf_model(hf_config: str | None = None, hf_path: str | None = None,
                  max_seq_len: int | None = None, **overrides) -> HFModel:
    """``model=hf``: a preset name or config.json path (random init), or a local folder with
    config.json + safetensors (weights loaded). ``overrides``: config fields (e.g.
    ``num_hidden_layers``) applied on top."""
    from transformers import AutoConfig

    if hf_config is not None and hf_path is not None:
        raise HFError(f"model.hf_config={hf_config} and model.hf_path={hf_path} are both set: "
                      f"for a local folder use model=hf_local model.hf_path={hf_path}")
    if hf_config is None and hf_path is None:
        raise HFError(f"model=hf needs model.hf_config=<preset or config.json> (random init; "
                      f"presets: {sorted(HF_PRESETS)}), or use model=hf_local "
                      f"model.hf_path=<local folder>")
    if hf_path is not None:
        d = Path(hf_path)
        if not (d / "config.json").is_file():
            raise HFError(f"model.hf_path={hf_path}: no config.json there (a local Hugging Face "
                          f"model folder: config.json + *.safetensors)")
        config = AutoConfig.from_pretrained(str(d), local_files_only=True)
        name, path = str(d), str(d)
    elif hf_config in HF_PRESETS:
        d = dict(HF_PRESETS[hf_config])
        config = AutoConfig.for_model(d.pop("model_type"), **d)
        name, path = hf_config, None
    else:
        f = Path(str(hf_config))
        if not f.is_file():
            raise HFError(f"model.hf_config={hf_config!r} is neither a preset "
                          f"({sorted(HF_PRESETS)}) nor a config.json file")
        from ..files.safe_load import UnsafeFile, read_json

        try:
            raw = read_json(f, "config.json")
        except UnsafeFile as e:
            raise HFError(f"model.hf_config: {e}") from None
        if not isinstance(raw, dict):
            raise HFError(f"model.hf_config={hf_config}: not a JSON object")
        mt = raw.pop("model_type", None)
        if mt not in FAMILIES:
            raise HFError(f"model.hf_config={hf_config}: model_type={mt!r} is not supported; "
                          f"supported: {sorted(FAMILIES)}")
        config = AutoConfig.for_model(mt, **raw)
        name, path = str(f), None
    for k, v in overrides.items():
        if v is None:
            continue
        if not hasattr(config, k):
            raise HFError(f"model.{k}: the {config.model_type} config has no field {k!r}")
        setattr(config, k, v)
    types = getattr(config, "layer_types", None)
    if overrides.get("num_hidden_layers") is not None and types:     # keep the first N layers
        n = int(config.num_hidden_layers)
        config.layer_types = list(types[:n]) + [types[-1]] * max(0, n - len(types))
    return HFModel(config, name=name, path=path, max_seq_len=max_seq_len)

