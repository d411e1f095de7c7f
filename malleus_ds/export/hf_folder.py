"""The Hugging Face folder an export writes: the model record checked, config.json rebuilt,
tensors renamed and checked against the transformers class, model.safetensors written."""
from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..files.fileio import atomic_write_path


PROG = "malleus-export"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: copied from a model=hf_local source folder when present (the tokenizer is not trained)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
              "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
              "chat_template.jinja", "chat_template.json", "generation_config.json")
#: weight files of an earlier export that ``force`` removes (they would shadow or mix with ours)
_STALE = ("model.safetensors.index.json", "model-*-of-*.safetensors", "pytorch_model*.bin",
          "pytorch_model.bin.index.json")


class ExportError(ValueError):
    """The checkpoint or the output folder cannot be exported to; the message names the path."""


@dataclass(frozen=True)
class Exported:
    """What one export wrote."""

    path: Path
    tensors: int
    parameters: int
    bytes: int
    dtype: str
    copied: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- model record


def _hf_record(model: Any, where: str) -> dict:
    """The run's model record, checked to be a Hugging Face model."""
    if not isinstance(model, Mapping):
        raise ExportError(f"{where}: no model record (run.json 'model' is {model!r})")
    if model.get("family") != "hf":
        raise ExportError(f"{where} holds malleus_ds's own decoder (model={model.get('name')!r}), "
                          f"not a Hugging Face model: malleus-export writes Hugging Face folders "
                          f"(config.json + safetensors) for runs with model=hf or model=hf_local")
    if not isinstance(model.get("config"), Mapping) or "model_type" not in model["config"]:
        raise ExportError(f"{where}: the model record has no transformers config with a "
                          f"model_type (run.json 'model.config')")
    return dict(model)


def build_config(record: Mapping, dtype: torch.dtype = torch.float32):
    """The transformers config of a model record (``HFModel.describe()``), for saving."""
    from transformers import AutoConfig

    from ..models.hf import FAMILIES

    raw = dict(record["config"])
    mt = raw.pop("model_type")
    if mt not in FAMILIES:
        raise ExportError(f"model_type={mt!r} is not one malleus_ds trains "
                          f"(supported: {sorted(FAMILIES)})")
    # the training adapter forces use_cache=False; the exported model gets transformers' default
    for k in ("transformers_version", "use_cache", "dtype", "torch_dtype", "architectures",
              "_name_or_path"):
        raw.pop(k, None)
    config = AutoConfig.for_model(mt, **raw)
    config.architectures = [f"{FAMILIES[mt]}ForCausalLM"]
    config.dtype = dtype
    return config


def is_tied(config) -> bool:
    return bool(getattr(config, "tie_word_embeddings", False))


def expected_tensors(config) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the folder must hold (``*ForCausalLM`` on the meta
    device; a tied model's ``lm_head.weight`` left out)."""
    import copy

    from ..models.base import on_meta
    from ..models.hf import FAMILIES, _modeling

    cls = getattr(_modeling(config.model_type), f"{FAMILIES[config.model_type]}ForCausalLM")
    with on_meta():
        lm = cls(copy.deepcopy(config))
    out = {k: tuple(v.shape) for k, v in lm.state_dict().items()}
    if is_tied(config):
        out.pop("lm_head.weight", None)
    return out


def hf_tensors(state: Mapping[str, torch.Tensor], config, where: str) -> dict[str, torch.Tensor]:
    """Full tensors by our global names -> by Hugging Face names, checked against the model the
    config describes (a tied model: ``lm_head.weight`` dropped, the embedding kept)."""
    from ..interop.names import hf_name

    want = expected_tensors(config)
    out = {}
    for name, t in state.items():
        try:
            key = hf_name(name)
        except KeyError:
            raise ExportError(f"{where}: parameter {name!r} is not a Llama-family parameter "
                              f"name") from None
        if key == "lm_head.weight" and is_tied(config):
            continue
        out[key] = t
    missing = sorted(set(want) - set(out))
    extra = sorted(set(out) - set(want))
    if missing or extra:
        raise ExportError(f"{where}: its tensors do not match the recorded {config.model_type} "
                          f"config: missing {missing[:4]}, unexpected {extra[:4]}")
    for k, shape in want.items():
        if tuple(out[k].shape) != shape:
            raise ExportError(f"{where}: {k} has shape {tuple(out[k].shape)}, the recorded config "
                              f"says {shape}")
    return out


# ----------------------------------------------------------------------------- writing


def _dtype(dtype: str | None) -> tuple[str, torch.dtype]:
    name = "fp32" if dtype is None else str(dtype)
    if name not in DTYPES:
        raise ExportError(f"dtype={dtype!r} must be one of {sorted(DTYPES)}")
    return name, DTYPES[name]


def check_out_dir(out_dir, force: bool = False) -> Path:
    """``out_dir`` if it may be written: absent, empty, or non-empty with ``force``."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ExportError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ExportError(f"output folder {out} exists and is not empty; choose another folder "
                          f"or pass --force (force=True) to overwrite its files")
    return out


def write_folder(out_dir, record: Mapping, state: Mapping[str, torch.Tensor], *, where: str,
                 dtype: str | None = None, force: bool = False) -> Exported:
    """Write ``state`` (full tensors by our global names) as a Hugging Face folder."""
    from safetensors.torch import save_file

    dname, dt = _dtype(dtype)
    config = build_config(record, dt)
    tensors = hf_tensors(state, config, where)
    out = check_out_dir(out_dir, force)
    out.mkdir(parents=True, exist_ok=True)
    if force:
        for pat in _STALE:
            for f in out.glob(pat):
                f.unlink()
    data = {k: tensors[k].detach().to("cpu", dt).contiguous() for k in sorted(tensors)}
    atomic_write_path(out / WEIGHTS_FILE, lambda p: save_file(data, str(p), metadata={"format": "pt"}))
    atomic_write_path(out / CONFIG_FILE, lambda p: config.to_json_file(str(p), use_diff=True))
    copied = []
    src = record.get("hf_path")
    if src and Path(src).is_dir() and Path(src).resolve() != out.resolve():
        for name in SIDE_FILES:
            f = Path(src) / name
            if f.is_file():
                shutil.copyfile(f, out / name)
                copied.append(name)
    return Exported(out, len(data), sum(t.numel() for t in data.values()),
                    (out / WEIGHTS_FILE).stat().st_size, dname, tuple(copied))


def _summary(res: Exported) -> str:
    extra = f"; copied {', '.join(res.copied)}" if res.copied else ""
    return (f"wrote {res.path}: {CONFIG_FILE} + {WEIGHTS_FILE}, {res.tensors} tensors, "
            f"{res.parameters:,} parameters, {res.bytes:,} bytes ({res.dtype}){extra}")
