"""The step loop's contract: what an engine and a loop attached to it say to each other each
step (DESIGN.md §6), below the engine, the adaptive loop and the replay.

* :class:`StepLoop`: the hooks an engine calls at fixed points of a step. The engine imports no
  loop; the app attaches one (``app/loop.py`` attaches ``adaptive/control.py``'s
  ``Controller``); without one the engine runs :class:`NoLoop`. A replay (``replay/loop.py``)
  and the engine-less tests drive the same hooks with synthetic timings.
* :class:`StepSums`: one step's all-reduced values, as the loop observes them (the engine's
  slot layout is ``engine/step_reduce.py``).
* :class:`ReplanDecision`: the loop's answer to a re-plan, broadcast to every rank at a step
  boundary, and its metrics.jsonl ``replan`` line (:meth:`ReplanDecision.line`).
* :class:`Prober`: the probe block a rank times to stay measured without work (the engine's
  ``engine/probe_block.py``; a replay reads simulated probes), and :data:`REF_RUNS`.

numpy only: no torch, no DeepSpeed.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

if TYPE_CHECKING:
    from .plan import Plan


def _none() -> np.ndarray:
    return np.zeros(0)


@dataclass(frozen=True)
class StepSums:
    """One step's all-reduced values, read back once.

    The per-rank clock numbers are each rank's as of the all-reduce. ``late``: some rank may
    time more of the step after it (the loop's probes, :meth:`StepLoop.timed_after_reduce`;
    the same on every rank), so they are not yet the step's whole: a report of the step
    (metrics.jsonl) reads the clocks once it is done."""

    loss: float                 # the global batch's loss sum
    overflow: bool              # some summed gradient element is non-finite
    ready: bool                 # rank 0 has a decision to broadcast
    compute_s: np.ndarray       # per rank: compute seconds this step
    probe_s: np.ndarray         # per rank: probe seconds per cost unit, NaN where none
    #: the step's timed communication, ``(kind, ranks, MB, seconds)`` each (``comm_log.decode``,
    #: decoded when first read; empty: not logged)
    comm: Sequence = ()
    #: per rank: the straggler emulation's seconds inside ``compute_s`` (empty: not carried)
    emulated_s: np.ndarray = field(default_factory=_none)
    #: per rank: seconds inside compute spans waiting for a core (empty: not carried)
    wait_s: np.ndarray = field(default_factory=_none)
    #: per rank: seconds the slow-link emulation slept (empty: not carried)
    link_s: np.ndarray = field(default_factory=_none)
    stop: int = 0               # the largest stop signal any rank raised (0: none)
    late: bool = False          # some rank may time more of the step after the all-reduce


#: per rank: a rate (1.0 healthy), None where not measured
Rates = tuple[float | None, ...]


def _rates(x: Sequence | None) -> Rates | None:
    return None if x is None else tuple(x)


@dataclass(frozen=True)
class ReplanDecision:
    """Rank 0's answer to a re-plan trigger, the same on every rank once broadcast.

    Two kinds: a *planned* decision (:func:`adaptive.replan.decide`: the planner answered; the
    running plan ``from_plan`` against the planner's ``planned``, kept or adopted) and a
    *failed* one (:meth:`failed`: nothing could be planned; only the raw estimate is known).
    The rates go by meaning: ``trigger_rates``, the normalised rates the planner was asked to
    plan for (healthy 1.0); ``estimate``, the loop's raw per-rank estimate (a failed decision's
    only reading); ``rates_for``, the rates the plan to switch to was made for when that is not
    ``trigger_rates`` (a step back to an earlier plan). ``plan``: the plan JSON to switch to
    (None: stay)."""

    step: int                                   # the boundary it applies before
    trigger: str                                # onset, recovery, change, link, missed, ...
    adopted: bool
    reason: str
    plan: dict | None = None                    # plan JSON to switch to, None: stay
    trigger_rates: Rates | None = None          # planned kind: the rates it planned for
    estimate: Rates | None = None               # failed kind: the raw estimate
    from_plan: str | None = None                # planned kind: the running plan's id
    to_plan: str | None = None                  # ...the plan after it (from_plan: kept)
    planned: str | None = None                  # ...the planner's answer
    planning_s: float = 0.0
    predicted_step_s: tuple = ()                # (running, new) seconds per step
    predicted_migration_s: float = 0.0
    bytes: int = 0
    rates_for: Rates | None = None              # the rates the plan switched to was made for
    check_step: int | None = None               # the check event whose missed promise it acts on
    link_rates: Mapping[str, float] | None = None       # planned slow links (None: not watched)
    gpu_link_rates: Mapping[str, float] | None = None
    measured_link_rates: Mapping[str, float] | None = None
    measured_gpu_link_rates: Mapping[str, float] | None = None
    comm: Mapping[str, float] | None = None     # the links' cost terms it planned with
    detected: int | None = None                 # the step it was decided before, if earlier
    first: bool = False                         # a re-split decided at once, not planned

    @classmethod
    def failed(cls, trigger: str, step: int, reason: str,
               estimate: Sequence[float | None]) -> "ReplanDecision":
        """Nothing planned (no planner, the job cannot be planned for, the planner failed)."""
        return cls(step=step, trigger=trigger, adopted=False, reason=reason,
                   estimate=_rates(estimate))

    @property
    def measured(self) -> Rates | None:
        """The rates its line reports as ``measured_rates``: the trigger's, else the estimate."""
        return self.trigger_rates if self.from_plan is not None else self.estimate

    @property
    def made_for(self) -> Rates | None:
        """The rates the plan it switches to was made for (the loop's new reference)."""
        return self.rates_for if self.rates_for is not None else self.measured

    def stale(self, running: str) -> "ReplanDecision":
        """This decision, found planned against a plan that no longer runs: kept, not adopted."""
        return replace(self, adopted=False, to_plan=running, plan=None,
                       reason=f"stale: planned against {self.from_plan}, running {running}")

    def at(self, step: int) -> "ReplanDecision":
        """Broadcast at the boundary before ``step``: decided before ``self.step``."""
        return replace(self, step=step, detected=self.step)

    def line(self) -> dict[str, Any]:
        """The metrics.jsonl ``replan`` line."""
        if self.from_plan is None:
            out = {"event": "replan", "step": self.step, "trigger": self.trigger,
                   "adopted": self.adopted, "reason": self.reason,
                   "measured_rates": _list(self.estimate)}
        else:
            out = {"event": "replan", "step": self.step, "trigger": self.trigger,
                   "measured_rates": _list(self.trigger_rates), "from": self.from_plan,
                   "to": self.to_plan, "planned": self.planned, "planning_s": self.planning_s,
                   "predicted_step_s": list(self.predicted_step_s),
                   "predicted_migration_s": self.predicted_migration_s, "bytes": self.bytes,
                   "adopted": self.adopted, "reason": self.reason}
        if self.first:
            out["first"] = True
        for key in ("rates_for", "check_step", "link_rates", "gpu_link_rates",
                    "measured_link_rates", "measured_gpu_link_rates", "comm", "detected"):
            v = getattr(self, key)
            if v is not None:
                out[key] = _list(v) if key == "rates_for" else \
                    dict(v) if isinstance(v, Mapping) else v
        return out


