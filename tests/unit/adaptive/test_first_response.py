"""Issue 52, item 2, without processes: each straggler's onset and end as the loop reads them
(``adaptive/stragglers.py``), the cost rule's horizon capped by the straggler's expected
remaining duration (``replan.horizon``, ``replan.decide``), and the session's first response:
the running layout re-split at once, the planner's answer judged against it later
(``session.PlannerSession.first_response``)."""
from __future__ import annotations

from types import SimpleNamespace as NS

import numpy as np
import pytest

from malleus_ds.adaptive.control import Controller
from malleus_ds.adaptive.detect import DetectConfig
from malleus_ds.adaptive.duration import DurationModel
from malleus_ds.adaptive.job import JobSpec
from malleus_ds.adaptive.replan import decide, horizon
from malleus_ds.adaptive.session import Switched
from malleus_ds.adaptive.settings import AdaptiveSettings
from malleus_ds.adaptive.stragglers import Remaining, StragglerWatch
from malleus_ds.cost import step_time
from malleus_ds.models.llama import PRESETS
from malleus_ds.plan import Plan, same_stages, static_plan
from malleus_ds.planner.worker import answer

from .test_control import _problem


def test_the_watch_tracks_onsets_and_ends_and_a_node_is_one_straggler():
    w = StragglerWatch(8)
    H, S = 1.0, 2.0                                           # healthy, slow
    assert w.update([H] * 8) == [] and w.age_s() is None and w.remaining() is None
    w.now_s = 60.0
    assert w.update([S] * 4 + [H] * 4) == []          # a node-wide onset
    w.now_s = 120.0
    w.update([S] * 4 + [H, H, S, H])        # rank 6 later
    w.now_s = 300.0
    assert w.age_s([0, 1]) == 240.0 and w.age_s() == 180.0    # the youngest: rank 6's
    assert w.age_s([5]) is None and w.remaining([4, 5]) is None
    w.now_s = 660.0
    ended = w.update([H] * 6 + [S, H])             # the node recovers at once
    assert ended == [600.0] and w.model.seen == [600.0]       # one straggler, not four
    assert w.ended == [((0, 1, 2, 3), 60.0, 660.0)]
    assert w.age_s() == 540.0
    w.now_s = 700.0
    w.update([S] + [H] * 7)                            # rank 0 again: a new onset
    assert w.ended[-1][0] == (6,) and w.model.seen == [600.0, 580.0]
    assert w.age_s([0]) == 0.0
    with pytest.raises(ValueError, match="slow: 3 ranks, the watch has 8"):
        w.update([S] * 3)


def test_the_remaining_estimate_learns_from_the_jobs_own_stragglers():
    """A slowdown 1 minute old is expected to last about half an hour under the prior (one in
    ten is a fault of hours); after twenty 3-minute stragglers of this job, a few minutes."""
    w = StragglerWatch(2)
    w.update([2.0, 1.0])
    w.now_s = 60.0
    prior = w.remaining([0])
    assert 20 * 60 < prior.seconds < 35 * 60 and prior.age_s == 60.0
    assert "left (transient 0.8" in prior.text and "0 ended seen" in prior.text
    for _ in range(20):
        w.now_s += 180.0
        w.update([1.0, 1.0])
        w.update([2.0, 1.0])
    w.now_s += 60.0
    learnt = w.remaining([0])
    assert learnt.seconds < 8 * 60 and "20 ended seen" in learnt.text
    assert learnt.text.startswith(DurationModel().brief(0.0).split()[0])     # "expected"


def test_the_horizon_is_capped_by_the_expected_remaining_duration():
    assert horizon(100, 2.0) == (100.0, "100 steps")
    assert horizon(100, None, Remaining(60.0, 30.0, "x")) == (100.0, "100 steps")
    steps, text = horizon(100, 2.0, Remaining(60.0, 30.0, "expected 1.0 min left"))
    assert steps == 30.0 and text == "30.0 steps: expected 1.0 min left"
    steps, text = horizon(100, 2.0, Remaining(1e6, 30.0, "long"))
    assert steps == 100.0 and text == "100 steps (long)"


