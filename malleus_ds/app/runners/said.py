"""Every rank says why the job cannot start, then they leave together.

A start-up check (a config error, a refused checkpoint) fails the same way on every rank, before
any process group exists. The first rank to exit makes torchrun stop the others, so a rank that
reached the check later would be killed before it printed its own line. Each rank therefore
counts itself in the launcher's key-value store once it has printed, and leaves as soon as every
rank of the job is counted, or after ``cap_s`` (a rank that never gets there: another error, or
no store). Without torchrun's shared store (the deepspeed launcher, or
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) nothing is hosted yet, and the rank waits ``cap_s``.
"""
from __future__ import annotations

import os
import time

from .base import DistEnv

#: how often a rank looks at the count while it waits
POLL_S = 0.05


def _agent_store(timeout_s: float):
    """A client of torchrun's store (the one it shares with its workers), or None."""
    e = os.environ
    if e.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
        return None
    try:
        from datetime import timedelta

        import torch.distributed as dist

        return dist.TCPStore(e["MASTER_ADDR"], int(e["MASTER_PORT"]), is_master=False,
                             timeout=timedelta(seconds=max(1.0, timeout_s)))
    except Exception:  # noqa: BLE001 - no store to count in: wait the whole cap
        return None


def leave_together(env: DistEnv, cap_s: float, sleep=time.sleep, clock=time.monotonic,
                   store=None) -> bool:
    """After this rank printed its line: wait until every rank of ``env`` has (True), or
    ``cap_s`` seconds (False). ``store``: the store to count in (default: torchrun's)."""
    if env.world_size <= 1:
        return True
    deadline = clock() + cap_s
    store = store if store is not None else _agent_store(cap_s)
    if store is None:
        sleep(cap_s)
        return False
    key = f"malleus_ds/said/{env.restart}/{env.world_size}"
    try:
        n = store.add(key, 1)
        while n < env.world_size and clock() < deadline:
            sleep(POLL_S)
            n = store.add(key, 0)
        return n >= env.world_size
    except Exception:  # noqa: BLE001 - the store went away (the agent is stopping us)
        left = deadline - clock()
        if left > 0:
            sleep(left)
        return False
