"""Ranks that stop on the same start-up error leave as soon as every one has said it
(``app/runners/said.py``)."""
from __future__ import annotations

import threading
from datetime import timedelta

import torch.distributed as dist

from malleus_ds.app.runners.base import DistEnv
from malleus_ds.app.runners.said import leave_together


class Clock:
    """A fake clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.t = 0.0
        self.slept: list[float] = []

    def sleep(self, s: float) -> None:
        self.slept.append(s)
        self.t += s

    def __call__(self) -> float:
        return self.t


class Store:
    """``add`` of a store whose count grows by ``others_per_poll`` every time it is read."""

    def __init__(self, start: int = 0, others_per_poll: int = 0) -> None:
        self.n, self.step = start, others_per_poll

    def add(self, key: str, k: int) -> int:
        self.n += k if k else self.step
        return self.n


def _env(world: int, rank: int = 0) -> DistEnv:
    return DistEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world)


def test_one_rank_never_waits():
    c = Clock()
    assert leave_together(_env(1), 3.0, sleep=c.sleep, clock=c)
    assert c.slept == []


def test_the_last_rank_to_say_it_leaves_at_once():
    c = Clock()
    assert leave_together(_env(4), 3.0, sleep=c.sleep, clock=c, store=Store(start=3))
    assert c.slept == []


def test_a_rank_waits_for_the_others_then_leaves():
    c = Clock()
    assert leave_together(_env(4), 3.0, sleep=c.sleep, clock=c, store=Store(others_per_poll=1))
    assert 0 < c.t < 1.0, c.t


def test_a_rank_that_never_comes_costs_the_cap_only():
    c = Clock()
    assert not leave_together(_env(4), 3.0, sleep=c.sleep, clock=c, store=Store(start=1))
    assert 3.0 <= c.t < 3.2, c.t


def test_without_a_store_the_rank_waits_the_cap(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    c = Clock()
    assert not leave_together(_env(2), 3.0, sleep=c.sleep, clock=c)
    assert c.slept == [3.0]


def test_a_store_that_fails_mid_wait_costs_at_most_the_cap():
    class Gone(Store):
        def add(self, key, k):
            if k == 0:
                raise RuntimeError("connection reset")
            return super().add(key, k)

    c = Clock()
    assert not leave_together(_env(2), 3.0, sleep=c.sleep, clock=c, store=Gone())
    assert 2.9 <= c.t <= 3.0 + 1e-9, c.t


def test_ranks_count_themselves_in_torchruns_store(monkeypatch):
    """A real TCPStore, as torchrun shares it (TORCHELASTIC_USE_AGENT_STORE): three ranks, each
    in a thread, all leave once the last has said it."""
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=10),
                           wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(master.port))
    out: dict[int, bool] = {}
    go = {r: threading.Event() for r in range(3)}

    def rank(r: int) -> None:
        go[r].wait()
        out[r] = leave_together(_env(3, r), 30.0)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    go[0].set()
    go[1].set()
    threads[0].join(0.5)
    assert threads[0].is_alive(), "rank 0 left before rank 2 said it"
    go[2].set()
    for t in threads:
        t.join(20)
    assert out == {0: True, 1: True, 2: True}