def test_a_layout_change_must_pay_within_the_stragglers_expected_remaining_time():
    """A move that pays over the fixed horizon (100 steps) but not over the 20 steps the
    straggler is expected to last is not adopted, and the reason says why."""
    pr, cur = _problem({3: 5.0})
    new = Plan.from_json(answer({"problem": pr.to_json()})["plan"])
    gain_per_step = 1.0 - step_time(pr, new) / step_time(pr, cur)
    mig = gain_per_step * 50                                # pays within 50 steps
    d = decide(pr, cur, new, "onset", [1, 1, 1, 5], 9, 0.4, 1.0, 10**6, mig, 100)
    assert d.adopted and d.reason.endswith(f"> migration {mig:.2f} s")
    soon = Remaining(20.0, 45.0, "expected 0.3 min left (transient 0.97)")
    d = decide(pr, cur, new, "onset", [1, 1, 1, 5], 9, 0.4, 1.0, 10**6, mig, 100, soon)
    assert not d.adopted and d.plan is None and d.to_plan == cur.id
    assert "over 20.0 steps: expected 0.3 min left (transient 0.97) <= migration" in d.reason
    late = Remaining(3600.0, 45.0, "expected 1.0 h left (transient 0.10)")
    assert decide(pr, cur, new, "onset", [1, 1, 1, 5], 9, 0.4, 1.0, 10**6, mig, 100,
                  late).adopted


class _Planner:
    """A planner client that answers each request with the real planner, when polled."""

    def __init__(self):
        self.asked, self.answers = [], []

    def request(self, msg):
        self.asked.append(msg)
        self.answers.append(answer(msg))

    def poll(self):
        return self.answers.pop(0) if self.answers else None

    def wait(self, timeout_s):
        return self.poll()

    def close(self):
        pass


def _ctl(steps=6):
    plan = static_plan(4, 8, 1, 1, 1, 4)                    # pure DP, 2 micro-batches each
    ctl = Controller(JobSpec.of_model(PRESETS["tiny"], plan),
                     AdaptiveSettings(detect=DetectConfig(every=1)), plan, planner=_Planner())
    for _ in range(steps):
        ctl.step_done(1.0)
    return ctl, plan


def test_an_onset_is_answered_at_once_by_a_resplit_and_the_planner_after_it():
    ctl, plan = _ctl()
    ses = ctl.session
    for _ in range(ctl.s.detect.confirm):       # the watch turns a rank as the detector does
        ctl.stragglers.update([1.0, 1.0, 1.0, 3.0])
    ctl.stragglers.now_s += 30.0
    ses.request("onset", [1.0, 1.0, 1.0, 3.0], 7)
    first = ses.result
    assert first is not None and first.first and first.adopted and first.bytes == 0
    assert first.reason.startswith("re-split at once, no state moved: gain ")
    assert "expected" in first.reason and "(transient 0." in first.reason
    new = Plan.from_json(first.plan)
    assert same_stages(plan, new) and new.id != plan.id
    assert [p.micro_batches for p in new.pipelines][3] < 2
    assert ses.pending is not None and len(ses.client.asked) == 1      # the planner asked too
    assert first.line()["first"] is True
    ses.collect()                       # the first response is not shared yet: the answer waits
    assert ses.result is first and ses.pending is not None
    ses.collect(answer(ses.client.asked[0]))    # ...also one handed over (a blocking wait)
    assert ses.result is first and "answer" in ses.pending
    ses.wait()                          # nothing to wait for before the first is shared
    assert ses.result is first
    got = ses.share_result()
    assert got is first
    ctl.switched(new, list(first.made_for), migration=NS(bytes=0, seconds=0.03))
    assert ses.pending is not None      # a re-split keeps the request in flight
    assert not ctl.step_times and ses.step_s(ses.pending["problem"], new) > 0   # calibrated
    assert ses.migrate_s_for(0, kept=True) == pytest.approx(0.03)
    ses.client.answers.clear()
    ses.wait()                          # the answer taken before, judged against the re-split
    later = ses.result
    assert later is not None and not later.first and later.from_plan == new.id
    assert later.reason == "the running plan is still the best" and not later.adopted


