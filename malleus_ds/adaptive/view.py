"""What the adaptive loop's components (``probing.py``, ``session.py``, ``promise.py``) read of
the loop they serve: the job, the running plan and its work, and the measurement every rank
shares. :class:`~malleus_ds.adaptive.control.Controller` is the one implementation; the
components read it through this protocol and never import it.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import numpy as np

from ..job_layout import JobLayout
from ..plan import Plan
from .detect import Detector
from .job import JobSpec
from .link_watch import LinkWatch
from .rates import RateEstimator
from .settings import AdaptiveSettings
from .stragglers import StragglerWatch
from .work import RunningWork


class LoopView(Protocol):
    """The loop's state as its components read it (module doc)."""

    spec: JobSpec                 # the job, frozen at start
    s: AdaptiveSettings
    job: JobLayout                # the job layout now
    plan: Plan                    # the plan running now
    first_plan: Plan              # the user's layout
    work: RunningWork             # the running plan's work, held ranks, calibrating rank
    est: RateEstimator
    det: Detector | None          # rank 0: the detector
    links: LinkWatch | None       # rank 0: the links' rates and detection
    measured: np.ndarray          # every rank's smoothed rate (NaN: not measured)
    step_times: deque
    compute_times: deque          # this rank's compute seconds, under the running plan
    ready: bool                   # rank 0 flagged a decision in an all-reduce
    seen: int                     # steps measured so far
    last_step: int                # the step observe() saw last
    session: Any                  # rank 0's planner session (``session.PlannerSession``)
    promise: Any                  # the promise and back-out (``promise.Promise``)
    stragglers: StragglerWatch | None   # rank 0: each straggler's onset and end

    @property
    def rank(self) -> int: ...

    @property
    def world(self) -> int: ...

    @property
    def units(self) -> np.ndarray: ...

    @property
    def held(self) -> np.ndarray: ...

    @property
    def probe_ref(self) -> int | None: ...

    @property
    def working(self) -> bool: ...

    @property
    def measures_links(self) -> bool: ...

    def normalised(self) -> list[float]: ...
