"""The loop checks its own predictions (malleus_ds/adaptive/pace_check.py): recorded step times in,
verdicts out. No processes."""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.adaptive.pace_check import CheckConfig, HealthyPace, PaceCheck


def _feed(check, times, start=10):
    return [ev for k, t in enumerate(times) if (ev := check.observe(start + k, t)) is not None]


def test_a_kept_promise_is_one_kept_event_and_noise_never_misses():
    rng = np.random.default_rng(0)
    check = PaceCheck()
    check.expect("plan-a", 0.40, "healthy pace")
    times = 0.40 * rng.uniform(0.8, 1.25, 60)
    times[[7, 19, 33]] = 1.5          # single slow steps (a busy host) are no miss
    evs = _feed(check, times)
    assert [e["outcome"] for e in evs] == ["kept"], evs
    assert evs[0]["step"] == 10 + CheckConfig().kept_after - 1
    assert evs[0]["plan"] == "plan-a" and evs[0]["expected_from"] == "healthy pace"


def test_the_readmitted_straggler_of_issue_31_misses_at_once():
    """Rank 1, still 10x slow, was re-admitted into a plan promising 0.43 s: steps took 1.7 s
    and 0.8 s. Three slow steps in a row are a miss, with the numbers."""
    check = PaceCheck()
    check.expect("plan-b", 0.43, "re-plan calibration")
    evs = _feed(check, [1.7, 0.8, 0.9, 0.9])
    assert len(evs) == 1 and evs[0]["outcome"] == "missed", evs
    ev = evs[0]
    assert ev["step"] == 12 and ev["measured_s"] == 0.9 and ev["ratio"] == pytest.approx(2.093,
                                                                                        abs=1e-3)


def test_a_healthy_rank_on_a_light_share_runs_slower_than_promised():
    """Failure 2 of issue 31: the job ran at 0.61 of its healthy pace (0.35 s -> 0.57 s) on a
    plan that promised the pace of a rate-3.3 straggler (0.43 s)."""
    check = PaceCheck()
    check.expect("plan-b", 0.43)
    evs = _feed(check, [0.57, 0.58, 0.56])
    assert [e["outcome"] for e in evs] == ["missed"]


def test_a_miss_that_changed_nothing_waits_twice_as_long_before_the_next():
    cfg = CheckConfig(backoff=4)
    check = PaceCheck(cfg)
    check.expect("p", 1.0)
    slow = [2.0] * 40
    steps = [e["step"] for e in _feed(check, slow[:3], start=0)]
    assert steps == [2]
    check.acted(changed=False)                    # quiet for 8 judged steps
    steps = [e["step"] for e in _feed(check, slow[:12], start=3)]
    assert steps == [3 + 8 + 2]                   # then three slow steps in a row again
    check.acted(changed=True)                     # a plan change: judged at once, and...
    steps = [e["step"] for e in _feed(check, slow[:8], start=20)]
    assert steps == [20 + 2]
    check.acted(changed=False)                    # ...the base backoff doubles from 4
    steps = [e["step"] for e in _feed(check, slow[:12], start=30)]
    assert steps == [30 + 8 + 2]


def test_a_new_plan_restarts_the_check_and_nothing_is_checked_without_a_promise():
    check = PaceCheck()
    assert _feed(check, [5.0] * 10) == []         # no expectation: nothing judged
    check.expect("p", None)
    assert _feed(check, [5.0] * 10) == []
    check.expect("p", 1.0)
    assert _feed(check, [1.5, 1.5]) == []         # 1.5x: over the margin, under severe
    check.expect("q", 1.0)                        # a switch: the streak starts again
    assert _feed(check, [1.5, 1.5]) == []
    assert [e["outcome"] for e in _feed(check, [1.5])] == ["missed"]
    assert _feed(PaceCheck(CheckConfig(enabled=False)), [5.0] * 10) == []


@pytest.mark.parametrize("field,value", [("margin", 0.0), ("patience", 0), ("backoff", -1),
                                         ("kept_after", 2), ("severe", 1.2),
                                         ("severe_patience", 0)])