def test_a_layout_switch_drops_the_answer_planned_against_the_old_plan():
    ctl, plan = _ctl()
    ses = ctl.session
    ses.request("onset", [1.0, 1.0, 1.0, 3.0], 7)
    ses.share_result()
    other = static_plan(4, 8, 1, 1, 2, 2)                  # two 2-stage pipelines
    ctl.switched(other, None, migration=NS(bytes=10**6, seconds=4.0))
    ses.collect()
    assert ses.pending is None and ses.result is None
    # a layout change is predicted from layout changes only, a re-split from re-splits only
    assert ses.migrate_s_for(0, kept=True) == pytest.approx(0.05)          # none measured yet
    assert ses.migrate_s_for(10**6) == pytest.approx(0.05 + 4.0)
    total, busiest = ses.bytes_for(plan)                   # back to the first plan
    assert 0 < busiest < total


def test_before_any_layout_change_the_busiest_rank_sets_the_prediction():
    """Until a layout change is measured, its bytes cross every rank's links at once: the
    busiest rank's bytes over ``migrate_gbps``, not the total (a 256-GPU switch of 400 GB
    predicted at 400 s at 1 GB/s kept every layout change out); a re-split's pause teaches
    nothing of it."""
    ctl, _ = _ctl()
    ses = ctl.session
    ses.migrations.append(Switched(0, 0.0, kept=True))
    assert ses.migrate_s_for(400 * 10**9, busiest=2 * 10**9) == pytest.approx(0.05 + 2.0)
    assert ses.migrate_s_for(400 * 10**9) == pytest.approx(0.05 + 400.0)


def test_a_missed_promise_is_answered_first_by_a_resplit_too_and_says_so():
    ctl, _ = _ctl()
    ses = ctl.session
    ses.request("missed", [1.0, 1.0, 1.0, 3.0], 7, why="step 2.1 s, 1.5x the promised 1.4 s",
                check_step=5)
    got = ses.result
    assert got is not None and got.first and got.check_step == 5
    assert got.reason.startswith("step 2.1 s, 1.5x the promised 1.4 s: re-split at once")


def test_no_first_response_without_a_measured_pace_or_anything_to_resplit():
    ctl, _ = _ctl(steps=0)
    ses = ctl.session
    ses.request("onset", [1.0, 1.0, 1.0, 3.0], 7)
    assert ses.result is None and ses.pending is not None   # no step timed: the planner only
    ctl, _ = _ctl()
    ses = ctl.session
    ses.request("onset", [1.0, 1.0, 1.0, 1.0], 8)            # nothing to re-split for
    assert ses.result is None and ses.pending is not None


def test_the_controller_tracks_stragglers_on_its_clock_at_each_detection():
    """Driven through its hooks: rank 3 slow from step 20 to step 80 of 1 s steps; the watch
    sees it begin and end about a window after each (the smoothed rates), and the one
    straggler's duration goes to the model."""
    from malleus_ds.adaptive.work import cost_units
    from malleus_ds.steploop import StepSums

    plan = static_plan(4, 8, 1, 1, 1, 4)
    ctl = Controller(JobSpec.of_model(PRESETS["tiny"], plan),
                     AdaptiveSettings(enabled=False, detect=DetectConfig(every=1)), plan)
    units = cost_units(plan, 4, 1, {1: 1.0})
    rng = np.random.default_rng(0)
    onset = None
    for k in range(140):
        rates = np.array([1, 1, 1, 2.0 if 20 <= k < 80 else 1])
        comp = units * 0.01 * rates * rng.uniform(0.98, 1.02, 4)
        ctl.contribute(comp[0], 0.0)
        ctl.observe(k, StepSums(loss=0.0, overflow=False, ready=False, compute_s=comp,
                                probe_s=np.full(4, np.nan)))
        ctl.step_done(1.0)
        if onset is None and ctl.stragglers.age_s() is not None:
            onset = k
    w = ctl.stragglers
    assert w.now_s == 140.0 and 20 <= onset <= 26
    assert len(w.ended) == 1 and w.ended[0][0] == (3,)
    assert 60 - 6 <= w.model.seen[0] <= 60 + 6 and w.age_s() is None


