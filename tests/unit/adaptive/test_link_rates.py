"""Link attribution from synthetic timings (``adaptive/link_rates.py``): a slow link reads as a
slow link and not as slow GPUs; a slow GPU as a slow GPU and not as slow links; both at once as
both. 4 nodes x 2 ranks: data-parallel rings within and across nodes, pipeline sends between
nodes; a slow link multiplies the seconds of every op that crosses it, a slow GPU those of the
ops it takes part in (its peers wait for it) and its compute."""
from __future__ import annotations

import numpy as np
import pytest

from malleus_ds.adaptive.link_rates import CommOp, LinkEstimator, links_crossed

GPN = 2


def node_of(r: int) -> int:
    return r // GPN


#: a plan's communication: the DP rings of two 4-rank groups across node pairs (0,1) / (2,3),
#: one 8-rank ring over every node, pipeline sends 1->2, 3->4, 5->6, 7->0, and intra-node TP
OPS = ([("dp", (0, 1, 2, 3), 50.0), ("dp", (4, 5, 6, 7), 50.0),
        ("dp", (0, 2, 4, 6), 50.0)]
       + [("p2p", (a, b), 4.0) for a, b in ((1, 2), (3, 4), (5, 6), (7, 0))]
       + [("tp", (2 * n, 2 * n + 1), 8.0) for n in range(4)])
SPEED = {("dp", True): 0.08, ("dp", False): 0.01, ("p2p", True): 0.05, ("tp", False): 0.005}


def _step(rng, slow_links=None, slow_gpus=None):
    """One step's ops (seconds = MB x healthy seconds per MB x the slowest link crossed x the
    slowest GPU taking part, +-3% noise) and the compute rates."""
    slow_links, slow_gpus = slow_links or {}, slow_gpus or {}
    ops = []
    for kind, ranks, mb in OPS:
        links = links_crossed(ranks, node_of)
        t = mb * SPEED[(kind, bool(links))]
        t *= max([slow_links.get(ln, 1.0) for ln in links] + [1.0])
        t *= max([slow_gpus.get(r, 1.0) for r in ranks] + [1.0])
        ops.append(CommOp(kind, ranks, mb, t * rng.uniform(0.97, 1.03)))
    compute = np.ones(8)
    for r, v in slow_gpus.items():
        compute[r] = v
    return ops, compute


def _run(**slow) -> dict:
    rng = np.random.default_rng(0)
    est = LinkEstimator(node_of, window=8)
    for _ in range(30):                      # healthy: the references are learned
        est.add(*_step(rng))
    assert all(v < 1.1 for v in est.rates().values()), est.rates()
    for _ in range(20):
        est.add(*_step(rng, **slow))
    return est.rates()


def test_attribute_explains_slowness_away():
    from malleus_ds.adaptive.link_rates import attribute

    a, b, c = (0, 1), (1, 2), (2, 3)
    # a ring over a, b, c reads 4; a send over a alone reads 4: a is slow, b and c say nothing
    assert attribute([(frozenset({a, b, c}), 4.0), (frozenset({a}), 4.0)]) == {a: 4.0}
    # ...and a send over b alone reading 1 pins b healthy
    assert attribute([(frozenset({a, b, c}), 4.0), (frozenset({a}), 4.0),
                      (frozenset({b}), 1.0)]) == {a: 4.0, b: 1.0}
    # no single-link op: the ring speaks for every link it crosses (a least-slowdown bound)
    assert attribute([(frozenset({a, b}), 2.0)]) == {a: 2.0, b: 2.0}


def test_links_crossed():
    assert links_crossed((1, 2), node_of) == {(0, 1)}
    assert links_crossed((0, 1), node_of) == frozenset()
    assert links_crossed((0, 2, 4, 6), node_of) == {(0, 1), (1, 2), (2, 3), (0, 3)}


def test_a_slow_link_reads_as_the_link():
    got = _run(slow_links={(1, 2): 4.0})
    assert got[(1, 2)] == pytest.approx(4.0, rel=0.08)
    assert all(v < 1.1 for ln, v in got.items() if ln != (1, 2)), got


def test_a_slow_gpu_reads_as_the_gpu_not_as_links():
    """Rank 4's compute rate is 3 and every op it takes part in waits for it: those ops are
    left out, and every link reads healthy from the ops without it; link (1, 2), which only ops
    with rank 4 cross, is not measured rather than read slow."""
    got = _run(slow_gpus={4: 3.0})
    assert all(v < 1.1 for v in got.values()), got
    assert (1, 2) not in got and {(0, 1), (2, 3), (0, 3)} <= set(got)


