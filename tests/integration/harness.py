"""One multi-process harness for every distributed test (after DeepSpeed's DistributedTest).

``run_distributed(fn, world_size, *args)`` starts ``world_size`` fresh processes (spawn), each
initialises ``torch.distributed`` with gloo through a file rendezvous, calls ``fn(rank,
world_size, *args)`` and sends back its return value (must be picklable; tensors fine). Any
rank's exception fails the test with that rank's traceback; a hard timeout kills every process
so a hang fails instead of blocking CI. ``may_die``: ranks a test kills on purpose; dying without
reporting is their result (:class:`Died`), not a failure.

Ranks start from a fork server (``multiprocessing`` "forkserver") that imported torch (with
``torch._dynamo``), DeepSpeed and transformers' Llama-family modules once, with ``DS_ACCELERATOR=cpu`` and one thread: each
rank is a fork of that clean single-threaded process, so it skips ~2.5 s of imports (7 s with
transformers) that 4 ranks on 2 cores would otherwise pay per test. malleus_ds and
``malleus_ds_kernels`` are NOT preloaded: their import-time settings (``TRITON_INTERPRET``)
follow each test's ``env``.
``MALLEUS_TEST_SPAWN=1`` starts every rank from scratch instead (plain spawn).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from dataclasses import dataclass

import torch.multiprocessing as mp


def _entry(fn, rank, world_size, init_file, queue, args, env):
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                world_size=world_size)
        out = fn(rank, world_size, *args)
        # plain pickle copies tensor storages by value; the queue's own pickler would pass
        # shared-memory handles that die with this process
        queue.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # noqa: BLE001 - report any failure to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


#: torch._dynamo: torch imports it at the first optimizer a process builds (1.2 s per rank)
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "deepspeed",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.mistral.modeling_mistral"]
_SERVER_ENV = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
_CTX = None


def _context():
    """The fork-server context, its server started once with the preloads and CPU settings."""
    global _CTX
    if os.environ.get("MALLEUS_TEST_SPAWN") == "1":
        return mp.get_context("spawn")
    if _CTX is None:
        from multiprocessing import forkserver

        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        saved = {k: os.environ.get(k) for k in _SERVER_ENV}
        os.environ.update(_SERVER_ENV)          # the server (and every fork) sees these
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _CTX = ctx
    return _CTX


@dataclass(frozen=True)
class Died:
    """The result of a rank in ``may_die`` that exited without reporting (-9: SIGKILL)."""

    exitcode: int


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0, env: dict | None = None,
                    may_die=()):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return [result per rank]."""
    ctx = _context()
    queue = ctx.Queue()
    base_env = {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "MASTER_ADDR": "127.0.0.1",
                "RANK": "0", "WORLD_SIZE": str(world_size), "LOCAL_RANK": "0"}
    base_env.update(env or {})
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = []
        for r in range(world_size):
            e = dict(base_env, RANK=str(r), LOCAL_RANK=str(r))
            p = ctx.Process(target=_entry, args=(fn, r, world_size, init_file, queue, args, e),
                            daemon=True)
            p.start()
            procs.append(p)
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        import queue as _q
        import time

        deadline = time.monotonic() + timeout
        try:
            while len(results) + len(errors) < world_size:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"distributed test timed out after {timeout:.0f}s; "
                                       f"finished ranks: {sorted(results)}, failed: {sorted(errors)}")
                try:
                    rank, status, payload = queue.get(timeout=min(left, 1.0))
                except _q.Empty:
                    dead = [i for i, p in enumerate(procs)
                            if not p.is_alive() and p.exitcode not in (0, None)
                            and i not in results and i not in errors]
                    for i in [i for i in dead if i in may_die]:
                        results[i] = Died(procs[i].exitcode)
                    dead = [i for i in dead if i not in may_die]
                    if dead:
                        raise RuntimeError(f"ranks {dead} died (exit codes "
                                           f"{[procs[i].exitcode for i in dead]}) without reporting")
                    continue
                if status == "ok":
                    results[rank] = pickle.loads(payload)
                else:
                    errors[rank] = payload
                    break  # fail fast: the others may be stuck waiting on the failed rank
        finally:
            for p in procs:
                p.join(timeout=5 if not errors else 0.5)
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
        if errors:
            r = min(errors)
            raise AssertionError(f"rank {r} failed:\n{errors[r]}")
        return [results[r] for r in range(world_size)]
