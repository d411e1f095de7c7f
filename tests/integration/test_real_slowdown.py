"""Real slowdowns end to end (issue 18): the OS slows a rank, nothing is emulated.

``straggler.method=quota`` caps the rank's CPU by a cgroup quota (malleus_ds/emulation/cpu_quota.py);
where the machine has no writable cgroup, ``method=compete`` pins busy processes beside it
(malleus_ds/emulation/cpu_compete.py); where neither can run, the tests skip, naming why.

First the app (torchrun, 2 ranks, engine=torch) with rank 1 slowed at rate 3 from step 4 to
the end, by each method. Rank 1's measured compute (metrics.jsonl ``compute_s``) rises: ~3x
when each rank has a core, ~r*s when it had only a share s of one (a busy machine), so the
check is loose: at least 1.3x and at most 4.5x, median over the slowed steps against the healthy
ones; nothing is emulated (``emulated_s`` 0, ``emulated_rates`` the target), and the run leaves
no cgroup folder and no competing process behind. Then the adaptive loop under the best real
method the machine has."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys

import pytest

from malleus_ds.emulation import cpu_compete as cc
from malleus_ds.emulation import cpu_quota as cq
from tests.integration.test_train_cli import TRAIN, _env, _metrics

ARGS = ["model=tiny", "model.hidden_size=128", "model.max_seq_len=64", "train.global_batch_size=8",
        "train.micro_batch_size=2", "progress=false", "engine=torch", "train.steps=12",
        "straggler.schedule=[{rank:1,rate:3.0,start_step:4}]", "straggler.method=quota"]


def _leftovers() -> list[str]:
    """``malleus-<pid>`` cgroup folders whose process is gone."""
    lay = cq.detect()
    out = []
    for parent in lay.parents if lay else ():
        for d in parent.glob("malleus-*"):
            pid = d.name.split("-", 1)[1]
            if pid.isdigit() and not cq._alive(int(pid)):
                out.append(str(d))
    return out


def _competitors_alive() -> list[int]:
    """Competing processes (cpu_compete's spin loop) still running anywhere."""
    out = subprocess.run(["pgrep", "-f", "os.sched_setaffinity\\(0, \\{core\\}\\)"],
                         capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


METHODS = {"quota": cq.unavailable_reason, "compete": cc.unavailable_reason}


def real_method() -> tuple[str | None, str]:
    """The best real method this machine can apply (quota, else compete) or None, and why."""
    why = []
    for m, reason in METHODS.items():
        r = reason()
        if r is None:
            return m, ""
        why.append(f"{m}: {r}")
    return None, "; ".join(why)


@pytest.mark.parametrize("method", list(METHODS))
def test_a_real_straggler_really_slows_rank_1(tmp_path, method):
    reason = METHODS[method]()
    if reason:
        pytest.skip(f"straggler.method={method} cannot run here: {reason}")
    out = tmp_path / "run"
    args = [a for a in ARGS if not a.startswith("straggler.method=")]
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", TRAIN, *args, f"straggler.method={method}",
                        f"hydra.run.dir={out}"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = [r for r in _metrics(out) if "step" in r]
    assert [r["step"] for r in recs] == list(range(12))
    assert all(r["emulated_s"] == [0.0, 0.0] for r in recs)            # nothing slept
    assert recs[3]["emulated_rates"] == {} and recs[4]["emulated_rates"] == {"1": 3.0}
    healthy = statistics.median(r["compute_s"][1] for r in recs[1:4])   # step 0: warm-up
    slowed = statistics.median(r["compute_s"][1] for r in recs[5:])     # step 4: transition
    assert 1.3 <= slowed / healthy <= 4.5, [r["compute_s"] for r in recs]
    assert _leftovers() == []
    assert _competitors_alive() == []


# ------------------------------------------------------------------ the adaptive loop, for real

#: the demo's shape (conf/experiment/demo.yaml: 2 ranks, dp=2, tiny model), straggler by quota:
#: rank 1 at rate 3 from step 8 (onset: it keeps working with fewer micro-batches), 8 from
#: step 22 (worsening), healthy from step 36 (recovery)
ADAPTIVE = ["experiment=demo", "compare=[]", "engine=malleus", "train.steps=54", "log_every=100"]
SCHEDULE = ("straggler.schedule=[{rank:1,rate:3.0,start_step:8,end_step:22},"
            "{rank:1,rate:8.0,start_step:22,end_step:36}]")
CHANGES = (8, 22, 36)


def _run_app(tmp_path, method, *extra):
    tmp_path.mkdir(parents=True, exist_ok=True)
    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc_per_node=2", TRAIN, *ADAPTIVE, f"straggler.method={method}",
                        *extra, f"hydra.run.dir={out}"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = _metrics(out)
    return [r for r in rows if "event" not in r and "step" in r], [r for r in rows if "event" in r]


def _followed(steps, events, true) -> str | None:
    """Why the run did not follow the schedule (None: it did)."""
    replans = [e for e in events if e["event"] == "replan" and e.get("adopted")]
    migrates = [e for e in events if e["event"] == "migrate"]
    detected = [e.get("detected", e["step"]) for e in replans]
    for change in CHANGES:
        if not [d for d in detected if change < d <= change + 8]:
            return (f"no adopted re-plan within 8 steps of the change at step {change}: "
                    f"{[(e['step'], e.get('detected'), e['trigger']) for e in replans]}")
    # rates: the median measured rate of rank 1 over the steps after the re-plan of each phase
    for (lo, hi), rate in (((8, 22), 3.0), ((22, 36), 8.0)):
        after = min(d for d in detected if lo < d <= hi)
        vals = [r["measured_rates"][1] for r in steps
                if after + 2 <= r["step"] < hi and r.get("measured_rates")
                and r["measured_rates"][1] is not None]
        if not vals:
            return f"no measured rate for rank 1 in steps [{after + 2}, {hi})"
        got = statistics.median(vals)
        lo_t, hi_t = true[rate]
        if not 0.75 * lo_t <= got <= 1.4 * hi_t:
            return f"rate {rate}: measured {got} vs true {true[rate]} ({vals})"
    # recovery: rank 1 has work again within 15 steps (the last switch gives it work)
    last = [m for m in migrates if m["step"] > 36]
    if not (last and 1 not in last[0]["idle"] and last[0]["step"] <= 36 + 15):
        return f"rank 1 did not get work back by step {36 + 15}: {migrates}"
    return None


@pytest.mark.slow
def test_real_slowdown_onset_worsening_and_recovery_are_followed(tmp_path):
    """Detection within 8 steps of each change; after each re-plan the measured rate within
    -25%/+40% of the true slowdown (see below); the rank gets work back within 15 steps of its recovery
    (suspended or not: the first switch after it gives it work).

    A second run is allowed when the first misses: the slowdown is the kernel's quota
    enforcement, which on shared VMs misses now and then (about one run in ten here, with
    nothing else running); two misses in a row fail, with both reasons."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs a core per rank (2)")
    method, reason = real_method()
    if method is None:
        pytest.skip(f"no real slowdown here: {reason}")
    # The true slowdown: each of the 2 ranks has a core of its own, so nominally the rate r;
    # but on these VMs the kernel enforces small quotas loosely, and the same matmul loop timed
    # alone under the quota (cpu_quota.calibrate) reads more (3.4-4.2x at rate 3, 12.2-12.6x at
    # rate 8, while training read 2.96-3.5x and 8.3-10.8x). The truth lies between the two: the
    # measured rate must be within 25% below and 40% above that interval: on 2026-12-04 the
    # calibration read only 8.4x at rate 8 while training read 10.7-11.0x, in both tries of two
    # full-suite runs. (Competitors: cpu_compete.calibrate.)
    if method == "quota":
        cal = cq.calibrate(rates=(3.0, 8.0), repeats=2, busy=1, out=lambda *a: None)
    else:
        cal = cc.calibrate(rates=(3.0, 8.0), repeats=2, out=lambda *a: None)
    true = {r: (min(r, cal[r]), max(r, cal[r])) for r in (3.0, 8.0)}
    why = []
    for attempt in range(2):
        steps, events = _run_app(tmp_path / f"try{attempt}", method, SCHEDULE)
        miss = _followed(steps, events, true)
        if miss is None:
            return
        why.append(miss)
    pytest.fail("two runs in a row did not follow the schedule: " + " | ".join(why))


def test_a_healthy_run_with_the_same_machine_does_not_replan(tmp_path):
    method, reason = real_method()
    if method is None:
        pytest.skip(f"no real slowdown here: {reason}")
    steps, events = _run_app(tmp_path, method, "straggler.schedule=[]", "train.steps=28")
    assert [e for e in events if e["event"] in ("replan", "migrate")] == [], events
