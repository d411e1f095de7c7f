"""What every runner gets and returns: :class:`DistEnv` in, :class:`RunSummary` out."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..device import resolve_device
from ...report.metrics import Phase


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job, read from the launcher's environment variables
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, and ``LOCAL_WORLD_SIZE`` from torchrun or
    ``LOCAL_SIZE`` from the ``deepspeed`` launcher). A bare ``python launch/train.py`` is rank 0
    of 1."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    device: str = "cpu"          # "cpu" or "cuda:<local_rank>"
    backend: str = "gloo"        # gloo on CPU, nccl on GPU
    #: torchrun's restart of this job (``TORCHELASTIC_RESTART_COUNT``; 0: the first start, and
    #: a restart for a node joining or leaving; counted per agent)
    restart: int = 0
    elastic: bool = False        # under torchrun's elastic agent (``TORCHELASTIC_RUN_ID``)
    #: restarts the agent may make (``TORCHELASTIC_MAX_RESTARTS``; 0: none)
    max_restarts: int = 0
    #: when this process started the run (``time.perf_counter``): start-up time is measured from it
    started: float = field(default_factory=time.perf_counter, compare=False)

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def restartable(self) -> bool:
        """Under an elastic agent that restarts failed workers: a restart may bring another
        world size, and an error every attempt would meet again must end the job instead."""
        return self.elastic and self.max_restarts > 0

    @staticmethod
    def from_environ(device: str = "auto") -> "DistEnv":
        e = os.environ
        world = int(e.get("WORLD_SIZE", "1"))
        rank = int(e.get("RANK", "0"))
        local_rank = int(e.get("LOCAL_RANK", str(rank)))
        local_world = int(e.get("LOCAL_WORLD_SIZE") or e.get("LOCAL_SIZE") or world)
        restart = int(e.get("TORCHELASTIC_RESTART_COUNT") or 0)
        elastic = bool(e.get("TORCHELASTIC_RUN_ID"))
        max_restarts = int(e.get("TORCHELASTIC_MAX_RESTARTS") or 0)
        device = resolve_device(device)
        if device == "cuda":
            return DistEnv(rank, world, local_rank, local_world, f"cuda:{local_rank}", "nccl",
                           restart, elastic, max_restarts)
        return DistEnv(rank, world, local_rank, local_world, "cpu", "gloo", restart, elastic,
                       max_restarts)


def init_process_group(env: DistEnv, timeout_s: float | None = None) -> None:
    """Create the default process group (also for a single process, so every engine can use
    collectives and DeepSpeed finds one). ``timeout_s``: a collective waiting longer fails
    (``comm_timeout_s``; None = PyTorch's default). Idempotent."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if env.world_size == 1:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
    if env.device.startswith("cuda"):
        torch.cuda.set_device(env.local_rank)
    for k, v in nccl_env_defaults(env).items():
        os.environ.setdefault(k, v)         # a value the user set wins
    kw = init_kwargs(env)
    if timeout_s:
        kw["timeout"] = timedelta(seconds=timeout_s)
    store, attempt = attempt_store(env, kw.get("timeout", timedelta(seconds=300)))
    if store is not None:
        kw["store"] = store
    os.environ["MALLEUS_DS_ATTEMPT"] = attempt    # keys of this attempt (the watchdog's)
    dist.init_process_group(env.backend, rank=env.rank, world_size=env.world_size, **kw)


def attempt_store(env: DistEnv, timeout, environ=None):
    """Under torchrun's agent store (``TORCHELASTIC_USE_AGENT_STORE=True``): a store of this
    attempt alone, hosted by rank 0, and the attempt's id; ``(None, "0")`` elsewhere (``env://``
    as usual: no restarts, or a fresh store per attempt).

    The agent keeps one store server for the whole job, and ``env://`` keys carry no attempt:
    a restarted group read the dead group's addresses and could not connect. Nor can the restart
    count name an attempt: a node that joins later counts its own restarts, and a restart for a
    membership change counts none. So rank 0 hosts a new store and publishes ``id port`` in the
    agent's store (``malleus/attempt``); the other ranks take the published entry whose store
    answers with the same id. A stale entry names a store that died with its attempt."""
    import time
    import uuid
    from datetime import timedelta

    import torch.distributed as dist

    e = os.environ if environ is None else environ
    if e.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None, "0"
    host, key = e["MASTER_ADDR"], "malleus/attempt"
    agent = dist.TCPStore(host, int(e["MASTER_PORT"]), env.world_size, is_master=False,
                          timeout=timeout)
    if env.rank == 0:
        own = dist.TCPStore(host, 0, env.world_size, is_master=True, timeout=timeout,
                            wait_for_workers=False)
        token = uuid.uuid4().hex[:12]
        own.set("malleus/id", token)
        agent.set(key, f"{token} {own.port}")
        return own, token
    deadline = time.monotonic() + timeout.total_seconds()
    last = "nothing published"
    while time.monotonic() < deadline:
        try:
            agent.wait([key], timedelta(seconds=1))
            token, port = agent.get(key).decode().split()
            own = dist.TCPStore(host, int(port), env.world_size, is_master=False,
                                timeout=timedelta(seconds=2), wait_for_workers=False)
            if own.get("malleus/id").decode() == token:
                own.set_timeout(timeout)
                return own, token
            last = f"{host}:{port} answers with another id"
        except Exception as err:  # noqa: BLE001 - a stale entry: its store is gone
            last = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
        time.sleep(0.2)
    raise RuntimeError(f"rank {env.rank}: no store of this attempt from rank 0 within "
                       f"{timeout.total_seconds():.0f} s (last: {last})")

def init_kwargs(env: DistEnv) -> dict:
    """Extra ``init_process_group`` arguments. On NCCL, ``device_id``: the communicator is
    created eagerly, bound to this rank's GPU, so every point-to-point call of a pair shares it
    (lazily, single isend/recv would get a 2-rank communicator of their own; engine/wire.py)."""
    if env.backend != "nccl":
        return {}
    import torch

    return {"device_id": torch.device(env.device)}


def nccl_env_defaults(env: DistEnv) -> dict[str, str]:
    """PyTorch NCCL settings made when the backend is NCCL and the user did not set them (as
    torchtitan does): on an NCCL error or timeout the watchdog tears the process down without
    a hanging cleanup (``TORCH_NCCL_ASYNC_ERROR_HANDLING=3``), and the flight recorder keeps the
    last 20000 collectives and dumps them on a timeout (``TORCH_NCCL_TRACE_BUFFER_SIZE``,
    ``TORCH_NCCL_DUMP_ON_TIMEOUT``), so a hang can be traced to the call that never matched."""
    if env.backend != "nccl":
        return {}
    return {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3", "TORCH_NCCL_TRACE_BUFFER_SIZE": "20000",
            "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RunSummary:
    """What a run returns on every rank (losses are the global-batch means, the same on all)."""

    engine: str
    losses: tuple[float, ...]
    step_times_s: tuple[float, ...]          # wall time per step on this rank
    samples_per_step: int
    phases: tuple[Phase, ...] = ()           # throughput by emulated-straggler state (rank 0)
    metrics_path: str | None = None          # rank 0 only
    extra: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def samples_per_s(self) -> float:
        t = sum(self.step_times_s)
        return self.samples_per_step * len(self.step_times_s) / t if t > 0 else 0.0
