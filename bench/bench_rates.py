#!/usr/bin/env python
"""Where the measured rates' bias comes from (issue 31 part 1, "Rates that hold on any plan").

A healthy rank should read 1.0 ± 0.1 whatever its share (few layers or many, one micro-batch
or many, the head stage, just re-admitted, next to a suspended rank) and a slowed rank its true
rate ± 15%. This bench runs a matrix of cells, each one short training run of the ``tiny``
4 × 256 model (seq 128, micro-batch 2) with a scripted switch (``malleus.switch``) to the cell's
plan, with nobody slowed or rank 1 slowed, and records per step what the adaptive loop's
estimator is fed: every rank's compute seconds and probe reading from the step's all-reduce
(``StepSums``, taken inside ``Controller.observe`` by a hook: metrics.jsonl's ``compute_s`` of a
probing rank also holds its probe), each rank's CPU seconds inside its compute spans
(``time.thread_time``: wall minus CPU is time the rank waited for a core yet counted as
compute) and the live reading. It then replays the recordings through
``malleus_ds.adaptive.rates.RateEstimator`` exactly as ``control.py`` feeds it (:func:`replay`:
``cost_units`` with the model's head units, ``cost_shape``, window 5, the first step of the run
and of each plan left out, held ranks from the reading at the switch) and reports per cell and
rank the steady reading (median, worst |reading − true| once the window holds the plan's steps),
then the same with one factor taken out at a time:

* ``noshape``: no fitted per-micro-batch terms (``shape=None``);
* ``nohead``: no head units;
* ``cpu``: CPU seconds instead of wall (the emulated sleep scaled back in): no waiting for a
  core counted as compute;
* 2-rank cells against the same plans on 4 ranks (2 cores: 4 ranks are oversubscribed);
* the per-micro-batch fixed costs measured directly (least squares over every healthy cell's
  median CPU seconds: layers × micro-batches, head, first-stage and per-micro-batch terms), and
  each share's per-step noise against its compute seconds per step.

    .venv/bin/python bench/bench_rates.py --out /tmp/rates --record tests/fixtures/rate_matrix.json
    .venv/bin/python bench/bench_rates.py --replay /tmp/rates/cells.json     # no processes
    .venv/bin/python bench/bench_rates.py --cells w4-pipe13-slow,w2-pipe13   # a few cells
    .venv/bin/python bench/bench_rates.py --replay tests/fixtures/rate_matrix.json

``--out``'s ``cells.json`` grows cell by cell (a rerun skips the cells it holds); a ``quota``
cell first runs ``python -m malleus_ds.emulation.cpu_quota --calibrate`` for its true rate.

The replay (:func:`replay`, :func:`steady`) is what ``tests/unit/adaptive/test_rate_matrix.py`` runs on
the recorded fixture. Results: bench/RESULTS.md; findings: docs/DESIGN.md §6.
"""
from __future__ import annotations

import argparse
import json
import warnings
import os
import re
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
warnings.filterwarnings("ignore", "All-NaN|Degrees of freedom|Mean of empty", RuntimeWarning)

from malleus_ds.plan import Plan  # noqa: E402
from malleus_ds.adaptive.detect import HEALTHY
from malleus_ds.adaptive.held import HOLD, held_ranks
from malleus_ds.adaptive.rates import RateEstimator, as_list
from malleus_ds.adaptive.work import cost_shape, cost_units

LAYERS, HIDDEN, HEADS, SEQ, MBS = 4, 256, 4, 128, 2
MODEL = ["model=tiny", f"model.num_layers={LAYERS}", f"model.hidden_size={HIDDEN}",
         f"model.num_heads={HEADS}", f"model.max_seq_len={SEQ}",
         f"train.micro_batch_size={MBS}"]
WINDOW = 5            # DetectConfig.window, the estimator's window in control.py
SWITCH_AT = 3         # the scripted switch to the cell's plan
STEPS = 30


def head_units() -> float:
    """The head's work in layer units for the bench's model, as ``control.py`` computes it."""
    from malleus_ds.models.base import head_layer_units, param_table
    from malleus_ds.models.llama import PRESETS

    cfg = PRESETS["tiny"].__class__("tiny", hidden_size=HIDDEN, num_heads=HEADS,
                                    num_layers=LAYERS, max_seq_len=SEQ)
    return head_layer_units(param_table(cfg), SEQ, HIDDEN)


