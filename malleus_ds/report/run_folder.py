"""Run folders on disk: where they are (:func:`find_runs`: the folders holding a
``metrics.jsonl``, which ``metrics.py`` reads) and the Hydra overrides a run was started with
(:func:`read_overrides`, ``.hydra/overrides.yaml``).

``malleus-plot`` and ``launch/summarize.py`` find runs the same way; the plot labels a
multirun's jobs by their overrides and summarize prints them next to each run.
"""
from __future__ import annotations

import re
from pathlib import Path

from .metrics import METRICS_FILE

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"


def _natural_key(p: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p.as_posix())]


def find_runs(root: str | Path) -> list[Path]:
    """The run folders at or below ``root``: ``root`` itself when it holds metrics.jsonl, else
    every folder below it that does, at any depth (a ``--multirun`` sweep's jobs ``0/``, ``1/``,
    ...; a compare run's ``deepspeed/`` and ``malleus/``; a sweep of compare runs, two deep), in
    natural order (``0, 1, 2, ..., 10``, names alphabetically). ``[]`` when there is none or
    ``root`` is no folder: each tool words that its own way."""
    root = Path(root)
    if (root / METRICS_FILE).is_file():
        return [root]
    if not root.is_dir():
        return []
    return sorted((p.parent for p in root.rglob(METRICS_FILE) if p.is_file()),
                  key=lambda d: _natural_key(d.relative_to(root)))


def read_overrides(run_dir: str | Path) -> list[str] | None:
    """``<run>/.hydra/overrides.yaml``: the overrides as written (``key=value``, ``+key=value``,
    ``~key``), in order; ``[]`` for an empty file; None when there is no such file or it is not
    a YAML list (an unreadable label source only loses the label)."""
    p = Path(run_dir) / OVERRIDES_FILE
    if not p.is_file():
        return None
    try:
        import yaml

        v = yaml.safe_load(p.read_text())
    except Exception:  # noqa: BLE001 - an unreadable label source only loses the label
        return None
    if v is None:
        return []
    if not isinstance(v, list):
        return None
    return [str(x) for x in v]