def _list(x: Sequence | None) -> list | None:
    return None if x is None else list(x)


@runtime_checkable
class StepLoop(Protocol):
    """The hooks a loop attached to an engine implements, in a step's order.

    * :meth:`contribute`: this rank's values for the step's one all-reduce: rank 0's "a decision
      is ready" flag and a probe reading (seconds per cost unit, 0.0: none);
    * :meth:`observe`: after that all-reduce, every rank's numbers (:class:`StepSums`);
    * :meth:`after_reduce`: right after it, when every rank leaves it at once (probes run here);
      :meth:`timed_after_reduce`: may any rank's clock have timed more of the step there (the
      same on every rank: the step's numbers in :class:`StepSums` are then ``late``);
    * :meth:`step_done`: the step's wall time;
    * :meth:`before_step`: collective, at the boundary before ``step``: the decisions to apply,
      the same on every rank;
    * :meth:`switched` / :meth:`considered`: a switch happened (made for ``rates``) / a decision
      kept the running plan;
    * :meth:`take_events`: events for metrics.jsonl; :meth:`measured_rates`; :meth:`close`.

    ``measures_links``: every rank times its communication for link rates (the same on every
    rank; the engine then logs it into the step's all-reduce)."""

    @property
    def measures_links(self) -> bool: ...

    def contribute(self, compute_s: float,
                   probe_s: float | None = None) -> tuple[bool, float]: ...

    def observe(self, step: int, sums: StepSums) -> None: ...

    def after_reduce(self, step: int) -> None: ...

    def timed_after_reduce(self, step: int) -> bool: ...

    def step_done(self, seconds: float) -> None: ...

    def before_step(self, step: int) -> list[ReplanDecision]: ...

    def switched(self, plan: "Plan", rates: Sequence[float | None] | None, job: Any = None,
                 migration: Any = None) -> None: ...

    def considered(self, rates: Sequence[float | None] | None) -> None: ...

    def take_events(self) -> list[dict]: ...

    def measured_rates(self) -> list[float | None]: ...

    def close(self) -> None: ...


#: the calibrating rank times this many runs of the probe block per probe (it works every step:
#: warm, no warm-up after its first probe); a replay charges their seconds to its compute
REF_RUNS = 2


@runtime_checkable
class Prober(Protocol):
    """The probe block a rank times: ``measure(sustain, budget_s)`` -> seconds per run (held
    busy first when ``sustain``, all within ``budget_s``), ``release()`` frees it."""

    def measure(self, sustain: bool, budget_s: float) -> float: ...

    def release(self) -> None: ...


class NoLoop:
    """The hooks of an engine with no loop attached: nothing measured, nothing decided."""

    measures_links = False

    def __init__(self, world: int) -> None:
        self.world = world

    def contribute(self, compute_s: float, probe_s: float | None = None) -> tuple[bool, float]:
        return False, 0.0

    def observe(self, step: int, sums: StepSums) -> None:
        pass

    def after_reduce(self, step: int) -> None:
        pass

    def timed_after_reduce(self, step: int) -> bool:
        return False

    def step_done(self, seconds: float) -> None:
        pass

    def before_step(self, step: int) -> list[ReplanDecision]:
        return []

    def switched(self, plan: "Plan", rates: Sequence[float | None] | None, job: Any = None,
                 migration: Any = None) -> None:
        pass

    def considered(self, rates: Sequence[float | None] | None) -> None:
        pass

    def take_events(self) -> list[dict]:
        return []

    def measured_rates(self) -> list[float | None]:
        return [None] * self.world

    def close(self) -> None:
        pass