# ------------------------------------------------------------------------------- the cells


def plan(world: int, pipes, suspended=()) -> Plan:
    """``pipes``: ``[(micro_batches, [(rank, first layer, end layer), ...]), ...]``."""
    return Plan.from_json({
        "version": 1, "num_layers": LAYERS, "global_batch_size": 2 * MBS * world,
        "micro_batch_size": MBS, "suspended": list(suspended),
        "pipelines": [{"micro_batches": m, "stages": [{"ranks": [r], "layers": [a, b]}
                                                      for r, a, b in st]}
                      for m, st in pipes]})


def _dp(world, mbs):
    return [(m, [(r, 0, LAYERS)]) for r, m in enumerate(mbs)]


#: the plans, by world size (global batch 8 micro-batches on 4 ranks, 4 on 2: the same work
#: per rank). Rank 1 is the one the plans single out (and the one slowed in "-slow" cells).
PLANS = {
    4: {
        "uniform": _dp(4, [2, 2, 2, 2]),
        # 2-stage pipelines of 1 + 3 layers: rank 1 (and 2) the light first stage (embedding),
        # rank 0 (and 3) the heavy last stage (3 layers + head)
        "pipe13": [(4, [(1, 0, 1), (0, 1, 4)]), (4, [(2, 0, 1), (3, 1, 4)])],
        # the head stage: rank 1 (and 3) the last stage with 1 layer + head
        "head": [(4, [(0, 0, 3), (1, 3, 4)]), (4, [(2, 0, 3), (3, 3, 4)])],
        # one micro-batch (rank 1) vs three (rank 0)
        "mb1": _dp(4, [3, 1, 2, 2]),
        # many micro-batches (rank 1: five) vs one
        "mb5": _dp(4, [1, 5, 1, 1]),
        # the planner's plan for rank 1 at 3.3 (the measurement)
        "planner": [(2, [(1, 0, 1), (0, 1, 4)]), (3, [(2, 0, 4)]), (3, [(3, 0, 4)])],
        # next to a suspended rank (3)
        "suspended": _dp(4, [3, 2, 3]),
    },
    2: {
        "uniform": _dp(2, [2, 2]),
        "pipe13": [(4, [(1, 0, 1), (0, 1, 4)])],
        "head": [(4, [(0, 0, 3), (1, 3, 4)])],
        "mb1": _dp(2, [3, 1]),
    },
}
SUSPENDED = {"suspended": (3,)}


@dataclass(frozen=True)
class Cell:
    name: str
    world: int
    plans: tuple[Plan, ...]              # plans[0] runs from step 0
    switches: tuple[tuple[int, int], ...]   # (step, index into plans): scripted switches
    slow: dict = field(default_factory=dict)   # rank -> configured rate
    method: str = "sleep"
    steps: int = STEPS
    judge_from: int = SWITCH_AT + WINDOW   # first step judged (the window holds the plan)
    true: tuple[float, ...] = ()         # true rate per rank (quota: calibrated)


def cells() -> dict[str, Cell]:
    out = {}
    for world, plans in PLANS.items():
        for name, pipes in plans.items():
            p = plan(world, pipes, SUSPENDED.get(name, ()))
            u = plan(world, PLANS[world]["uniform"])
            for slow in ({}, {1: 3.0}):
                tag = f"w{world}-{name}" + ("-slow" if slow else "")
                if name == "uniform":
                    c = Cell(tag, world, (u,), (), slow, judge_from=WINDOW)
                else:
                    c = Cell(tag, world, (u, p), ((SWITCH_AT, 1),), slow)
                out[tag] = c
    # just re-admitted: suspended from step 3, back to uniform at 18; judged from the first step
    # the re-admitted rank is measured (a just re-admitted rank is read from its first steps)
    u, s = plan(4, PLANS[4]["uniform"]), plan(4, PLANS[4]["suspended"], (3,))
    for slow in ({}, {1: 3.0}):
        tag = "w4-readmit" + ("-slow" if slow else "")
        out[tag] = Cell(tag, 4, (u, s), ((SWITCH_AT, 1), (18, 0)), slow, steps=34,
                        judge_from=19)
    # real slowdowns (a CPU quota): the true rate is calibrated (--calibrate), not configured
    for world, name in ((2, "uniform"), (2, "pipe13"), (4, "uniform")):
        tag = f"w{world}-{name}-quota"
        base = out[f"w{world}-{name}-slow"]
        out[tag] = Cell(tag, world, base.plans, base.switches, {1: 3.0}, "quota",
                        judge_from=base.judge_from)
    return out


