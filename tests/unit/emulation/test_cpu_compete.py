"""``straggler.method=compete`` (malleus_ds/emulation/cpu_compete.py): a real slowdown without cgroups,
busy processes pinned beside the rank. The share model is checked without processes, and
competitors of a killed process exit; a real competitor slowing a workload on this machine reads
timings (tests/integration/test_cpu_compete_real.py, with the cores to itself)."""
from __future__ import annotations


import pytest

from malleus_ds.emulation import cpu_compete as cc
from malleus_ds.emulation.straggler import Straggler, StragglerSchedule


@pytest.mark.parametrize("rate", [1.5, 2.0, 2.5, 3.0, 3.7, 5.0, 6.1, 8.0, 12.5, 17.0])
def test_competitors_give_the_share_closest_to_one_over_rate(rate):
    n, nice = cc.competitors(rate)
    assert n == min(cc.MAX_COMPETITORS, int(-(-(rate - 1) // 1)))
    assert 0 <= nice < len(cc.NICE_WEIGHTS)
    assert abs(1 / cc.share(n, nice) - rate) <= 0.1 * rate, (n, nice, 1 / cc.share(n, nice))


def test_no_competitor_at_rate_one_and_bad_rates():
    assert cc.competitors(1.0) == (0, 0) and cc.competitors(0.5) == (0, 0)
    assert cc.competitors(2.0) == (1, 0) and cc.competitors(3.0) == (2, 0)
    with pytest.raises(ValueError, match="must be finite"):
        cc.competitors(float("inf"))


def test_pick_core_wraps_over_the_allowed_cores():
    assert cc.pick_core({4, 2, 7}, 0) == 2 and cc.pick_core({4, 2, 7}, 4) == 4
    with pytest.raises(cc.CpuCompeteError, match="no core"):
        cc.pick_core(set(), 0)


def test_compete_straggler_sets_the_rate_at_its_steps():
    calls = []

    class Fake:
        def set_rate(self, r):
            calls.append(r)

    st = Straggler(StragglerSchedule.parse([{"rank": 0, "rate": 3.0, "start_step": 2,
                                             "end_step": 4}], method="compete"),
                   rank=0, quota=Fake, reason=lambda: None)
    for k in range(6):
        st.at_step(k)
        assert st.after_compute(k, 0.1) == 0.0       # nothing sleeps
    st.close()
    assert calls == [3.0, 1.0]