def test_check_config_errors_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^check\.{field}={value}"):
        CheckConfig(**{field: value}).check()
    from malleus_ds.adaptive.settings import AdaptiveSettings     # named as the user wrote it
    for where in ("malleus", "ds_config.malleus"):
        with pytest.raises(ValueError, match=rf"^{where}\.check\.{field}={value}"):
            AdaptiveSettings.from_config({"check": {field: value}}, where)


def test_healthy_pace_is_the_median_of_healthy_steps_per_model_unit():
    pace = HealthyPace(keep=5, need=3)
    pace.add(0.30, 2.0)
    pace.add(0.50, 2.0)
    assert pace.seconds is None and pace.scale is None
    pace.add(0.35, 2.0)
    assert pace.seconds == 0.35 and pace.scale == pytest.approx(0.175)
    pace.add(0.0, 2.0)                            # no measurement
    assert pace.seconds == 0.35


def test_settings_parse_the_check_section():
    from malleus_ds.adaptive.settings import AdaptiveSettings

    s = AdaptiveSettings.from_config({"check": {"margin": 0.5, "patience": 2}})
    assert s.check == CheckConfig(margin=0.5, patience=2)
    assert AdaptiveSettings.from_config({}).check == CheckConfig()
    with pytest.raises(ValueError, match=r"malleus\.check: unknown keys \['nope'\]"):
        AdaptiveSettings.from_config({"check": {"nope": 1}})
    with pytest.raises(ValueError, match=r"malleus\.check\.patience=1\.5 must be an integer"):
        AdaptiveSettings.from_config({"check": {"patience": 1.5}})
    with pytest.raises(ValueError, match=r"malleus\.check\.enabled='yes' must be true or false"):
        AdaptiveSettings.from_config({"check": {"enabled": "yes"}})


def test_severe_steps_miss_in_two_and_the_first_plan_only_on_severe_ones():
    """A rate-10 straggler on the user's first plan: steps jump ~10x the healthy pace; the
    severe rule misses after two of them. A healthy run's noise (1.2-1.8x for many steps in a
    row, one 2.5x spike) is no miss, and the first plan is never 'kept'."""
    check = PaceCheck()
    check.expect("first", 0.35, "healthy pace", severe_only=True)
    rng = np.random.default_rng(3)
    noise = list(0.35 * rng.uniform(1.2, 1.8, 30))
    noise[12] = 0.35 * 2.5
    assert _feed(check, noise) == []
    evs = _feed(check, [3.5, 3.6, 3.4], start=50)
    assert [(e["step"], e["outcome"]) for e in evs] == [(51, "missed")]
    check = PaceCheck()                 # a checked plan: a severe miss comes before patience
    check.expect("b", 0.43)
    assert [e["step"] for e in _feed(check, [1.7, 0.9])] == [11]


def test_the_first_step_after_a_switch_counts_for_the_severe_rule_only():
    check = PaceCheck()
    check.expect("b", 0.4)
    assert check.observe(5, 0.6, first=True) is None      # 1.5x: allocation, first touch
    assert _feed(check, [0.6, 0.6], start=6) == []         # two more: the margin needs three
    check = PaceCheck()
    check.expect("b", 0.4)
    assert check.observe(5, 2.5, first=True) is None      # a straggler on full work...
    ev = check.observe(6, 2.4)                             # ...is a miss one step later
    assert ev is not None and ev["outcome"] == "missed" and ev["steps"] == 2


def test_a_new_plan_is_judged_at_once_after_a_miss_that_changed_it():
    check = PaceCheck(CheckConfig(backoff=8))
    check.expect("a", 0.4)
    assert [e["outcome"] for e in _feed(check, [1.0, 1.0])] == ["missed"]
    check.acted(changed=True)
    check.expect("b", 0.4)                                 # the new plan
    assert [e["outcome"] for e in _feed(check, [1.0, 1.0], start=20)] == ["missed"]