# ---------------------------------------------------------------- inside each rank (--child)


def child(argv: list[str]) -> None:
    """Run ``launch/train.py`` with ``argv`` under hooks that record, per step, what the
    estimator is fed (rank 0: the all-reduced compute and probe seconds, the units, held ranks,
    the live reading) and each rank's CPU seconds inside its compute spans, to
    ``$BENCH_RATES_OUT/rank<d>.jsonl``. Nothing in the run changes (a few µs per span)."""
    import runpy

    from malleus_ds.engine import clock as clk
    from malleus_ds.adaptive import control

    out = Path(os.environ["BENCH_RATES_OUT"])
    rank = int(os.environ.get("RANK", "0"))
    f = open(out / f"rank{rank}.jsonl", "w", buffering=1)
    C = clk.ComputeClock
    o_compute, o_excluded, o_start = C.compute, C.excluded, C.start_step

    @contextmanager
    def compute(self):
        t0, x0 = time.thread_time(), getattr(self, "_b_ex", 0.0)
        with o_compute(self):
            yield
        self._b_cpu = getattr(self, "_b_cpu", 0.0) + (time.thread_time() - t0) - (
            getattr(self, "_b_ex", 0.0) - x0)

    @contextmanager
    def excluded(self):
        outer, t0 = self._ex_depth == 0, time.thread_time()
        with o_excluded(self):
            yield
        if outer:
            self._b_ex = getattr(self, "_b_ex", 0.0) + time.thread_time() - t0

    def start_step(self, step):
        self._b_cpu = self._b_ex = 0.0
        return o_start(self, step)

    C.compute, C.excluded, C.start_step = compute, excluded, start_step
    o_observe = control.Controller.observe

    def observe(self, step, sums):
        ck = self.probing.block.engine.clock   # the loop reads no engine; its probe block does
        rec = {"step": int(step), "skip": bool(self.skip_steps),
               "cpu": getattr(ck, "_b_cpu", 0.0), "wall": float(ck.compute_s),
               "emu": float(ck.emulated_s)}
        if self.rank == 0:
            rec.update(compute=[float(x) for x in sums.compute_s],
                       probe=[None if not np.isfinite(x) or x <= 0 else float(x)
                              for x in sums.probe_s],
                       units=[float(x) for x in self.units],
                       held=[bool(x) for x in self.held], plan=self.plan.id,
                       beta_gamma=None)
        res = o_observe(self, step, sums)
        if self.rank == 0:
            rec["measured"] = as_list(self.measured)
            rec["beta_gamma"] = [self.est.beta, self.est.gamma]
        f.write(json.dumps(rec) + "\n")
        return res

    control.Controller.observe = observe
    train = str(REPO / "launch" / "train.py")
    sys.argv = [train, *argv]
    runpy.run_path(train, run_name="__main__")


# ------------------------------------------------------------------------------- running


def run_cell(c: Cell, d: Path, overrides=()) -> dict:
    """One training run of cell ``c`` in ``d``; returns its recording (:func:`assemble`)."""
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("rank*.jsonl"):
        f.unlink()
    c.plans[0].save(d / "plan_start.json")
    sw = []
    for step, i in c.switches:
        path = d / f"plan{i}.json"
        c.plans[i].save(path)
        sw.append(f"{{step:{step},plan:{path}}}")
    sched = ",".join(f"{{rank:{r},rate:{x}}}" for r, x in c.slow.items())
    over = [*MODEL, f"train.global_batch_size={c.plans[0].global_batch_size}",
            f"train.steps={c.steps}", "train.warmup_steps=2", "progress=false",
            f"straggler.schedule=[{sched}]", f"straggler.method={c.method}",
            f"hydra.run.dir={d}", "engine=malleus", "deepspeed=zero1",
            f"malleus.switch=[{','.join(sw)}]", "malleus.adaptive=false",
            f"plan={d / 'plan_start.json'}",
            *overrides]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={c.world}", str(Path(__file__).resolve()), "--child", *over]
    env = dict(os.environ, OMP_NUM_THREADS="1", BENCH_RATES_OUT=str(d))
    env.setdefault("DS_ACCELERATOR", "cpu")
    t0 = time.time()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (d / "stderr.txt").write_text(p.stderr[-20000:])
    if p.returncode != 0 and not (d / f"rank{c.world - 1}.jsonl").exists():
        raise SystemExit(f"cell {c.name} failed (code {p.returncode}):\n{' '.join(cmd)}\n"
                         f"{p.stderr[-3000:]}")
    rec = assemble(c, d)
    rec["seconds"] = round(time.time() - t0, 1)
    return rec


