"""The run's ``device`` setting: which values it takes, and what ``auto`` becomes here.

``check_device`` runs in ``config.build_run_config`` on every rank (so ``device=cuda`` on a
machine without a visible GPU fails at start-up, with the way out); ``resolve_device`` is what
:meth:`malleus_ds.app.runners.base.DistEnv.from_environ` binds a rank to. torch is imported lazily:
the check stays cheap for ``cpu`` and ``auto``.
"""
from __future__ import annotations

from typing import Any

#: ``device`` values (conf/config.yaml)
DEVICES = ("auto", "cpu", "cuda")


class DeviceError(ValueError):
    """A ``device`` value that is unknown, or that names a device this machine lacks."""


def check_device(v: Any) -> str:
    """``device``: one of :data:`DEVICES`; ``cuda`` only where a CUDA GPU is visible."""
    device = str(v)
    if device not in DEVICES:
        raise DeviceError(f"device={device!r} must be one of auto, cpu, cuda")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise DeviceError("device=cuda but no CUDA GPU is visible (torch.cuda.is_available() "
                              "is False); use device=cpu or device=auto")
    return device


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` where a CUDA GPU is visible, else ``cpu``; other values as given."""
    if device == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    return device
