"""The capacity bound with slow links (``malleus_ds/capacity.py``): the compute bound without
them, smaller as a link slows where the work must cross it, each of its branches on paper, and
never beaten: no plan the planner, the static layout or the cut at the link finds runs faster
than the bound's step time, on problems where the link binds."""
from __future__ import annotations

import pytest

from malleus_ds.capacity import compute_step, link_capacity
from malleus_ds.cost import capacity_fraction, step_time
from malleus_ds.planner import plan
from malleus_ds.planner.links import across_slow_links
from malleus_ds.problem import Problem


def _problem(link=4.0, rates=None, act=16.0, grad=400.0, layer_ms=20.0, nodes=2, gpn=4,
             layers=8, gbs=16):
    d = {"version": 1, "name": "t", "cluster": {"nodes": nodes, "gpus_per_node": gpn},
         "model": {"num_layers": layers},
         "training": {"global_batch_size": gbs, "micro_batch_size": 1, "tp": 1, "pp": 1,
                      "dp": nodes * gpn},
         "comm": {"layer_ms": layer_ms, "activation_mb": act, "intra_node_gbps": 200.0,
                  "inter_node_gbps": 25.0, "grad_mb": grad},
         "rates": {str(k): v for k, v in (rates or {}).items()}}
    if link > 1:
        d["link_rates"] = {"0-1": link}
    return Problem.from_json(d)


def test_without_a_slow_link_it_is_the_compute_bound():
    for rates in ({}, {3: 4.0}, {0: 2.0, 5: 3.0}):
        pr = _problem(link=1.0, rates=rates)
        assert link_capacity(pr) == pytest.approx(capacity_fraction(pr))


def test_the_branches_on_paper():
    # 2 nodes x 4, 8 layers, 16 micro-batches: T_c = 2 micro-batches x 8 layers = 16 units,
    # W = 8 x 16 = 128 GPU-units; c_A = c_B = 4; the cut carries 25 / rate MB/ms, 20 ms a unit
    pr = _problem(link=100.0, act=100.0, grad=400.0)
    assert compute_step(pr) == pytest.approx(16.0)
    per_mb = 1 / (25.0 / 100.0) / 20.0                       # 0.2 units per MB
    one_side = 128 / 4                                       # 32
    pipe = max(128 / 8, 16 * 100.0 * per_mb)                 # activations: 320
    dp = min(max((1 - k / 8) * 128 / 4, (k / 8) * 128 / 4, k * 400.0 * per_mb)
             for k in range(1, 9))                           # k=1: max(28, 4, 80) = 80
    assert min(one_side, pipe, dp) == 32
    assert link_capacity(pr) == pytest.approx(16.0 / 32)
    # a fast enough link: the pipeline across it binds at the compute bound
    assert link_capacity(_problem(link=2.0, act=1.0)) == pytest.approx(1.0)
    # slower links never raise the bound
    caps = [link_capacity(_problem(link=r, act=200.0, grad=800.0)) for r in (1, 2, 8, 32, 128)]
    assert caps == sorted(caps, reverse=True) and caps[-1] < caps[0], caps


@pytest.mark.parametrize("link,act,grad,rates", [
    (4.0, 16.0, 400.0, {}), (20.0, 64.0, 200.0, {}), (50.0, 40.0, 100.0, {2: 3.0}),
    (8.0, 200.0, 800.0, {6: 2.0})])
def test_no_plan_beats_the_bound(link, act, grad, rates):
    _no_plan_beats_the_bound(_problem(link=link, act=act, grad=grad, rates=rates))


def _no_plan_beats_the_bound(pr: Problem) -> None:
    """The static layout, the planner's plan and the cut at the links all run at least the
    bound's step time."""
    bound_step = compute_step(pr) / link_capacity(pr)
    plans = [pr.static_plan(), plan(pr, seed=0, time_limit=2.0).plan]
    cut = across_slow_links(pr)
    if cut is not None:
        plans.append(cut)
    for p in plans:
        assert step_time(pr, p) >= bound_step * (1 - 1e-9), (p.describe(), bound_step)


def _three_sides(rates=None, act=40.0, grad=400.0, links=None):
    """3 nodes of 4; the links 0-1 and 1-2 slow, 0-2 healthy: sides {0, 2} and {1}; with 0-2
    slow too: three sides."""
    d = _problem(nodes=3, gpn=4, gbs=24, act=act, grad=grad, rates=rates, link=1.0).to_json()
    d["link_rates"] = links or {"0-1": 30.0, "1-2": 30.0}
    return Problem.from_json(d)


@pytest.mark.parametrize("links,rates", [
    ({"0-1": 30.0, "1-2": 30.0}, {}), ({"0-1": 30.0, "1-2": 30.0, "0-2": 30.0}, {}),
    ({"0-1": 8.0, "1-2": 60.0, "0-2": 20.0}, {4: 3.0}),
    ({"0-1": 100.0, "1-2": 100.0, "0-2": 100.0}, {0: 2.0})])
def test_three_sides_bound_every_plan_and_tighten_the_compute_bound(links, rates):
    """Every split of the sides in two is a cut; the bound is the tightest of them: below f
    where the links bind, and still never beaten by the planner, the static layout or the
    cut at the links."""
    from malleus_ds.capacity import segments

    pr = _three_sides(rates, links=links)
    assert len(segments(pr)) >= 2 and link_capacity(pr) <= capacity_fraction(pr) + 1e-12
    _no_plan_beats_the_bound(pr)


def test_three_sides_on_paper():
    """Three sides of 4 GPUs, every link 100x slow. Every split puts one side (c = 4) against
    the other two (c = 8, its inside link read as healthy) over one link: 25 / 100 MB/ms, 0.2
    units a MB at 20 ms a unit. T_c = 8 layers x 2 micro-batches = 16, W = 12 x 16 = 192. One
    side only: 192 / 8 = 24 on the larger; every micro-batch crossing: 24 x 100 MB x 0.2 = 480;
    a layer shared: at least its 400 MB of gradients, 80. The least is 24, for every split:
    the bound is 16 / 24 where the compute bound says 1."""
    pr = _three_sides(act=100.0, links={"0-1": 100.0, "1-2": 100.0, "0-2": 100.0})
    assert compute_step(pr) == pytest.approx(16.0)
    assert link_capacity(pr) == pytest.approx(16.0 / 24.0)
