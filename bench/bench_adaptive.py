#!/usr/bin/env python
"""The adaptive loop end to end: five runs of one straggler schedule, side by side.

4 local CPU ranks (gloo), the same model, data and schedule for each run: healthy for
``--onset`` steps, rank 3 at rate ``--rate`` until ``--recover``, healthy again until ``--steps``.

* ``deepspeed``  stock DeepSpeed ZeRO-1, static data parallel (dp=4);
* ``static``     MalleusEngine on the same static layout, ``malleus.adaptive=false``;
* ``adaptive``   MalleusEngine with the adaptive loop (the default): it must find the straggler,
                 re-plan, migrate, and come back after recovery by itself;
* ``oracle``     MalleusEngine told the truth: scripted switches (``malleus.switch``) at the
                 exact steps to the planner's best plan for the true rates, and back;
* ``healthy``    the adaptive engine without any straggler (it must not re-plan).

Throughput per phase counts every step of the phase, including the steps an engine spends
detecting, and adds the seconds of its migrations (timed apart from the steps). Targets while the
straggler lasts: adaptive >= 2.5x deepspeed and >= 0.85x oracle; after recovery >= 0.95x
healthy; 0 re-plans in the healthy run. ``--rounds 2`` runs the five twice, interleaved, and
reports the median per run (these machines are noisy).

    python bench/bench_adaptive.py                 # ~4 min on 2 CPU cores
    python bench/bench_adaptive.py --real          # the straggler is a real CPU quota

``--real``: the slow rank is capped by a cgroup CPU quota (``straggler.method=quota``,
``malleus_ds/emulation/cpu_quota.py``) instead of sleeping; on 4 ranks sharing 2 cores a quota of rate r
slows a rank by about r/2 (its healthy share was half a core), so the oracle is told the
calibrated slowdown (``cpu_quota.calibrate`` with 3 busy processes), not r. Every run also prints
its what-if account (``malleus_ds/report/whatif.py``): what the stragglers would have cost a static job,
what this run lost, and the bound.

``--repeat N`` (issue 31, "the same decision, run after run"): a named schedule
(``--schedule recover|returns|two|worsens|all``, defined with the criteria in
``bench/adaptive_schedules.py``) run as ONE stock DeepSpeed run (the reference: DeepSpeed is
deterministic enough run to run) and N adaptive runs, then N healthy runs of the adaptive engine
(``--no-healthy`` skips them). Per criterion it prints the worst, the median and the best run and
PASS only when all N runs pass: an adopted re-plan within 8 steps of each onset; adaptive >= 2.5x
DeepSpeed over the straggling steps; >= 0.9 of the run's own healthy samples/s (steps 2..onset)
from recovery+15 on; 0 re-plans in a healthy run. ``--json OUT`` (default ``OUT_DIR/repeat.json``)
holds every run's numbers; every run's folder stays under ``--out``. ``--real`` applies: a
scheduled rate r then runs as a quota of r x ``--quota-scale`` of one core (default
:data:`QUOTA_SCALE`: on 2 cores a healthy rank gets half a core, and a quota of 6 of one core
slowed a job only 3.3-fold, which left 2.5x DeepSpeed outside the capacity bound of the rate-6
straggler of ``two``), DeepSpeed runs under the same quotas, and the slowdown each rate really
caused is read from the DeepSpeed run, printed, and judges which onsets count.

    python bench/bench_adaptive.py --repeat 5 --schedule all --out /tmp/rep   # ~1 min a run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))          # adaptive_schedules.py, beside this file

from malleus_ds.report.metrics import read_metrics  # noqa: E402
import adaptive_schedules as sch  # noqa: E402
from adaptive_schedules import SCHEDULES  # noqa: E402

MODEL = ["model=tiny", "model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.max_seq_len=128", "train.global_batch_size=16", "train.micro_batch_size=2"]


def oracle_plan(a, out: Path) -> Path:
    """The planner's best plan for the true rates (what the oracle switches to)."""
    from malleus_ds.models.base import head_layer_units, param_table
    from malleus_ds.models.llama import model_config
    from malleus_ds.job_layout import JobLayout
    from malleus_ds.adaptive.replan import job_problem
    from malleus_ds.plan import static_plan
    from malleus_ds.planner import plan

    cur = static_plan(4, 16, 2, 1, 1, 4)
    m = model_config("tiny", num_layers=4, hidden_size=256, num_heads=4, max_seq_len=128)  # MODEL
    head = head_layer_units(param_table(m), 128, 256)      # as the adaptive loop costs the head
    pr = job_problem(cur, JobLayout(4, 4, 1), {1: 1.0}, None, head).with_rates({3: a.true_rate},
                                                                     current_plan=cur)
    p = out / "oracle_plan.json"
    plan(pr, seed=0).plan.save(p)
    return p


