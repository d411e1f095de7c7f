"""How much longer a straggler will last, from what the job has seen (pure; issue 52, item 2).

A layout change pays only if its gain over the straggler's *remaining* time exceeds what the move
costs. Stragglers come in two kinds with very different lengths (docs/TRACES.md): transient ones,
node-wide compute slowdowns of about 10 minutes on average (Greyhound, ATC'25), and persistent
ones, faulty GPUs that stay slow for hours (ByteDance, OSDI'25). Each kind's duration is taken as
exponential, so within a kind the time already lasted says nothing about the time left; across
kinds it says a lot: a slowdown that has lasted an hour is almost surely persistent.

:class:`DurationModel` keeps, per kind, a weight and a mean, each a prior (:data:`PRIOR`, worth
:data:`PRIOR_COUNT` stragglers) updated with the durations of the job's own stragglers, each
shared between the kinds by how likely it is under each (one soft-assignment step of EM per
observation). :meth:`DurationModel.remaining_s` is the expected remaining duration of a slowdown
that has lasted ``age_s``: the kinds' means weighted by their weights and by how likely each kind
is to have lasted that long.
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Kind:
    """One kind of straggler: its name, mean duration (seconds) and share of all stragglers."""

    name: str
    mean_s: float
    weight: float


#: The prior (docs/TRACES.md, the replay's regimes): transient stragglers last 10 minutes on
#: average (Greyhound), persistent faulty GPUs hours (mean 3 h in our regime); most stragglers
#: are transient (Greyhound: 1.5% of nodes per 80 minutes, against a few faulty GPUs per
#: thousand over a day), so 0.9 of them.
PRIOR = (Kind("transient", 600.0, 0.9), Kind("persistent", 10800.0, 0.1))
#: how many stragglers the prior is worth: a job's own first few durations move it at once
PRIOR_COUNT = 2.0


def _minutes(s: float) -> str:
    return f"{s / 60:.1f} min" if s < 5400 else f"{s / 3600:.1f} h"


class DurationModel:
    """Per kind, a pseudo-count of stragglers and their total seconds (see the module doc)."""

    def __init__(self, prior: tuple[Kind, ...] = PRIOR, strength: float = PRIOR_COUNT) -> None:
        if not prior or any(not (k.mean_s > 0 and k.weight > 0) for k in prior):
            raise ValueError(f"duration prior {prior!r}: every kind needs mean_s > 0 and "
                             f"weight > 0")
        if not strength > 0:
            raise ValueError(f"duration prior strength={strength!r} must be > 0 (stragglers)")
        total = sum(k.weight for k in prior)
        self.names = tuple(k.name for k in prior)
        self._n = [strength * k.weight / total for k in prior]
        self._sum = [n * k.mean_s for n, k in zip(self._n, prior)]
        self.seen: list[float] = []

    @property
    def means_s(self) -> list[float]:
        return [s / n for s, n in zip(self._sum, self._n)]

    @property
    def weights(self) -> list[float]:
        t = sum(self._n)
        return [n / t for n in self._n]

    def _posterior(self, log_like: list[float]) -> list[float]:
        """The kinds' weights times ``exp(log_like)``, normalised (in logs: no underflow)."""
        logs = [math.log(w) + ll for w, ll in zip(self.weights, log_like)]
        top = max(logs)
        ps = [math.exp(x - top) for x in logs]
        t = sum(ps)
        return [p / t for p in ps]

    def observe(self, duration_s: float) -> None:
        """A straggler of this job that ended after ``duration_s`` seconds: shared between the
        kinds by the exponential density of each at that duration."""
        if not (duration_s >= 0 and math.isfinite(duration_s)):
            raise ValueError(f"a straggler's duration must be finite and >= 0 s, "
                             f"not {duration_s!r}")
        resp = self._posterior([-math.log(m) - duration_s / m for m in self.means_s])
        for i, r in enumerate(resp):
            self._n[i] += r
            self._sum[i] += r * duration_s
        self.seen.append(float(duration_s))

    def kinds_given_age(self, age_s: float) -> list[float]:
        """How likely each kind is for a slowdown that has lasted ``age_s`` (its survival)."""
        if not (age_s >= 0 and math.isfinite(age_s)):
            raise ValueError(f"a straggler's age must be finite and >= 0 s, not {age_s!r}")
        return self._posterior([-age_s / m for m in self.means_s])

    def remaining_s(self, age_s: float) -> float:
        """The expected remaining seconds of a slowdown that has lasted ``age_s`` (memoryless
        within a kind, so each kind contributes its mean)."""
        return sum(p * m for p, m in zip(self.kinds_given_age(age_s), self.means_s))

    def brief(self, age_s: float) -> str:
        """The estimate in a few words, for a decision's ``reason``: ``expected 8.3 min left
        (transient 0.93)``, the first kind's probability given the age."""
        return (f"expected {_minutes(self.remaining_s(age_s))} left ({self.names[0]} "
                f"{self.kinds_given_age(age_s)[0]:.2f})")

    def describe(self, age_s: float) -> str:
        """The estimate as the decision's ``reason`` shows it."""
        seen = (f"{len(self.seen)} straggler(s) of this job seen, mean "
                f"{_minutes(sum(self.seen) / len(self.seen))}" if self.seen
                else "no straggler of this job seen yet: the prior")
        return (f"expected to last {_minutes(self.remaining_s(age_s))} more "
                f"(lasted {_minutes(age_s)}; {seen})")