def assemble(c: Cell, d: Path) -> dict:
    """The cell's recording from the per-rank hook files: per observed step the plan index,
    every rank's compute and CPU seconds (ms), the probe readings (sparse) and the live
    reading; plus the plans, the switches and the true rates."""
    rows = [json.loads(x) for x in (d / "rank0.jsonl").read_text().splitlines() if x.strip()]
    per = [{r["step"]: r for r in (json.loads(x) for x in
                                   (d / f"rank{k}.jsonl").read_text().splitlines() if x.strip())}
           for k in range(c.world)]
    ids = [p.id for p in c.plans]
    plan_at, compute, cpu, emu, live, probes, skip, units, bg = [], [], [], [], [], {}, [], [], []
    for i, r in enumerate(rows):
        s = r["step"]
        plan_at.append(ids.index(r["plan"]))
        compute.append([round(1e3 * x, 3) for x in r["compute"]])
        cpu.append([round(1e3 * per[k][s]["cpu"], 3) for k in range(c.world)])
        emu.append([round(1e3 * per[k][s]["emu"], 3) for k in range(c.world)])
        live.append(r["measured"])
        skip.append(r["skip"])
        units.append(r["units"])
        bg.append(r["beta_gamma"])
        pr = {k: round(1e3 * x, 4) for k, x in enumerate(r["probe"]) if x is not None}
        if pr:
            probes[str(i)] = pr
    true = list(c.true) or [c.slow.get(k, 1.0) for k in range(c.world)]
    return {"name": c.name, "world": c.world, "method": c.method, "slow": c.slow, "true": true,
            "plans": [p.to_json() for p in c.plans],
            "switches": [list(x) for x in c.switches], "judge_from": c.judge_from,
            "steps": [r["step"] for r in rows], "plan_at": plan_at, "compute_ms": compute,
            "probe_ms": probes, "cpu_ms": cpu, "emu_ms": emu, "live": live, "skip": skip,
            "units": units, "beta_gamma": bg}


# ------------------------------------------------------------------------------- the replay


def replay(rec: dict, *, head: float | None = None, shape: bool = True, window: int = WINDOW,
           source: str = "compute", estimator=RateEstimator, est_kw=None) -> np.ndarray:
    """Readings per observed step (rows) and rank, as ``control.py`` computes them from this
    recording: ``RateEstimator(world, window)`` (never reset), ``add(compute, cost_units,
    probe, shape=cost_shape, held)`` then ``rates(floor)`` every step, the first step of the
    run and of each plan left out (NaN row), and at each switch the held ranks and their floor
    from the reading then (a scripted switch carries no rates: ``Controller.switched``).

    ``head``: the head's layer units (default: the recording's, as the controller's);
    ``shape=False``: no per-micro-batch terms; ``source``: ``compute`` (wall seconds, as fed)
    or ``cpu`` (CPU seconds in the compute spans; a slept rank's sleep scaled back in);
    ``estimator`` / ``est_kw``: another estimator class or keyword arguments (a candidate fix).
    """
    world = rec["world"]
    h = (rec["head"] if "head" in rec else head_units()) if head is None else head
    plans = [Plan.from_json(p) for p in rec["plans"]]
    est = estimator(world, window, **(est_kw or {}))
    units = shp = None
    held = np.zeros(world, dtype=bool)
    floor = np.zeros(world)
    measured = np.full(world, np.nan)
    cur, skip = None, 0
    out = np.full((len(rec["steps"]), world), np.nan)
    for i, k in enumerate(rec["plan_at"]):
        if k != cur:
            p = plans[k]
            units = cost_units(p, world, 1, {1: 1.0}, h)
            shp = tuple(cost_shape(p, world).T)
            if cur is not None:             # Controller.switched(plan, rates=None)
                rates = as_list(measured)
                held = held_ranks(units, rates, max(HOLD, HEALTHY))   # RunningWork.hold
                floor = np.where(held, [0.0 if r is None else r for r in rates], 0.0)
            cur, skip = k, 1
        if skip:
            skip -= 1
            continue
        c = np.asarray(rec["compute_ms"][i], dtype=float) / 1e3
        if source == "cpu":
            c = cpu_seconds(rec, i)
        pr = np.full(world, np.nan)
        for d, x in rec["probe_ms"].get(str(i), {}).items():
            pr[int(d)] = x / 1e3
        est.add(c, units, pr, shape=shp if shape else None, held=held)
        measured = est.rates(floor=floor)
        out[i] = measured
    return out


