"""A run folder on disk, beyond its ``metrics.jsonl`` (``metrics.py`` reads that): the Hydra
overrides the run was started with (``.hydra/overrides.yaml``).

``malleus-plot`` labels a multirun's jobs by them and ``launch/summarize.py`` prints them next
to each run.
"""
from __future__ import annotations

from pathlib import Path

OVERRIDES_FILE = Path(".hydra") / "overrides.yaml"


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
