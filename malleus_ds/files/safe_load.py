"""Files we read are data, never code (bottom layer: no torch.distributed, no app imports).

A checkpoint gets copied between clusters, shared and downloaded. ``torch.load`` with
weights_only turned off unpickles whatever the file names -- a pickled object can run a shell
command while it loads -- so every ``.pt`` file malleus_ds reads goes through :func:`load_plain`
(``weights_only=True``: tensors, dicts, lists, tuples, strings, numbers and the few torch types
PyTorch allows), and everything it writes is checked by :func:`check_plain` first, so our own
files always load that way. JSON files (plans, problems, ds_configs, run records) go through
:func:`read_json`, which refuses a file too large to be what it claims before reading it.

Errors are :class:`UnsafeFile` (a ``ValueError``) with the file, what it is, and what to do;
callers wrap them into their own error type (CheckpointError, ExportError, ConfigError).
"""
from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path
from typing import Any

#: a JSON file larger than this is refused unread (plans, problems, ds_configs, run records
#: are kilobytes; a 1024-GPU plan is about 200 KB)
MAX_JSON_BYTES = 64 * 2**20
#: nesting deeper than this in a checkpoint's plain data is refused (ours is < 10 deep)
MAX_DEPTH = 64


class UnsafeFile(ValueError):
    """A file that is not the plain data it should be (or cannot be read as such)."""


_SCALARS = (str, int, float, bool, type(None))


def check_plain(obj: Any, where: str, _depth: int = 0) -> None:
    """Raise :class:`UnsafeFile` unless ``obj`` is plain data that ``torch.load(...,
    weights_only=True)`` reads back without naming any class or function: dicts (keys: strings,
    numbers or tuples of them), lists, tuples, strings, numbers, booleans, None, tensors,
    ``torch.Size``/``dtype``/``device``. ``where`` names the value in the message."""
    import torch

    if _depth > MAX_DEPTH:
        raise UnsafeFile(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(obj, _SCALARS) and type(obj) in _SCALARS:
        return
    if isinstance(obj, (torch.Tensor, torch.Size, torch.dtype, torch.device)):
        return
    if type(obj) in (dict,) or type(obj).__name__ == "OrderedDict":
        for k, v in obj.items():
            if not (type(k) in _SCALARS or (type(k) is tuple and all(type(x) in _SCALARS
                                                                    for x in k))):
                raise UnsafeFile(f"{where}: key {k!r} is a {_type_name(k)}; keys must be "
                                 f"strings, numbers or tuples of them")
            check_plain(v, f"{where}[{k!r}]", _depth + 1)
        return
    if type(obj) in (list, tuple):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]", _depth + 1)
        return
    raise UnsafeFile(f"{where} holds a {_type_name(obj)}: checkpoints hold plain data only "
                     f"(dicts, lists, strings, numbers, tensors), so that loading them never "
                     f"runs code; store it as such (e.g. a dict of numbers) instead")


def _type_name(obj: Any) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}" if t.__module__ != "builtins" else t.__qualname__


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def load_plain(path: str | Path, what: str = "checkpoint file", *, mmap: bool = True,
               map_location: Any = "cpu",
               writer: str = "malleus_ds writes only plain data") -> Any:
    """``torch.load(path, weights_only=True)``, with every way it can fail turned into an
    :class:`UnsafeFile` that names the file, says what is wrong with it and what to do."""
    p = Path(path)
    if not p.is_file():
        raise UnsafeFile(f"{p}: no such {what}")
    if mmap and not zipfile.is_zipfile(p):
        size = p.stat().st_size
        raise UnsafeFile(
            f"{p}: not a complete torch.save zip archive ({size} bytes): the {what} is truncated "
            f"or corrupted (an interrupted copy?), or it is another format such as a legacy "
            f"pickle; copy it again from its source, or use another checkpoint (tag)")
    return _load(p, p, what, writer, map_location=map_location, mmap=mmap)


def load_plain_bytes(data: bytes, path: str | Path, what: str,
                     writer: str = "malleus_ds writes only plain data") -> Any:
    """:func:`load_plain` for a ``torch.save`` image held in memory (a raw rank file's header);
    ``path`` names the file it came from in the messages."""
    import io

    return _load(io.BytesIO(data), Path(path), what, writer, map_location="cpu", mmap=False)


def _load(src, p: Path, what: str, writer: str, **kw) -> Any:
    import pickle

    import torch

    try:
        return torch.load(src, weights_only=True, **kw)
    except pickle.UnpicklingError as e:
        names = sorted(set(_GLOBAL.findall(str(e))))
        if not names and "Unsupported" not in str(e) and "weights_only" not in str(e).lower():
            raise UnsafeFile(f"{p}: cannot read this {what}: it is corrupted or truncated "
                             f"({str(e)[:200]}); copy it again from its source, or use another "
                             f"checkpoint (tag)") from None
        named = f"it names {', '.join(names)}, " if names else ""
        raise UnsafeFile(
            f"{p}: refused: this {what} is not plain data ({named}which unpickling would call). "
            f"malleus_ds loads with torch.load(weights_only=True) so that a file can never run "
            f"code, and {writer}: this file was altered or made by something else. Do not load "
            f"it with weights_only turned off unless you trust whoever made it; use another "
            f"checkpoint (tag) instead") from None
    except (RuntimeError, EOFError, OSError, zipfile.BadZipFile, KeyError, ValueError) as e:
        raise UnsafeFile(f"{p}: cannot read this {what}: it is corrupted or truncated "
                         f"({type(e).__name__}: {str(e)[:200]}); copy it again from its source, "
                         f"or use another checkpoint (tag)") from None


def read_text(path: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES) -> str:
    """A text file, refused unread (:class:`UnsafeFile`) when larger than ``max_bytes``: a
    10 GB file claiming to be a plan must not exhaust memory."""
    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError as e:
        raise UnsafeFile(f"{what} {p}: cannot read it ({e.strerror or e})") from None
    if size > max_bytes:
        shown = f"{size / 2**20:.1f} MiB" if size >= 2**20 else f"{size} bytes"
        limit = f"{max_bytes / 2**20:.0f} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
        raise UnsafeFile(f"{what} {p} is {shown}; refused unread (at most {limit}): it cannot "
                         f"be a {what}")
    try:
        return p.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UnsafeFile(f"{what} {p} cannot be read as text ({e})") from None


def read_small_text(path: str | Path, what: str, max_bytes: int = 4096) -> str:
    """A small text file (a ``latest`` tag name), at most ``max_bytes``."""
    return read_text(path, what, max_bytes)


def read_json(path: str | Path, what: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """A JSON file as plain data (:func:`read_text`, then ``json.loads``); :class:`UnsafeFile`
    when it is missing, too large or not JSON."""
    text = read_text(path, what, max_bytes)
    p = Path(path)
    try:
        return json.loads(text)
    except ValueError as e:
        raise UnsafeFile(f"{what} {p}: not valid JSON ({e})") from None
    except RecursionError:
        raise UnsafeFile(f"{what} {p}: nested too deeply to be a {what}") from None
