"""A plan switch that fails on one rank, by an error or by that rank's death (SIGKILL in the
middle of the transfer), stops every surviving rank with a MigrationError naming the step and
the failed rank, within the agreement's deadline (``2 * migrate_timeout_s + 10``), without a
hang; the engine then refuses to train and keeps the old plan's parameters.

The ranks agree on the failure through the job's store (malleus_ds/resilience/agreement.py): to show that
no collective is needed, every surviving rank breaks torch.distributed's collectives as the
transfer starts (all_reduce, all_gather_object, ... raise), before the failure and the
agreement. And the app turns the MigrationError into one line and exit status 3
(launch/train.py, the watchdog's status in malleus_ds/resilience/watchdog.py)."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path


import pytest

from tests.integration.harness import Died, run_distributed
from tests.cases import CFG, ds_config
from tests.cases import HETERO
from tests.integration.test_malleus_switch import C, failed_switch

TIMEOUT_S = 6                       # malleus.migrate_timeout_s (a loaded CI machine needs slack)
DEADLINE_S = 2 * TIMEOUT_S + 10     # the switch's agreement deadline (engine/switch.py)
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier",
               "reduce_scatter", "all_to_all")


def _fail(rank, world, bad, how):
    import os
    import signal
    import time

    import torch.distributed as tdist

    import malleus_ds
    import malleus_ds.engine.switch as switch
    import malleus_ds.migrate.transport as transport
    from malleus_ds.plan import Plan

    # tiny buckets: many rounds, so the failure lands in the middle of the transfer
    cfg = dict(ds_config(1), malleus={"migrate_timeout_s": TIMEOUT_S, "migrate_bucket_mb": 0.05})
    eng, *_ = malleus_ds.initialize(model=CFG, config=cfg, plan=Plan.from_json(HETERO))
    eng.train_batch()
    before = {n: p.detach().clone() for n, p in eng.named.items()}
    used = []       # collectives called after the communicator was declared broken

    def broken(name):
        def call(*a, **k):
            used.append(name)
            raise RuntimeError(f"{name}: communicator broken (test)")
        return call

    def before_round(r, t):
        if t == 0:
            for f in COLLECTIVES:
                setattr(tdist, f, broken(f))
        if r == bad and t == 1:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError("injected: NIC went away")

    transport.before_round = before_round
    agreed, real = {}, switch._agree_failed

    def spy(*a, **k):           # what the agreement returned, and when this rank entered it
        agreed["entered"] = time.time()
        agreed["failure"] = real(*a, **k)
        return agreed["failure"]

    switch._agree_failed = spy
    return (*failed_switch(eng, Plan.from_json(C), before), used, agreed)


def _check_survivors(res):
    """Checks common to both tests; returns the agreed Failure (the same on every survivor)."""
    live = {r: out for r, out in enumerate(res) if not isinstance(out, Died)}
    for rank, (msg, took, refused, kept, used, _) in live.items():
        assert "before step 1" in msg and msg.startswith(f"rank {rank}: migration"), (rank, msg)
        assert took < DEADLINE_S + 30, (rank, took)         # bounded: no hang past the deadline
        assert refused, f"rank {rank} trained after a failed switch"
        assert kept, f"rank {rank}: the old plan's parameters were modified"
        assert used == [], f"rank {rank} used a collective after the failure: {used}"
    agreed = {r: out[5]["failure"] for r, out in live.items()}
    first = agreed[min(agreed)]
    assert first is not None and all(f == first for f in agreed.values()), agreed
    # a rank counts as silent only if it really came after the others' deadline (a rank starved
    # of CPU on a loaded machine can; a dead one never comes)
    entered = {r: out[5]["entered"] for r, out in live.items()}
    for s in set(first.silent) & set(live):
        assert entered[s] > min(entered.values()) + DEADLINE_S - 2, (s, entered)
    return first


def test_an_error_on_one_rank_reaches_every_rank_without_a_collective():
    res = run_distributed(_fail, 4, 1, "raise", timeout=120)
    first = _check_survivors(res)
    for rank, (msg, *_rest) in enumerate(res):
        if first.silent:    # a rank came after the deadline: every rank names it instead
            assert f"did not report within {DEADLINE_S} s" in msg, (rank, msg)
            continue
        # every rank names the cause, not only the peer it was waiting on when it gave up
        assert first.rank == 1 and first.message == "OSError: injected: NIC went away", first
        assert "OSError: injected: NIC went away" in msg, (rank, msg)
        assert rank == 1 or "rank 1 failed: OSError" in msg, (rank, msg)


@pytest.mark.slow
def test_a_rank_killed_mid_transfer_is_named_by_every_survivor():
    res = run_distributed(_fail, 4, 2, "kill", timeout=150, may_die=(2,))
    assert res[2] == Died(-9), f"rank 2 was to die by SIGKILL in round 1: {res[2]}"
    first = _check_survivors(res)
    assert 2 in first.silent, first
    for rank in (0, 1, 3):
        msg = res[rank][0]
        assert f"did not report within {DEADLINE_S} s" in msg, (rank, msg)
        assert str(list(first.silent)) in msg, (rank, msg)


def test_the_app_exits_3_with_one_line_when_a_switch_fails(tmp_path):
    """launch/train.py under a launcher (RANK set): a MigrationError escaping the run."""
    repo = Path(__file__).resolve().parents[2]
    code = textwrap.dedent(f"""
        import runpy, sys
        import malleus_ds.app.runners as runners
        from malleus_ds.migrate.transport import MigrationError

        def execute(cfg, env=None):
            raise MigrationError("rank 0: migration a -> b before step 3 failed: OSError: "
                                 "x\\nsecond line; rank(s) [1] did not report within 14 s")

        runners.execute = execute
        sys.argv = [{str(repo / "launch" / "train.py")!r}, "hydra.run.dir={tmp_path / 'run'}",
                    "progress=false"]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """)
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 3, (p.returncode, p.stderr[-3000:])
    assert ("[malleus_ds] rank 0: migration a -> b before step 3 failed: OSError: x second "
            "line; rank(s) [1] did not report within 14 s\n") in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