def cpu_seconds(rec: dict, i: int) -> np.ndarray:
    """Row ``i``'s CPU seconds in the compute spans, a slept rank's sleep scaled back in (×
    wall / (wall − sleep)); a compact fixture stores them scaled already (no ``emu_ms``)."""
    cpu = np.asarray(rec["cpu_ms"][i], dtype=float)
    if "emu_ms" in rec:
        wall = np.asarray(rec["compute_ms"][i], dtype=float)
        emu = np.asarray(rec["emu_ms"][i], dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            cpu = cpu * np.where(emu > 0, wall / np.maximum(wall - emu, 1e-9), 1.0)
    return cpu / 1e3


def judged(rec: dict) -> np.ndarray:
    """Row mask of the judged steps (from ``judge_from``; a re-admission cell: after it)."""
    return np.asarray(rec["steps"]) >= rec["judge_from"]


def working(rec: dict) -> np.ndarray:
    """Ranks with work under the cell's last plan."""
    p = Plan.from_json(rec["plans"][rec["plan_at"][-1]])
    return np.isin(np.arange(rec["world"]), p.active_ranks)


def steady(rec: dict, readings: np.ndarray) -> list[dict]:
    """Per rank: the median reading over the judged steps and the worst error (absolute for a
    healthy rank, relative for a slowed one), with the bound the issue sets (0.1 / 15%)."""
    m = judged(rec)
    true = np.asarray(rec["true"], dtype=float)
    out = []
    for d in range(rec["world"]):
        r = readings[m, d]
        r = r[np.isfinite(r)]
        if not r.size:
            out.append({"rank": d, "median": None, "worst": None, "ok": None})
            continue
        slow = true[d] >= HEALTHY
        err = np.abs(r / true[d] - 1) if slow else np.abs(r - true[d])
        bound = 0.15 if slow else 0.10
        out.append({"rank": d, "true": float(true[d]), "median": float(np.median(r)),
                    "lo": float(r.min()), "hi": float(r.max()), "worst": float(err.max()),
                    "bound": bound, "ok": bool(err.max() <= bound)})
    return out


def raw_noise(rec: dict) -> list[dict]:
    """Per working rank under the last plan: its median compute (and CPU) ms per step, and the
    per-step spread of its per-unit time over its step's median (log-sd, unsmoothed) from wall
    and from CPU seconds: how noisy one step of this share is, before the window's median."""
    world = rec["world"]
    m = judged(rec)
    p = Plan.from_json(rec["plans"][rec["plan_at"][-1]])
    h = rec["head"] if "head" in rec else head_units()
    u = cost_units(p, world, 1, {1: 1.0}, h)
    act = u > 0
    out = []
    rows = np.flatnonzero(m)
    for src in ("compute_ms", "cpu_ms"):
        if src == "cpu_ms" and "cpu_ms" not in rec:
            x = np.full((rows.size, world), np.nan)
        else:
            x = np.asarray(rec[src], dtype=float)[m] if src == "compute_ms" else \
                np.stack([1e3 * cpu_seconds(rec, i) for i in rows])
        x = np.where(act, x, np.nan)
        t = x / np.where(act, u, 1)
        t = t / np.nanmedian(t, axis=1, keepdims=True)
        lg = np.log(t)
        out.append({"src": src, "ms": np.nanmedian(x, axis=0),
                    "logsd": np.nanstd(lg - np.nanmedian(lg, axis=0), axis=0)})
    res = []
    for d in range(world):
        if act[d]:
            res.append({"rank": d, "ms": float(out[0]["ms"][d]), "cpu_ms": float(out[1]["ms"][d]),
                        "sd_wall": float(out[0]["logsd"][d]), "sd_cpu": float(out[1]["logsd"][d])})
    return res


def fixed_costs(recs: list[dict], source: str = "cpu_ms", world: int | None = None) -> dict:
    """Least squares over every healthy cell's per-rank median seconds (``source``) per step:
    ``a·(layers × micro-batches) + h·(micro-batches of a last stage) + b·(micro-batches of a
    first stage) + g·micro-batches``; returns the head, first-stage and per-micro-batch terms
    in layer units (h/a, b/a, g/a) and the fit's relative residual."""
    X, y = [], []
    for rec in recs:
        if rec["slow"] or rec["method"] != "sleep" or (world and rec["world"] != world):
            continue
        m = judged(rec)
        p = Plan.from_json(rec["plans"][rec["plan_at"][-1]])
        x = np.asarray(rec["compute_ms"], dtype=float) if source == "compute_ms" else \
            np.stack([1e3 * cpu_seconds(rec, i) for i in range(len(rec["steps"]))])
        v = np.median(x[m], axis=0)
        for pipe in p.pipelines:
            for j, st in enumerate(pipe.stages):
                last = j == len(pipe.stages) - 1
                for r in st.ranks:
                    X.append([st.num_layers * pipe.micro_batches,
                              pipe.micro_batches if last else 0,
                              pipe.micro_batches if j == 0 else 0, pipe.micro_batches])
                    y.append(v[r])
    X, y = np.asarray(X, float), np.asarray(y, float)
    # relative errors: weight each row by 1/y
    w = 1 / y
    coef, *_ = np.linalg.lstsq(X * w[:, None], y * w, rcond=None)
    a, h, b, g = coef
    res = (X @ coef - y) / y
    return {"layer_ms": float(a), "head": float(h / a), "first": float(b / a),
            "per_mb": float(g / a), "rows": int(len(y)), "resid": float(np.sqrt(np.mean(res**2)))}


# ---------------------------------------------------------------------------- the report


VARIANTS = {
    "as fed": {},
    "noshape": {"shape": False},
    "nohead": {"head": 0.0},
    "cpu": {"source": "cpu"},
}


def _fmt(s: dict) -> str:
    if s["median"] is None:
        return "   -   "
    mark = "" if s["ok"] else "*"
    return f"{s['median']:.2f}±{s['worst']:.2f}{mark}"


def report(recs: list[dict], variants=VARIANTS) -> str:
    """One line per cell and variant: each rank's median reading and worst error (``*``: over
    the issue's bound), then the per-step noise and the fitted fixed costs."""
    lines = []
    head = f"{'cell':24s} {'variant':8s} " + " ".join(f"{'rank ' + str(d):>12s}" for d in range(4))
    lines.append(head)
    for rec in recs:
        for v, kw in variants.items():
            if v == "cpu" and ("cpu_ms" not in rec or rec["method"] != "sleep"):
                continue
            st = steady(rec, replay(rec, **kw))
            lines.append(f"{rec['name']:24s} {v:8s} " + " ".join(f"{_fmt(s):>12s}" for s in st))
    lines.append("")
    lines.append("per-step noise (log-sd of a step's per-unit time over its median), by share:")
    lines.append(f"{'cell':24s} rank  wall ms  cpu ms  sd wall  sd cpu")
    for rec in recs:
        for n in raw_noise(rec):
            lines.append(f"{rec['name']:24s} {n['rank']:4d} {n['ms']:8.1f} {n['cpu_ms']:7.1f} "
                         f"{n['sd_wall']:8.3f} {n['sd_cpu']:7.3f}")
    lines.append("")
    for w in (2, 4):
        for src in ("cpu_ms", "compute_ms"):
            if src == "cpu_ms" and not all("cpu_ms" in r for r in recs
                                           if r["world"] == w and r["method"] == "sleep"):
                continue
            try:
                fc = fixed_costs(recs, src, w)
            except (ValueError, np.linalg.LinAlgError):
                continue
            lines.append(f"fixed costs, {w} ranks, {src}: layer×mb {fc['layer_ms']:.2f} ms; "
                         f"head {fc['head']:.2f}, first stage {fc['first']:.2f}, per micro-batch "
                         f"{fc['per_mb']:.2f} layer units ({fc['rows']} shares, residual "
                         f"{100 * fc['resid']:.1f}%)")
    lines.append(f"estimator's live fit at the end (beta, gamma): " + ", ".join(
        f"{r['name']} {r['beta_gamma'][-1]}" for r in recs if r.get("beta_gamma")))
    return "\n".join(lines)


def factors(recs: list[dict]) -> str:
    """The bias by factor, over the cells: per group of cells (world size; healthy or slowed
    ranks) the median and worst error of the working ranks' steady readings under each
    variant; wall / CPU seconds per share; per-step noise of light and heavy shares."""
    lines = ["by factor (working ranks' worst error over the judged steps: median / max over "
             "ranks; healthy: |r - 1|, slowed: |r / true - 1|):"]
    for world in (2, 4):
        for slow in (False, True):
            got = {}
            for rec in recs:
                if rec["world"] != world or rec["method"] != "sleep":
                    continue
                wk = working(rec)
                for v, kw in VARIANTS.items():
                    if v == "cpu" and ("cpu_ms" not in rec or rec["method"] != "sleep"):
                        continue
                    for st in steady(rec, replay(rec, **kw)):
                        if wk[st["rank"]] and st["worst"] is not None and \
                                (st["true"] >= HEALTHY) == slow:
                            got.setdefault(v, []).append(st["worst"])
            bound = 0.15 if slow else 0.10
            cols = "; ".join(f"{v} {np.median(e):.2f} / {np.max(e):.2f} "
                             f"({sum(x > bound for x in e)} of {len(e)} over)"
                             for v, e in got.items())
            lines.append(f"  {world} ranks, {'slowed' if slow else 'healthy'}: {cols}")
    for world in (2, 4):
        light, heavy, ratio = [], [], []
        for rec in recs:
            if rec["world"] != world or rec["method"] != "sleep" or rec["slow"] or \
                    "cpu_ms" not in rec:
                continue
            for n in raw_noise(rec):
                (light if n["cpu_ms"] < 100 else heavy).append((n["sd_wall"], n["sd_cpu"]))
                ratio.append(n["ms"] / n["cpu_ms"])
        if ratio:
            L, H = np.asarray(light), np.asarray(heavy)
            lines.append(f"  {world} ranks, healthy cells: wall / CPU seconds per share "
                         f"{min(ratio):.2f}-{max(ratio):.2f}; per-step log-sd wall / CPU: "
                         f"shares under 100 ms CPU {np.median(L[:, 0]):.3f} / "
                         f"{np.median(L[:, 1]):.3f} ({len(L)}), over {np.median(H[:, 0]):.3f} / "
                         f"{np.median(H[:, 1]):.3f} ({len(H)})")
    return "\n".join(lines)


def calibrate_quota(rate: float, busy: int) -> float:
    """``python -m malleus_ds.emulation.cpu_quota --calibrate``'s measured slowdown of ``rate`` with
    ``busy`` spinning processes beside the workload (the true rate of a quota cell)."""
    cmd = [sys.executable, "-m", "malleus_ds.emulation.cpu_quota", "--calibrate", "--rates", f"{rate:g}",
           "--busy", str(busy)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ,
                                                                     OMP_NUM_THREADS="1"))
    m = re.search(r"measured slowdown ([0-9.]+)x", p.stdout)
    if not m:
        raise SystemExit(f"calibration failed: {p.stdout}\n{p.stderr}")
    print(p.stdout.strip(), flush=True)
    return float(m.group(1))