def run(name: str, a, out: Path, oracle: Path) -> Path:
    d = out / name
    sched = "[]" if name == "healthy" else \
        f"[{{rank:3,rate:{a.rate},start_step:{a.onset},end_step:{a.recover}}}]"
    extra = []
    if name == "oracle":
        static = out / "static_plan.json"
        from malleus_ds.plan import static_plan
        static_plan(4, 16, 2, 1, 1, 4).save(static)
        extra = [f"malleus.switch=[{{step:{a.onset},plan:{oracle}}},"
                 f"{{step:{a.recover},plan:{static}}}]"]
    ok, cmd, p = launch(name, d, sched, a.steps, a, extra)
    if not ok:
        print(" ".join(cmd), p.stdout[-3000:], p.stderr[-3000:], sep="\n")
        raise SystemExit(f"run {name} failed")
    return d


#: ``--repeat --real``: a scheduled rate r runs as a CPU quota of r x QUOTA_SCALE of one core.
#: Measured in stock DeepSpeed runs on 4 ranks / 2 cores (bench/RESULTS.md, 2026-12-05): a quota
#: of 6 slowed the job 3.3x, 10 -> 6x, 12 -> 8x, 20 -> 17x (a healthy rank gets about half a
#: core; quotas under the kernel's 5 ms slice per 50 ms period overshoot). 1.5 keeps the
#: slowdown the job sees near the scheduled rate; each run reads it back from DeepSpeed's steps.
QUOTA_SCALE = 1.5


def launch(name: str, d: Path, sched: str, steps: int, a, extra=()):
    """One 4-rank training run of ``name`` (deepspeed | static | adaptive | oracle | healthy)
    into ``d`` under the straggler schedule ``sched`` (a ``straggler.schedule=`` value):
    (completed, command, the CompletedProcess)."""
    over = [*MODEL, f"train.steps={steps}", "train.warmup_steps=2", "progress=false",
            f"straggler.schedule={sched}", f"hydra.run.dir={d}"]
    if a.real:
        over += ["straggler.method=quota"]
    if name == "deepspeed":
        over += ["engine=deepspeed", "deepspeed=zero1"]
    else:
        over += ["engine=malleus", "deepspeed=zero1"]
    if name in ("static", "oracle"):
        over += ["malleus.adaptive=false"]
    over += list(extra)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4",
           str(REPO / "launch" / "train.py"), *over, *a.overrides]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        done = (d / "metrics.jsonl").exists() and \
            max((r["step"] for r in read_metrics(d)), default=-1) == steps - 1
        if not (done and "terminate called without an active exception" in p.stderr):
            return False, cmd, p
        # a rare gloo abort at process exit, after the run completed (see bench/RESULTS.md)
        print(f"note: run {name} completed every step, then a rank aborted at exit "
              f"(code {p.returncode}); its metrics are complete and used", flush=True)
    return True, cmd, p


def phase_tput(d: Path, lo: int, hi: int) -> float:
    """Samples/s over steps [lo, hi), migrations before those steps included."""
    steps = [r for r in read_metrics(d) if lo <= r["step"] < hi]
    mig = sum(e["seconds"] for e in read_metrics(d, events=True)
              if e["event"] == "migrate" and lo <= e["step"] < hi)
    return sum(r["samples"] for r in steps) / (sum(r["step_time_s"] for r in steps) + mig)


