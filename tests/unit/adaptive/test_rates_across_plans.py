"""Rates that do not depend on the plan (malleus_ds/adaptive/rates.py), on synthetic traces.

A rank's real compute per step is not ``layers x micro-batches`` alone: every micro-batch pays a
fixed cost (launches, the activation hand-off, Python), the first stage pays the embedding and
the last the head and loss. On 8 ranks the traces below switch among random plans (layers,
micro-batches, TP group size and stage position all change) while rank 5 stays 3x slow and the
host's speed drifts step to step. The true compute of rank d at step k is
``x_d * kappa_k * (A_d + beta * B_d + gamma * C_d) * noise`` with ``A`` the modelled work
(``cost_units``), ``B`` its first-stage micro-batches and ``C`` its micro-batches
(``cost_shape``); ``beta`` and ``gamma`` are unknown to the estimator. Required: every working
rank's rate within 10% of its true rate in every plan, once the window has refilled.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from malleus_ds.engine.tp_cost import slowdown_table
from malleus_ds.plan import Plan
from malleus_ds.adaptive.rates import RateEstimator
from malleus_ds.adaptive.work import cost_shape, cost_units
from malleus_ds.problem import ideal_slowdown
from tests.cases import random_plan

WORLD, TP, L, HEAD = 8, 4, 8, 0.3


def _plans(seed: int, n: int) -> list[Plan]:
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        p = Plan.from_json(random_plan(rng, WORLD, L=L, G=12))
        if not p.suspended:                      # every rank works (compute-measured)
            out.append(p)
    return out


def _trace(plans, beta, gamma, seed, steps_per_plan=12, slow=(5, 3.0), noise=0.05,
           true_sd=None, known_sd=None):
    """``true_sd``: the TP slowdown the hardware has (default ideal); ``known_sd``: the table
    the estimator is given (default ideal)."""
    rng = np.random.default_rng(seed)
    est = RateEstimator(WORLD, window=5)
    true = np.ones(WORLD)
    true[slow[0]] = slow[1]
    worst = []
    for p in plans:
        units = cost_units(p, WORLD, TP, known_sd or ideal_slowdown(TP), HEAD)
        work = cost_units(p, WORLD, TP, true_sd or ideal_slowdown(TP), HEAD)
        B, C = cost_shape(p, WORLD).T
        for k in range(steps_per_plan):
            kappa = rng.uniform(0.7, 1.4)                         # the host's speed this step
            c = true * kappa * (work + beta * B + gamma * C) * rng.uniform(1 - noise, 1 + noise,
                                                                         WORLD) * 0.01
            est.add(c, units, shape=(B, C))
            if k >= 7:
                r = est.rates()
                worst.append(float(np.max(np.abs(r / true - 1))))
    return max(worst)


@pytest.mark.parametrize("seed", range(6))
def test_rates_stay_within_10_percent_across_plans(seed):
    plans = _plans(seed, 6)
    assert _trace(plans, beta=1.5, gamma=0.8, seed=seed) <= 0.10


def test_without_fixed_costs_the_rates_are_exact_to_the_noise():
    assert _trace(_plans(11, 4), beta=0.0, gamma=0.0, seed=11, noise=0.0) <= 1e-6


def _tp_plans(seed: int, n: int) -> list[Plan]:
    """Random plans in which TP group sizes differ (the TP slowdown decides the rates)."""
    out = []
    for p in _plans(seed, 40):
        if len({st.tp for q in p.pipelines for st in q.stages}) > 1:
            out.append(p)
    assert len(out) >= n, "too few random plans with mixed TP sizes"
    return out[:n]


#: a TP slowdown far from ideal, as the tiny CPU model measures (tp/g -> slowdown)
TRUE_SD = {1: 1.0, 2: 1.6, 4: 2.4}


@pytest.mark.parametrize("seed", range(3))
def test_the_measured_tp_slowdown_keeps_rates_within_10_percent(seed):
    """The table ``tp_cost`` measures (times per group size: a quarter shard 1 ms, ...) gives
    plan-independent rates when TP groups change size; the ideal table tp/g does not."""
    times = {TP // k: 1e-3 * v for k, v in TRUE_SD.items()}        # group size -> seconds
    measured = slowdown_table(times, TP)
    assert measured == pytest.approx(TRUE_SD)
    plans = _tp_plans(seed, 6)
    assert _trace(plans, beta=1.5, gamma=0.8, seed=seed, true_sd=TRUE_SD,
                  known_sd=measured) <= 0.10
    assert _trace(plans, beta=1.5, gamma=0.8, seed=seed, true_sd=TRUE_SD) > 0.10


def _two_pipelines(pipes):
    return Plan.from_json({"version": 1, "num_layers": 4, "global_batch_size": 16,
                           "micro_batch_size": 2, "suspended": [],
                           "pipelines": [{"micro_batches": m,
                                          "stages": [{"ranks": [r], "layers": [a, b]}
                                                     for r, a, b in st]} for m, st in pipes]})


@pytest.mark.parametrize("seed", range(6))
def test_a_straggler_is_not_traded_for_its_healthy_twin(seed):
    """Issue 31 part 1 (bench/bench_rates.py, cell w4-pipe13-slow): two 2-stage pipelines of
    1 + 3 layers, rank 1 (a light first stage) 3x slow, rank 2 the same shape and healthy; the
    head costs 0.25 layer units where the model says 0.08 and the embedding 0.2 per
    micro-batch. With every distance capped alike, first-stage terms of ~2.5 layer units made
    the straggler agree and its healthy twin read 0.3 (recorded: 0.27-0.38 over 15 steps; here
    off by 0.67 in all 20 judged steps). A fast distance now costs more than a slow one."""
    rng = np.random.default_rng(seed)
    uniform = _two_pipelines([(2, [(r, 0, 4)]) for r in range(4)])
    pipes = _two_pipelines([(4, [(1, 0, 1), (0, 1, 4)]), (4, [(2, 0, 1), (3, 1, 4)])])
    est = RateEstimator(4, window=5)
    true = np.array([1.0, 3.0, 1.0, 1.0])
    errs = []
    for p, steps, held in ((uniform, 5, None), (pipes, 25, [False, True, False, False])):
        units = cost_units(p, 4, 1, {1: 1.0}, 0.08)
        work = cost_units(p, 4, 1, {1: 1.0}, 0.25)
        B, C = cost_shape(p, 4).T
        for k in range(steps):
            c = (true * (work + 0.2 * B) * rng.uniform(0.7, 1.4)
                 * np.exp(rng.normal(0, 0.02, 4)) * 0.01)
            est.add(c, units, shape=(B, C), held=held)
            if p is pipes and k >= 5:
                errs.append(np.abs(est.rates() / true - 1))
    assert np.max(errs) <= 0.10


def test_at_1024_ranks_the_fit_reads_a_sample_and_finds_what_the_full_fit_finds(monkeypatch):
    """1,024 ranks (tp 8, pp 8, dp 16) whose first stages pay 2 layers per micro-batch more than
    modelled, 2% noise: the fit over an even sample of 256 rank histories (FIT_COLUMNS) gives
    the rates a fit over all of them gives, within 2%, and every rank within 5% of its truth
    (rank 300 at rate 3)."""
    from malleus_ds.plan import static_plan

    p = static_plan(96, 512, 1, 8, 8, 16)
    world = 1024
    units = cost_units(p, world, 8, ideal_slowdown(8), 0.0)
    B, C = cost_shape(p, world).T
    true = np.ones(world)
    true[300] = 3.0

    def run(columns):
        monkeypatch.setattr(RateEstimator, "FIT_COLUMNS", columns)
        rng = np.random.default_rng(0)
        est = RateEstimator(world, window=5)
        for _ in range(12):
            c = true * (units + 2.0 * B) * rng.uniform(0.98, 1.02, world) * 0.01
            est.add(c, units, shape=(B, C))
        return est.rates(), est.beta

    sampled, beta = run(256)
    full, beta_full = run(4096)
    assert beta == pytest.approx(beta_full, abs=0.25) and beta > 1.0
    assert np.max(np.abs(sampled / full - 1)) <= 0.02
    assert np.max(np.abs(sampled / true - 1)) <= 0.05


def test_the_weighted_median_is_nanmedian_of_the_expanded_rows():
    import warnings

    from malleus_ds.adaptive.rates import _weighted_nanmedian

    rng = np.random.default_rng(1)
    for trial in range(200):
        K, U = rng.integers(1, 6), rng.integers(1, 9)
        r = rng.normal(size=(2, 3, K, U)).round(1)
        r[rng.random(r.shape) < 0.3] = np.nan
        w = rng.integers(1, 4, size=U) if trial % 2 else np.ones(U, dtype=int)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")        # all-NaN rows
            want = np.nanmedian(np.repeat(r, w, axis=-1), axis=-1, keepdims=True)
        assert np.allclose(_weighted_nanmedian(r, w.astype(float)), want, equal_nan=True)
