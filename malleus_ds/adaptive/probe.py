"""When a rank probes, and within what budget (DESIGN.md §6, "Probes measure the device").

A rank without work probes every ``detect.probe_every`` steps so it can come back; so does a held
rank with slack (working under a plan made for it as slow: a light load that fits inside a
throughput cap must not read as a recovery), and the calibrating rank (``held.probe_reference``).
The probe itself is the engine's (``engine/probe_block.py``: one decoder block timed like
training compute); the loop (``control.py``) is handed one and decides here when it runs.

numpy only.
"""
from __future__ import annotations

import numpy as np

#: at most this share of a step goes to one probe (it runs while the others compute)
BUDGET = 0.5
#: a held rank (working under a plan made for it as slow) probes within this share of its
#: slack (step time minus its own compute), so the probe never makes it the step's laggard
SLACK_SHARE = 0.5
#: ...and only while its compute fills less than this share of a step: busier, its training
#: timing already measures it under load (and a probe would have no room)
HELD_LOAD = 0.75
#: the budget before any step is timed: room for a full sustain and timed window
#: (``ProbeBlock.SUSTAIN_S`` + ``TIMED_S``, twice)
FIRST_BUDGET_S = 0.32


def budget(step_times, compute_times=None) -> float:
    """Seconds one probe may take: :data:`BUDGET` of the median step (before any step is
    timed: :data:`FIRST_BUDGET_S`); for a rank with work (``compute_times``: its own compute
    seconds per step), also at most :data:`SLACK_SHARE` of its median slack."""
    step = float(np.median(step_times)) if len(step_times) else None
    out = BUDGET * step if step is not None else FIRST_BUDGET_S
    if compute_times is not None and len(compute_times) and step is not None:
        out = min(out, SLACK_SHARE * max(0.0, step - float(np.median(compute_times))))
    return out


def light(step_times, compute_times) -> bool:
    """Does a rank's own compute fill less than :data:`HELD_LOAD` of its median step (True
    before any step is timed)?"""
    if not len(step_times) or not len(compute_times):
        return True
    return float(np.median(compute_times)) < HELD_LOAD * float(np.median(step_times))