def test_a_flapping_rank_is_held_slow_until_it_stays_healthy():
    """Rank 2 slow at 1.8 three times within half an hour: held at 1.8 (the detector normalises
    its healthy readings to it, so its flips trigger nothing); released once it has stayed
    healthy for ``FLAP_S``. Two stragglers that ended are no flapper yet."""
    from malleus_ds.adaptive.detect import Detector
    from malleus_ds.adaptive.stragglers import FLAP_S

    w = StragglerWatch(4)
    slow, healthy = [1.0, 1.0, 1.8, 1.0], [1.0] * 4
    for t, r in ((-360.0, slow), (-180.0, healthy), (0.0, slow), (180.0, healthy)):
        w.now_s = t
        w.update(r)
    assert list(w.holds()) == [1.0] * 4 and w.steady_s() == FLAP_S - 360.0
    for t, r in ((360.0, slow), (540.0, healthy)):
        w.now_s = t
        w.update(r)
    assert list(w.holds()) == [1.0, 1.0, 1.8, 1.0]
    det = Detector(4, DetectConfig(every=1, confirm=1, cooldown=0))
    det.hold = w.holds()
    det.planned_for([1.0, 1.0, 1.8, 1.0])
    assert list(det.normalise(healthy)) == [1.0, 1.0, 1.8, 1.0]
    assert list(det.normalise(healthy, held=False)) == healthy
    assert det.check(healthy) is None and det.check(slow) is None      # no trigger either way
    assert w.steady_s() == pytest.approx(-180.0 + FLAP_S - 540.0)
    w.now_s = 540.0 + FLAP_S + 1.0
    assert list(w.holds()) == healthy and w.steady_s() is None
    det.hold = w.holds()
    assert det.check(healthy).kind == "recovery"


def test_a_flapper_is_held_at_a_confirmed_slow_rate_never_at_a_blips():
    """A rank that flapped at 1.8 three times, then reads one blip of 5.0 among healthy readings
    (unconfirmed: the detector confirms over two): it is held at 1.8, not at 5.0."""
    w = StragglerWatch(2, confirm=2)
    t = 0.0
    for r in [1.8, 1.8, 1.0, 1.0] * 3 + [1.0, 5.0, 1.0, 1.0]:
        w.now_s, t = t, t + 60.0
        w.update([1.0, r])
    assert len(w.ended) == 3 and w.age_s() is None
    assert list(w.holds()) == [1.0, 1.8]


def test_one_reading_is_no_onset_and_no_end_when_the_detector_confirms_over_two():
    """With the detector's ``confirm`` = 2 a rank turns only on two readings in a row, dated
    from the first: a slow rank's one healthy-looking reading (a quota enforced loosely) ends
    nothing, so it cannot add up to a flapper's ends."""
    w = StragglerWatch(2, confirm=2)
    for t, r in ((0.0, 3.0), (10.0, 1.0), (20.0, 3.0), (30.0, 1.0)):   # blips, never two
        w.now_s = t
        assert w.update([1.0, r]) == []
    assert w.age_s() is None                        # the first 3.0 was a blip too
    w.now_s = 40.0
    w.update([1.0, 3.0])
    w.now_s = 50.0
    w.update([1.0, 3.0])
    assert w.age_s() == 10.0                        # slow since 40 s
    w.now_s = 60.0
    assert w.update([1.0, 1.0]) == [] and w.ends == {}
    w.now_s = 70.0
    w.update([1.0, 3.0])                            # the dip: no end
    for t in (80.0, 90.0):
        w.now_s = t
        ended = w.update([1.0, 1.0])
    assert ended == [40.0] and w.ended == [((1,), 40.0, 80.0)] and w.ends == {1: [80.0]}
    with pytest.raises(ValueError, match="confirm=0"):
        StragglerWatch(2, confirm=0)