def repeat(a) -> int:
    """``--repeat N``: each chosen schedule as ONE stock DeepSpeed run (the reference: DeepSpeed
    is deterministic enough run to run) and N adaptive runs, then N healthy runs of the adaptive
    engine; each criterion (``bench/adaptive_schedules.py``) judged per run and reported as the
    worst, median and best run, PASS only when all N pass."""
    import time

    names = list(SCHEDULES) if a.schedule == "all" else a.schedule.split(",")
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown or a.repeat < 1:
        raise SystemExit(f"--repeat N needs N >= 1 and --schedule from {list(SCHEDULES)} or "
                         f"'all' (got {a.repeat}, {unknown or a.schedule})")
    if a.only or a.rounds != 1:
        raise SystemExit("--repeat runs its own set of runs: --only and --rounds do not apply")
    scheds = [SCHEDULES[n] for n in names]
    true_rate, quota = None, None
    if a.real:
        from malleus_ds.emulation import cpu_quota
        reason = cpu_quota.unavailable_reason()
        if reason:
            raise SystemExit(f"--real: no CPU quota on this machine: {reason}")
        k = a.quota_scale
        rates = tuple(sorted({r for s in scheds for r in s.scaled(k).distinct_rates()}))
        cal = cpu_quota.calibrate(rates=rates, busy=3, out=lambda *x: None)
        print(f"--real: a scheduled rate r runs as a CPU quota of r x {k:g} of one core (4 ranks "
              f"share {os.cpu_count()} cores, so a quota slows a rank less against its peers "
              f"than against one core; --quota-scale); the quotas alone with 3 busy "
              f"processes: " + ", ".join(f"{r:g} -> {cal[r]:.2f}x" for r in rates)
              + f". What each rate really cost is read from the DeepSpeed run (its step time "
              f"over its healthy one); an onset below {sch.MIN_STRAGGLER}x is reported, not "
              f"judged; DeepSpeed runs under the same quotas, so adaptive / deepspeed stays like "
              f"for like", flush=True)
        true_rate, quota = {}, {"scale": k, "calibrated_alone_3_busy": {str(r): round(x, 2)
                                                                        for r, x in cal.items()}}
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_adaptive_repeat_"))
    out.mkdir(parents=True, exist_ok=True)
    jpath = Path(a.json) if a.json else out / "repeat.json"
    res: dict = {"repeat": a.repeat, "real": a.real, "quota": quota, "out": str(out),
                 "overrides": a.overrides,
                 "criteria": {k: v[0] for k, v in sch.CRITERIA.items()},
                 "note": "one stock DeepSpeed run per schedule is the reference of every "
                         "adaptive run of that schedule (DeepSpeed is deterministic enough)",
                 "schedules": {}, "healthy": [], "verdict": {}}

    def save():
        jpath.write_text(json.dumps(res, indent=1))

    def one(name, d, sched, steps, tag):
        t0 = time.perf_counter()
        ok, cmd, p = launch(name, d, sched, steps, a)
        wall = time.perf_counter() - t0
        if not ok:
            print(f"{tag} FAILED after {wall:.0f} s (code {p.returncode}); the run counts as "
                  f"failing every criterion:\n  {' '.join(cmd)}\n{p.stdout[-2000:]}\n"
                  f"{p.stderr[-2000:]}", flush=True)
        return ok, wall

    print(f"--repeat {a.repeat}: schedules {names}, 4 CPU ranks, runs in {out}; the DeepSpeed "
          f"reference is ONE run per schedule (stock DeepSpeed is deterministic enough run to "
          f"run), every adaptive run of that schedule is compared with it", flush=True)
    rc = 0
    for s in scheds:
        run_s = s.scaled(a.quota_scale) if a.real else s      # what the ranks are given
        rec = res["schedules"][s.name] = {"schedule": s.text(), "about": s.about,
                                          "entries": run_s.hydra(), "steps": s.steps,
                                          "onsets": [o.step for o in sch.onsets(s)],
                                          "recoveries": sch.recoveries(s),
                                          "after_windows": sch.after_windows(s),
                                          "deepspeed": None, "runs": []}
        print(f"\n[{s.name}] {s.about}: {s.text()}", flush=True)
        d = out / s.name / "deepspeed"
        ok, wall = one("deepspeed", d, run_s.hydra(), s.steps, f"[{s.name}] deepspeed")
        if not ok:
            rec["deepspeed"] = {"dir": str(d), "failed": True, "wall_s": wall}
            save()
            rc = 1
            print(f"[{s.name}] no DeepSpeed reference: the schedule is not judged", flush=True)
            continue
        ds_rows, ds_ev = read_metrics(d), read_metrics(d, events=True)
        st = sch.straggling_steps(s)
        rec["deepspeed"] = {"dir": str(d), "wall_s": round(wall, 1),
                            "straggling_tput": sch.tput(ds_rows, ds_ev, st),
                            "healthy_tput": sch.tput(ds_rows, ds_ev, range(*sch.healthy_window(s)))}
        print(f"[{s.name}] deepspeed done ({wall:.0f} s): {rec['deepspeed']['straggling_tput']:.1f} "
              f"samples/s while straggling, {rec['deepspeed']['healthy_tput']:.1f} healthy "
              f"(steps {sch.HEALTHY_FROM}..{sch.healthy_window(s)[1]})", flush=True)
        if a.real:
            true_rate = sch.measured_slowdown(ds_rows, s)
            rec["deepspeed"]["measured_slowdown"] = {str(r): round(x, 2)
                                                     for r, x in true_rate.items()}
            print(f"[{s.name}] deepspeed's measured slowdown per scheduled rate: " + ", ".join(
                f"{r:g} -> {x:.2f}x" for r, x in true_rate.items()), flush=True)
        save()
        for i in range(a.repeat):
            d = out / s.name / f"adaptive{i}"
            tag = f"[{s.name}] adaptive {i + 1}/{a.repeat}"
            ok, wall = one("adaptive", d, run_s.hydra(), s.steps, tag)
            if ok:
                r = sch.judge_adaptive(read_metrics(d), read_metrics(d, events=True), s,
                                       ds_rows, ds_ev, true_rate)
            else:
                r = {"failed": True, "onset": None, "vs_deepspeed": None, "after": None,
                     "pass": {"onset": False, "vs_deepspeed": False, "after": False}}
            r.update(dir=str(d), wall_s=round(wall, 1))
            rec["runs"].append(r)
            save()
            if ok:
                lat = [o["latency"] if o["judged"] else f"({o['latency']}, not judged)"
                       for o in r["onsets"]]
                print(f"{tag} done ({wall:.0f} s): onset latency {lat} "
                      f"{_pf(r, 'onset')}; adaptive/deepspeed "
                      f"{sch.fmt(r['vs_deepspeed'], 'vs_deepspeed')} {_pf(r, 'vs_deepspeed')}; "
                      f"after/healthy {[sch.fmt(w['ratio'], 'after') for w in r['after_windows']]}"
                      f" {_pf(r, 'after')}; re-plans {r['replans']} ({r['adopted']} adopted) at "
                      f"{[x[0] for x in r['replan_steps']]}", flush=True)
                if len(r["phases"]) > 1:
                    print("    adaptive / deepspeed per straggling phase: " + ", ".join(
                        f"[{p['steps'][0]}, {p['steps'][1]}) {p['rates']}: "
                        f"{sch.fmt(p['ratio'], 'vs_deepspeed')}" for p in r["phases"]),
                        flush=True)
        _report(s.name, rec["runs"], ("onset", "vs_deepspeed", "after"), res)
        save()
    if not a.no_healthy:
        steps = max(s.steps for s in scheds)
        print(f"\n[healthy] {a.repeat} run(s) of the adaptive engine, no straggler, {steps} steps",
              flush=True)
        for i in range(a.repeat):
            d = out / "healthy" / f"healthy{i}"
            tag = f"[healthy] {i + 1}/{a.repeat}"
            ok, wall = one("healthy", d, "[]", steps, tag)
            r = sch.judge_healthy(read_metrics(d), read_metrics(d, events=True)) if ok else \
                {"failed": True, "replans": None, "pass": {"healthy": False}}
            r.update(dir=str(d), wall_s=round(wall, 1))
            res["healthy"].append(r)
            save()
            if ok:
                print(f"{tag} done ({wall:.0f} s): {r['replans']} re-plan(s) "
                      f"{r['replan_steps']} {_pf(r, 'healthy')}; {r['tput']:.1f} samples/s",
                      flush=True)
        _report("healthy", res["healthy"], ("healthy",), res)
        save()
    print(f"\nsummary (--repeat {a.repeat}{', --real' if a.real else ''}; worst / median / best "
          f"run; PASS only when every run passes):")
    for key, v in res["verdict"].items():
        print(f"  {key:28s} {v['worst']:>6s} {v['median']:>6s} {v['best']:>6s}  "
              f"{'PASS' if v['pass'] else 'FAIL'}  ({v['passed']}/{v['runs']} runs)")
    print(f"runs: {out}\nresults: {jpath}")
    save()
    return 0 if rc == 0 and all(v["pass"] for v in res["verdict"].values()) else 1