COMPACT = ("name", "world", "method", "slow", "true", "switches", "judge_from", "head")


def _plan_at(switches, n: int) -> list[int]:
    """The plan index of each of ``n`` steps from 0, under scripted ``switches``."""
    out, cur = [], 0
    for k in range(n):
        for step, i in switches:
            if step == k:
                cur = i
        out.append(cur)
    return out


def compact(recs: list[dict]) -> dict:
    """The test fixture (:func:`load_fixture` reads it back): per cell what :func:`replay`
    needs, plans by id in one table, timings as integers in 0.1 ms (``*_dms``), probes per
    unit in µs; ``cpu_dms`` (4-rank sleep cells only) with the sleep already scaled in."""
    def dms(rows):
        return [[int(round(10 * x)) for x in row] for row in rows]

    plans, cells = {}, []
    for r in recs:
        c = {k: r[k] for k in COMPACT if k in r}
        n = len(r["steps"])
        assert r["steps"] == list(range(n)) and r["plan_at"] == _plan_at(r["switches"], n), \
            f"{r['name']}: steps or plans not as scripted"
        ids = []
        for pj in r["plans"]:
            pid = Plan.from_json(pj).id
            plans[pid] = pj
            ids.append(pid)
        c["plans"] = ids
        c["compute_dms"] = dms(r["compute_ms"])
        c["probe_us"] = {i: {d: int(round(1e3 * x)) for d, x in v.items()}
                         for i, v in r["probe_ms"].items()}
        if r["method"] == "sleep" and r["world"] == 4:
            c["cpu_dms"] = dms([1e3 * cpu_seconds(r, i) for i in range(len(r["steps"]))])
        cells.append(c)
    return {"about": "bench/bench_rates.py recordings (tiny 4x256, seq 128, micro-batch 2, "
                     "CPU, 2 cores, 2026-12-05): per observed step the plan index, every rank's "
                     "compute time and probe per unit from the step's all-reduce, and (4-rank "
                     "sleep cells) its CPU time in the compute spans",
            "plans": plans, "cells": cells}


