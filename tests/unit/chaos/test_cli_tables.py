"""The campaign's tables (``malleus-chaos``'s end of run), from rows as the runner writes them."""
from __future__ import annotations

from malleus_ds.chaos.cli import kinds_table, seeds_of, table


def _row(seed, faults, ok=True, not_done=(), vs_stock=None):
    return {"seed": seed, "faults": faults, "restarts": faults.get("kill", 0),
            "switches": 1, "failed_saves": 0, "seconds": 30.0, "ok": ok,
            "not_done": list(not_done), "vs_stock": vs_stock}


def test_one_row_per_seed_and_per_kind():
    rows = [_row(0, {"kill": 1, "quota": 1}, vs_stock=1.31),
            _row(1, {"quota": 2, "node_loss": 1}, ok=False,
                 not_done=["quota: rank 3 has no process now (restarting?)"])]
    t = table(rows).splitlines()
    assert t[0].split() == ["seed", "quota", "kill", "node_loss", "restarts", "switches",
                            "failed", "saves", "seconds", "vs", "stock", "verdict"]
    assert t[1].split() == ["0", "1", "1", "0", "1", "1", "0", "30", "1.31x", "ok"]
    assert t[2].split()[-2:] == ["-", "FAILED"]
    k = kinds_table(rows).splitlines()
    assert k[0].split() == ["kind", "done", "not", "done", "runs", "failed", "why", "not"]
    assert k[1].split()[:5] == ["quota", "2", "1", "2", "1"]
    assert k[1].endswith("rank 3 has no process now (restarting?)")
    assert [ln.split()[0] for ln in k[1:]] == ["quota", "kill", "node_loss"]
    assert "vs stock" not in table([_row(0, {"kill": 1})])


def test_seeds_are_numbers_and_ranges():
    assert seeds_of("3") == [3] and seeds_of("0-2,7") == [0, 1, 2, 7]


def test_a_failing_seed_is_replayed_with_the_options_that_drew_it():
    from malleus_ds.chaos.run import replay_line
    from malleus_ds.chaos.schedule import draw

    s = draw(7, 36, 4, faults=(4, 6))
    assert replay_line(s, 4, 36) == "malleus-chaos --seeds 7 --world 4 --steps 36"
    assert replay_line(s, 4, 36, "kill,freeze", "4-6") == \
        "malleus-chaos --seeds 7 --world 4 --steps 36 --kinds kill,freeze --faults 4-6"


def test_a_bigger_job_reaches_the_ranks_the_reference_and_the_replay_line(tmp_path):
    import argparse

    from malleus_ds.chaos.cli import job_options
    from malleus_ds.chaos.run import Options, _reference, reference, script
    from malleus_ds.chaos.schedule import Schedule

    sched = Schedule(3, 2, 4, ())
    args = script(sched, tmp_path, tmp_path, Options(global_batch_size=16, seq_len=24))
    assert "model.max_seq_len=24" in args and "train.global_batch_size=16" in args
    assert "model.max_seq_len=16" in script(sched, tmp_path, tmp_path, Options())
    _reference.cache_clear()
    big, small = reference(sched, Options(global_batch_size=16, seq_len=24)), reference(sched)
    assert len(big) == len(small) == 2 and big != small
    assert job_options(argparse.Namespace(batch=64, seq_len=64, rtol=1e-4)) == \
        "--batch 64 --seq-len 64 --rtol 0.0001"
    assert job_options(argparse.Namespace(batch=None, seq_len=16, rtol=1e-5)) == ""


def test_stock_is_compared_only_where_it_can_meet_the_same_slowdowns():
    from malleus_ds.chaos.schedule import Fault, Schedule

    def comparable(s):
        return s.comparable

    slow = Fault("straggler", 3, 1, until=8, rate=3.0)
    assert comparable(Schedule(0, 36, 4, (slow, Fault("kill", 9, 2))))
    assert not comparable(Schedule(0, 36, 4, (Fault("kill", 9, 2),)))         # nothing slowed
    assert not comparable(Schedule(0, 36, 4, (slow, Fault("slow_link", 4, 0, until=7, rate=5.0,
                                                           peer=1))))
    assert not comparable(Schedule(0, 36, 4, (slow, Fault("node_loss", 5, 1, until=10))))


def test_a_slow_link_across_the_two_nodes_of_a_lost_node_job_is_named_by_its_nodes(tmp_path):
    """(seed 38 of the long campaign: ranks [3, 1] of a two-agent job were refused as a config
    error on every rank)."""
    from malleus_ds.chaos.run import Options, script
    from malleus_ds.chaos.schedule import Fault, Schedule

    link = Fault("slow_link", 19, 3, until=23, rate=5.0, peer=1)
    two = Schedule(38, 36, 4, (Fault("node_loss", 14, 1, until=18), link))
    one = Schedule(38, 36, 4, (link,))
    arg = lambda s: next(a for a in script(s, tmp_path, tmp_path, Options())   # noqa: E731
                         if a.startswith("straggler.link_schedule="))
    assert arg(two) == 'straggler.link_schedule=[{nodes:[0, 1],rate:5.0,start_step:19,end_step:23}]'
    assert arg(one) == 'straggler.link_schedule=[{ranks:[3, 1],rate:5.0,start_step:19,end_step:23}]'


def test_the_launcher_command_is_every_rank_s_script_with_the_launcher_s_overrides():
    from pathlib import Path

    from malleus_ds.chaos.run import Options, command, script
    from malleus_ds.chaos.schedule import Fault, Schedule

    sched = Schedule(3, 12, 2, (Fault("straggler", 2, 1, until=6, rate=3.0),))
    ranks = script(sched, Path("run"), Path("ck"), Options(max_restarts=5), "deepspeed")
    cmd = command(sched, Path("run"), Path("ck"), Options(max_restarts=5), "deepspeed")
    assert cmd[1] == ranks[0] and cmd[2:4] == ["nproc_per_node=2", "max_restarts=5"]
    assert cmd[4:] == ranks[1:] and "engine=deepspeed" in cmd and "engine=malleus" not in cmd
