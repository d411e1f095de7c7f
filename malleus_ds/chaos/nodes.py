"""Two nodes on one machine: two torchrun agents of a job, one of which can be lost and return.

Each agent starts ``nproc`` ranks of the same training command (``--nnodes 1:2``, c10d
rendezvous on 127.0.0.1). The agent started first hosts the rendezvous store and must outlive
the other, so the second starts only once the first listens (:func:`wait_hosting`). A lost node
is its agent and workers killed at once (:func:`kill_tree`); the survivors' watchdog sees the
ranks gone, they exit, and their agent restarts them on the smaller world from the latest
checkpoint. A node that returns is its agent started again: the survivors' agent sees it waiting
and restarts its workers into a rendezvous that takes both.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from ..resilience.procs import descendants

#: a node without a keep-alive for 1 s x 3 is dead to the rendezvous (torch's default: 5 s x 3,
#: which only makes the survivors' next round wait longer)
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_env() -> dict:
    """The environment of an agent: one thread per rank, DeepSpeed on the CPU unless told.

    torch 2.13's agent publishes the workers' store address (MASTER_ADDR/PORT) only in the first
    round it hosts it: a node joining later waits for it in vain (DistStoreError ...
    MASTER_ADDR). Without the shared store, rank 0's agent publishes it in every round."""
    env = dict(os.environ, OMP_NUM_THREADS="1", LOGLEVEL="INFO",
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    env.setdefault("DS_ACCELERATOR", "cpu")
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def agent_command(port: int, nproc: int, script: list[str], max_restarts: int,
                  rdzv_id: str = "malleus-nodes") -> list[str]:
    """torchrun for one node of an elastic 1-2 node job running ``script`` (a path, then its
    arguments) on ``nproc`` ranks."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
            f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id={rdzv_id}",
            f"--rdzv-conf={RDZV_CONF}", f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2", *script]


def start_agent(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """An agent in a session of its own (its tree can be killed as one), its output in ``log``."""
    with open(log, "a") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=agent_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def wait_hosting(port: int, agent: subprocess.Popen, timeout: float = 120.0) -> None:
    """Wait until ``agent`` listens on the rendezvous port: the agent started first hosts the
    store and must outlive the other node (a fixed delay is not enough on a loaded machine,
    where the second agent could bind the port first and take the store down with it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"the first agent does not listen on port {port} "
                       f"(exit code {agent.poll()})")


def kill_tree(p: subprocess.Popen, wait_s: float = 30.0) -> None:
    """The node is lost: its agent and its workers (in sessions of their own), at once. An agent
    already waited for is left alone (its pid may be another process's by now)."""
    if p.poll() is not None:
        return
    for pid in [p.pid] + descendants(p.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(wait_s)