def _pf(r, c) -> str:
    return "PASS" if r["pass"][c] else "FAIL"


def _report(name: str, runs: list, criteria, res) -> None:
    """Print worst / median / best and PASS/FAIL per criterion over ``runs``; record them in
    ``res["verdict"]``."""
    print(f"[{name}] over {len(runs)} run(s): worst / median / best")
    for c in criteria:
        text, higher = sch.CRITERIA[c]
        vals = [r.get("replans") if c == "healthy" else r.get(c) for r in runs]
        w, m, b = (sch.fmt(v, c) for v in sch.spread(vals, higher))
        ok = sch.verdict(runs, c)
        res["verdict"][f"{name}: {c}"] = {"criterion": text, "worst": w, "median": m, "best": b,
                                          "pass": ok, "runs": len(runs),
                                          "passed": sum(bool(r["pass"][c]) for r in runs)}
        print(f"  {text}: {w} / {m} / {b}  {'PASS' if ok else 'FAIL'}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=5.0)
    ap.add_argument("--onset", type=int, default=10)
    ap.add_argument("--recover", type=int, default=70)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--only", default=None,
                    help="comma-separated subset of runs (iterating; the checks need all five)")
    ap.add_argument("--out", default=None, help="folder for the runs (default: a temp dir)")
    ap.add_argument("--real", action="store_true",
                    help="slow the rank with a cgroup CPU quota instead of sleeping")
    ap.add_argument("--quota-scale", type=float, default=QUOTA_SCALE, metavar="K",
                    help=f"with --repeat --real: run a scheduled rate r as a quota of r*K of one "
                         f"core (default {QUOTA_SCALE:g}: on 4 ranks / 2 cores the rank is then "
                         f"about r-fold slow against its peers; each run prints what DeepSpeed "
                         f"measured)")
    ap.add_argument("--repeat", type=int, default=None, metavar="N",
                    help="run a named schedule (--schedule) N times and judge each criterion "
                         "over the N runs: worst, median, best, PASS only when all N pass")
    ap.add_argument("--schedule", default="all",
                    help=f"with --repeat: one of {list(SCHEDULES)}, a comma-separated list, or "
                         f"'all' (default)")
    ap.add_argument("--no-healthy", action="store_true",
                    help="with --repeat: skip the N healthy runs (no-re-plan criterion)")
    ap.add_argument("--json", default=None, metavar="OUT",
                    help="write the per-run results as JSON here (--repeat: default "
                         "OUT_DIR/repeat.json, rewritten after every run)")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides for every run")
    a = ap.parse_args()
    if not a.quota_scale >= 1.0:
        raise SystemExit(f"--quota-scale {a.quota_scale:g} must be >= 1")
    if a.repeat is not None:
        return repeat(a)
    a.true_rate = a.rate
    if a.real:
        from malleus_ds.emulation import cpu_quota
        reason = cpu_quota.unavailable_reason()
        if reason:
            raise SystemExit(f"--real: no CPU quota on this machine: {reason}")
        a.true_rate = cpu_quota.calibrate(rates=(a.rate,), busy=3, out=lambda *x: None)[a.rate]
        print(f"--real: a quota of rate {a.rate:g} measured {a.true_rate:.2f}x with 3 busy "
              f"processes (what the oracle plans for)", flush=True)
    out = Path(a.out or tempfile.mkdtemp(prefix="bench_adaptive_"))
    out.mkdir(parents=True, exist_ok=True)
    oracle = oracle_plan(a, out)
    names = ["deepspeed", "static", "adaptive", "oracle", "healthy"]
    if a.only:
        names = [n for n in names if n in a.only.split(",")]
    res: dict[str, list[dict]] = {n: [] for n in names}
    for k in range(a.rounds):
        for n in names:
            d = run(n, a, out / f"round{k}", oracle)
            ev = read_metrics(d, events=True)
            rp = [e for e in ev if e["event"] == "replan"]
            first = next((e for e in rp if e.get("adopted")), None)
            res[n].append({
                "healthy": phase_tput(d, 2, a.onset),
                "straggler": phase_tput(d, a.onset, a.recover),
                "after": phase_tput(d, a.recover, a.steps),
                "replans": len(rp), "adopted": sum(bool(e.get("adopted")) for e in rp),
                "latency": (first["step"] - a.onset) if first and n == "adaptive" else None,
                "planning_s": [e.get("planning_s") for e in rp],
                "migrate_s": [round(e["seconds"], 3) for e in ev if e["event"] == "migrate"],
                "dir": str(d)})
            print(f"round {k} {n:9s} done: {json.dumps(res[n][-1])}", flush=True)
            try:
                from malleus_ds.report.whatif import account_of_run, closing_line
                print(f"  what-if, {n}: {closing_line(account_of_run(d, 2))}", flush=True)
            except Exception as e:      # noqa: BLE001 - the account is a report, not a check
                print(f"  what-if, {n}: not available ({e})", flush=True)

    def med(n, k):
        return statistics.median(r[k] for r in res[n])

    if len(names) < 5:
        for n in names:
            print(f"  {n:10s} straggler {med(n, 'straggler'):.1f}, after {med(n, 'after'):.1f}")
        if a.json:
            Path(a.json).write_text(json.dumps({"runs": res}, indent=1))
        return 0

    how = f"a CPU quota, measured {a.true_rate:.2f}x" if a.real else "emulated"
    print(f"\n4 CPU ranks, rank 3 at rate {a.rate:g} ({how}) during steps [{a.onset}, {a.recover}), "
          f"{a.steps} steps, {a.rounds} round(s); samples/s (migrations included)")
    print(f"  {'run':10s} {'healthy':>9s} {'straggler':>10s} {'after':>9s} {'re-plans':>9s}")
    for n in names:
        print(f"  {n:10s} {med(n, 'healthy'):9.1f} {med(n, 'straggler'):10.1f} "
              f"{med(n, 'after'):9.1f} {statistics.median(r['replans'] for r in res[n]):9g}")
    ad = res["adaptive"]
    lat = [r["latency"] for r in ad]
    print(f"  adaptive: detection + planning latency (steps from onset to the first switch): "
          f"{lat}; planning s per re-plan: {[r['planning_s'] for r in ad]}; "
          f"migration s: {[r['migrate_s'] for r in ad]}")
    s_ad, s_ds, s_or = med("adaptive", "straggler"), med("deepspeed", "straggler"), \
        med("oracle", "straggler")
    after_ratio = med("adaptive", "after") / med("healthy", "after")
    healthy_replans = max(r["replans"] for r in res["healthy"])
    checks = [
        (f"straggler: adaptive / deepspeed = {s_ad / s_ds:.2f} (target >= 2.5)", s_ad / s_ds >= 2.5),
        (f"straggler: adaptive / oracle    = {s_ad / s_or:.2f} (target >= 0.85)", s_ad / s_or >= 0.85),
        (f"after recovery: adaptive / healthy = {after_ratio:.2f} (target >= 0.95)",
         after_ratio >= 0.95),
        (f"healthy run re-plans = {healthy_replans} (target 0)", healthy_replans == 0),
    ]
    print(f"  static / deepspeed while straggling = {med('static', 'straggler') / s_ds:.2f}; "
          f"oracle / deepspeed = {s_or / s_ds:.2f}")
    for text, ok in checks:
        print(f"  {text}: {'PASS' if ok else 'FAIL'}")
    print(f"runs: {out}")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": res, "checks": [
            {"check": t, "pass": ok} for t, ok in checks]}, indent=1))
    return 0 if all(ok for _, ok in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