def load_fixture(path) -> list[dict]:
    """The recordings of a :func:`compact` fixture, as :func:`replay` takes them."""
    d = json.loads(Path(path).read_text())
    out = []
    for c in d["cells"]:
        n = len(c["compute_dms"])
        r = dict(c, plans=[d["plans"][p] for p in c["plans"]], steps=list(range(n)),
                 plan_at=_plan_at(c["switches"], n),
                 compute_ms=[[x / 10 for x in row] for row in c["compute_dms"]],
                 probe_ms={i: {k: x / 1e3 for k, x in v.items()}
                           for i, v in c["probe_us"].items()})
        if "cpu_dms" in c:
            r["cpu_ms"] = [[x / 10 for x in row] for row in c["cpu_dms"]]
        out.append(r)
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        child(argv[1:])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/bench_rates")
    ap.add_argument("--cells", default="", help="comma-separated cell names (default: all)")
    ap.add_argument("--replay", help="a cells.json from an earlier run: report only")
    ap.add_argument("--record", help="write the compact fixture here")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    allc = cells()
    if a.list:
        for c in allc.values():
            print(c.name, c.world, c.method, c.slow, [p.describe() for p in c.plans])
        return 0
    out = Path(a.out)
    if a.replay:
        recs = json.loads(Path(a.replay).read_text())
        recs = load_fixture(a.replay) if isinstance(recs, dict) else recs
    else:
        names = [x for x in a.cells.split(",") if x] or list(allc)
        out.mkdir(parents=True, exist_ok=True)
        store = out / "cells.json"
        recs = json.loads(store.read_text()) if store.exists() else []
        done = {r["name"] for r in recs}
        cal = {}
        h = head_units()
        for n in names:
            c = allc[n]
            if n in done:
                continue
            if c.method == "quota":
                key = (c.slow[1], c.world - 1)
                if key not in cal:
                    cal[key] = calibrate_quota(*key)
                true = tuple(cal[key] if d in c.slow else 1.0 for d in range(c.world))
                c = Cell(**{**c.__dict__, "true": true})
            print(f"running {n} ...", flush=True)
            rec = run_cell(c, out / n)
            rec["head"] = h
            recs.append(rec)
            store.write_text(json.dumps(recs))
            print(report([rec]), flush=True)
    print(report(recs))
    print(factors(recs))
    if a.record:
        Path(a.record).write_text(json.dumps(compact(recs), separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