def test_both_at_once_read_as_both():
    """Link (0, 1) 3x slow and rank 5 2.5x slow: the link reads 3; link (2, 3), which only the
    8-rank ring crosses without rank 5 (and that ring is slow through link (0, 1), pinned by
    the send 1->2 across it alone), is explained away, not read slow."""
    got = _run(slow_links={(0, 1): 3.0}, slow_gpus={5: 2.5})
    assert got[(0, 1)] == pytest.approx(3.0, rel=0.08)
    assert all(v < 1.1 for ln, v in got.items() if ln != (0, 1)), got
    assert (2, 3) not in got


def test_two_nodes_one_link_reads_against_its_healthy_past():
    """Two nodes have one link, which every cross-node op crosses: the reference is what it
    took while healthy, and a long slow spell does not become the reference."""
    def node2(r):
        return r // 2
    rng = np.random.default_rng(1)
    est = LinkEstimator(node2, window=8, history=64)
    ops = [("dp", (0, 1, 2, 3), 50.0), ("p2p", (1, 2), 4.0)]

    def step(rate):
        return [CommOp(k, r, mb, mb * 0.05 * rate * rng.uniform(0.97, 1.03)) for k, r, mb in ops]
    for _ in range(20):
        est.add(step(1.0))
    for _ in range(200):                       # far longer than the history
        est.add(step(4.0))
    assert est.rates()[(0, 1)] == pytest.approx(4.0, rel=0.08)
    for _ in range(10):
        est.add(step(1.0))
    assert est.rates()[(0, 1)] < 1.1


def test_a_probe_learns_healthy_links_and_says_recovered_or_not_and_never_by_how_much():
    """Probes learn from healthy links only. A link believed 10x slow whose probe reads 4x
    (a small message) reads the belief while the probe reads slow, and 1.0 once it does not;
    a reduction's reading is never quantised."""
    est = LinkEstimator(node_of, window=3, healthy=2.0, recovery_kinds=("probe",))
    for _ in range(12):                       # healthy probes: the reference
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.01)])
    assert est.rates()[(0, 1)] == 1.0
    slow = {(0, 1): 10.0}
    for _ in range(3):                        # the link held as 10x slow; the probe reads 4x
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.04)], believed=slow)
    assert est.rates()[(0, 1)] == 10.0
    for _ in range(3):                        # nothing learned while held: still the belief
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.025)], believed=slow)
    assert est.rates()[(0, 1)] == 10.0
    for _ in range(3):                        # the probe at its healthy speed: recovered
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.011)], believed=slow)
    assert est.rates()[(0, 1)] == 1.0
    assert est.seconds_per_mb("probe", True) == pytest.approx(0.01)
    for _ in range(3):             # held at 2.5, the probe reads 6: it says 6, not the belief
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.06)], believed={(0, 1): 2.5})
    assert est.rates()[(0, 1)] == pytest.approx(6.0)
    plain = LinkEstimator(node_of, window=3, healthy=2.0, recovery_kinds=("probe",))
    for _ in range(12):
        plain.add([CommOp("dp", (0, 1, 2, 3), 3.0, 3.0 * 0.01)])
    for _ in range(3):
        plain.add([CommOp("dp", (0, 1, 2, 3), 3.0, 3.0 * 0.037)])
    assert plain.rates()[(0, 1)] == pytest.approx(3.7)


def test_a_held_link_recovers_on_two_quick_probes_against_its_healthy_or_held_level():
    """Held at 40x, the probes read 40x; freed on a loaded host they read 3-5x (above the
    absolute bar of 2): two of them in the window, under the held level over 2, say
    recovered. A single quick one does not."""
    est = LinkEstimator(node_of, window=5, healthy=2.0, recovery_kinds=("probe",))
    for _ in range(12):
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.01)])
    held = {(0, 1): 40.0}
    for _ in range(6):
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.4)], believed=held)
    assert est.rates()[(0, 1)] == pytest.approx(40.0)
    est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.04)], believed=held)      # one quick: 4x
    assert est.rates()[(0, 1)] == pytest.approx(40.0)
    for _ in range(4):
        est.add([CommOp("probe", (0, 2), 0.2, 0.2 * 0.05)], believed=held)  # 5x: recovered
    assert est.rates()[(0, 1)] == 1.0
