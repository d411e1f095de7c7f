"""The straggler duration model (adaptive/duration.py): the prior's answers, how the job's own
stragglers move it, and bad input."""
import math

import numpy as np
import pytest

from malleus_ds.adaptive.duration import PRIOR, DurationModel, Kind


def test_the_prior_alone_expects_the_mixture_mean_and_more_the_longer_a_slowdown_lasts():
    m = DurationModel()
    assert m.remaining_s(0.0) == pytest.approx(0.9 * 600 + 0.1 * 10800)
    ages = [0, 60, 300, 600, 1200, 3600, 7200]
    rem = [m.remaining_s(a) for a in ages]
    assert all(b >= a for a, b in zip(rem, rem[1:])), rem      # older: more likely persistent
    assert rem[-1] == pytest.approx(10800, rel=0.01)            # two hours in: a faulty GPU
    assert m.kinds_given_age(3600)[1] > 0.9


def test_a_job_whose_stragglers_are_short_learns_to_expect_short_ones():
    rng = np.random.default_rng(0)
    m = DurationModel()
    for d in rng.exponential(120.0, 40):
        m.observe(float(d))
    assert 100 < m.means_s[0] < 200     # the transient kind's mean (prior 600 s, worth 1.8)
    assert m.weights[0] > 0.95
    assert m.remaining_s(0.0) < 400                             # the prior said 1,620 s
    assert m.remaining_s(7200) > 5000                           # but a 2-hour one is persistent


def test_long_stragglers_raise_the_persistent_kind_s_weight():
    m = DurationModel()
    for d in (9000.0, 12000.0, 15000.0):
        m.observe(d)
    assert m.weights[1] > 0.5 and m.means_s[1] > 10800
    assert m.remaining_s(0.0) > DurationModel().remaining_s(0.0)


def test_the_reason_shows_the_estimate_and_what_it_rests_on():
    m = DurationModel()
    assert m.describe(90) == ("expected to last 29.3 min more (lasted 1.5 min; no straggler of "
                              "this job seen yet: the prior)")
    m.observe(300.0)
    m.observe(420.0)
    line = m.describe(30)
    assert line.startswith("expected to last ") and "2 straggler(s) of this job seen, mean 6.0 " \
        "min" in line


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan])
def test_bad_durations_and_ages_are_named(bad):
    m = DurationModel()
    with pytest.raises(ValueError, match="duration must be finite and >= 0 s"):
        m.observe(bad)
    with pytest.raises(ValueError, match="age must be finite and >= 0 s"):
        m.remaining_s(bad)
    with pytest.raises(ValueError, match="mean_s > 0 and weight > 0"):
        DurationModel((Kind("x", 0.0, 1.0),))
    with pytest.raises(ValueError, match="strength=0"):
        DurationModel(PRIOR, 0)
