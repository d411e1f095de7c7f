"""The ``malleus`` section of a ds_config, as the data-parallel engine reads it.

MalleusDPEngine reads four keys of the section (the rest lay out MalleusEngine's pipelines and
are refused here, naming them):

* ``straggler``: the straggler emulation (a schedule of ``{rank, rate, start_step, end_step}``
  entries, or ``{schedule: [...], method: sleep|quota|compete}``; ``emulation/straggler.py``),
  applied through the rank's compute clock;
* ``adaptive``: re-split each step's batch by measured speed (default true; false keeps the
  split where ``set_split`` puts it);
* ``detect``: when measured rates move enough to re-split (``DetectConfig``: ``window``,
  ``healthy``, ``change``, ``confirm``, ``cooldown``, ``every``);
* ``metrics_dir``: a folder where rank 0 writes ``metrics.jsonl``, a line per optimizer step
  and one per re-split, which ``launch/summarize.py``, ``malleus-plot`` and the what-if read
  (default: none).

Pure parsing, no process group: every rank raises the same error before any collective.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..interop.malleus_section import AdaptiveSettings, DetectConfig

#: the section's keys the data-parallel engine reads
DP_KEYS = ("straggler", "adaptive", "detect", "metrics_dir")


@dataclass(frozen=True)
class DPSettings:
    """The data-parallel engine's keys of the ``malleus`` section; a field's default is the
    key's."""

    straggler: tuple = ()       # the schedule's entries (emulation.RawSchedule: .method); none
    adaptive: bool = True       # re-split by measured speed
    detect: DetectConfig = field(default_factory=DetectConfig)
    metrics_dir: str | None = None  # rank 0 writes metrics.jsonl here; none

    @staticmethod
    def from_config(sec: Mapping[str, Any] | None,
                    where: str = "ds_config.malleus") -> "DPSettings":
        """Parse and check ``sec``; ValueError naming ``<where>.<key>`` and the value."""
        from ..emulation.straggler import StragglerSchedule
        from ..engine.settings import parse_straggler

        if sec is not None and not isinstance(sec, Mapping):
            raise ValueError(f"{where} must be a mapping, got {sec!r}")
        sec = dict(sec or {})
        other = sorted(set(sec) - set(DP_KEYS))
        if other:
            raise ValueError(f"{where}: {', '.join(other)} not read by the data-parallel engine "
                             f"(MalleusDPEngine, for a torch.nn.Module); it reads "
                             f"{', '.join(DP_KEYS)}. Plans, switches and the planner's settings "
                             f"are MalleusEngine's (a ModelConfig / HFModel / StageModule)")
        loop = AdaptiveSettings.from_config({k: sec[k] for k in ("adaptive", "detect")
                                             if k in sec}, where)
        straggler = parse_straggler(sec.get("straggler"), f"{where}.straggler")
        StragglerSchedule.parse(straggler)      # the entries, checked here (the ranks: later)
        metrics = sec.get("metrics_dir")
        if metrics is not None and (not isinstance(metrics, str) or not metrics):
            raise ValueError(f"{where}.metrics_dir={metrics!r} must be a folder's path")
        return DPSettings(straggler=straggler, adaptive=loop.enabled, detect=loop.detect,
                          metrics_dir=metrics)


def split_config(config: Mapping[str, Any]) -> tuple[dict, DPSettings]:
    """``config`` (a ds_config dict) without its ``malleus`` section, for DeepSpeed, and the
    section parsed."""
    cfg = dict(config)
    return cfg, DPSettings.from_config(cfg.pop("malleus", None))
