"""Did any rank fail? Agreed through the job's store, never through a collective.

Contract: ``agree(name, err, timeout_s)`` is called by every rank of the default process group,
in the same order on every rank (the same sequence of ``name``s). ``err`` is this rank's error
text, or None if it succeeded. Within ``timeout_s`` every rank returns the SAME answer: None if
every rank reported success, else a :class:`Failure` naming the first failed rank and its
message (at most :data:`MAX_MESSAGE_BYTES`). A rank that has not reported by the deadline counts
as failed ("did not report within N s": it died or hangs); the call never waits longer. If the
store itself cannot be reached (its host died) it raises :class:`AgreementError`.

"First failed rank": the lowest rank whose failure is its own. A rank passes
``peer_caused=True`` when it failed only because a peer did (a transfer to a peer that stopped
answering): when one rank breaks, its peers time out too, and the lowest of those victims would
hide the cause. So the rank named is the lowest one with an error of its own or that stayed
silent; only if every failure was peer-caused, the lowest failed rank.

Why the store: on NCCL a timed-out ``Work.wait(timeout)`` aborts the communicator and a dead peer
breaks it, so "did anyone fail?" must not ride on the communicator that may have just failed.
The default group's store (``_get_default_store()``: a TCPStore under torchrun / deepspeed, a
FileStore in tests/integration/harness.py) is a separate TCP (or file) channel that outlives both.

Protocol of agreement ``n`` (a per-process counter; keys live under ``malleus_agree/n/``):

1. every rank sets ``n/{rank}`` = ``name`` + ``"\\n"`` + ``"ok"``, or ``"!"`` + its error
   (``"~"`` + its error when peer-caused);
2. it waits for all ``world`` keys (``store.wait``) until the deadline; absent ones are silent;
3. from what it saw it computes a verdict and offers it with ``compare_set(n/verdict, "", v)``:
   the first offer wins and every rank adopts the stored one. Ranks that saw every key compute
   the same verdict; only ranks that hit the deadline can differ (a key arriving just late), and
   the single stored verdict settles that, so no rank adopts while another refuses.
   A rank whose key carries another ``name`` is failed too (the ranks' calls diverged).

Clean-up: once every rank has reported in agreement ``n``, none reads agreement ``n-1`` (or
older) any more: each rank deletes its own keys there, rank 0 the verdicts. The store holds at
most the keys of the last completed agreement (``world + 1``) plus those of failed ones.

Pure: imports only torch.distributed (lazily) and the stdlib; no engine or app code.
"""
from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

#: bytes of a rank's error text that the other ranks receive
MAX_MESSAGE_BYTES = 2048
ROOT = "malleus_agree"
_OK = "ok"


class AgreementError(RuntimeError):
    """The job's store could not be reached, so the ranks cannot agree (its host is gone)."""


@dataclass(frozen=True)
class Failure:
    """The agreed outcome when some rank failed (the same on every rank)."""

    rank: int                   # the first failed rank (module docstring)
    message: str                # its error text, or why it counts as failed
    ranks: tuple[int, ...]      # every failed rank, ascending (errors and silent ranks)
    silent: tuple[int, ...]     # ranks that did not report by the deadline (died or hang)


def _cap(text: str) -> str:
    return str(text).encode()[:MAX_MESSAGE_BYTES].decode(errors="ignore")


class Agreements:
    """One rank's sequence of agreements (its counter and its keys still to delete).
    :func:`agree` uses one per process over the default group; tests make one per rank."""

    def __init__(self, root: str = ROOT) -> None:
        self.root = root
        self._seq = itertools.count()
        self._pending: list[str] = []       # prefixes of earlier agreements, keys not deleted

    def run(self, store, rank: int, world: int, name: str, err: str | None,
            timeout_s: float, peer_caused: bool = False) -> Failure | None:
        """See the module docstring; ``store`` shared by ranks ``0..world-1``."""
        if not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise ValueError(f"agreement {name!r}: timeout_s={timeout_s!r} must be a number > 0")
        if not (0 <= rank < world):
            raise ValueError(f"agreement {name!r}: rank={rank} is not in 0..world-1 "
                             f"(world={world})")
        if world == 1:
            return None if err is None else Failure(0, _cap(err), (0,), ())
        p = f"{self.root}/{next(self._seq)}"
        keys = [f"{p}/{r}" for r in range(world)]
        mine = f"{name}\n" + (_OK if err is None else ("~" if peer_caused else "!") + _cap(err))
        try:
            store.set(keys[rank], mine.encode())
            silent = _wait(store, keys, timeout_s)
            seen = [r for r in range(world) if r not in silent]
            vals = dict(zip(seen, store.multi_get([keys[r] for r in seen])))
            verdict = _verdict(name, vals, silent, timeout_s)
            agreed = store.compare_set(f"{p}/verdict", "", verdict).decode()
            if not silent:
                self._clean(store, rank)
            self._pending.append(p)
        except AgreementError:
            raise
        except Exception as e:  # noqa: BLE001 - any store failure: the store is gone
            raise AgreementError(f"agreement {name!r} (rank {rank} of {world}): the job's store "
                                 f"failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
                                 f"its host (the launcher's agent, or rank 0) may have died"
                                 ) from None
        if agreed == _OK:
            return None
        v = json.loads(agreed)
        return Failure(v["rank"], v["message"], tuple(v["ranks"]), tuple(v["silent"]))

    def _clean(self, store, rank: int) -> None:
        """Every rank reported in the current agreement: no rank reads the earlier ones now."""
        for q in self._pending:
            store.delete_key(f"{q}/{rank}")
            if rank == 0:
                store.delete_key(f"{q}/verdict")
        self._pending = []


#: the longest one store wait lasts: Python runs signal handlers only between such calls, so a
#: SIGTERM (a launcher ending the job) is acted on within this many seconds
WAIT_SLICE_S = 1.0


def _wait(store, keys: list[str], timeout_s: float) -> list[int]:
    """Wait for every key until the deadline; the indices of the keys still absent then."""
    deadline = time.monotonic() + timeout_s
    while True:
        start = time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=min(max(deadline - start, 0.001), WAIT_SLICE_S)))
            return []
        except Exception:  # noqa: BLE001 - a timeout; a dead store fails the check below too
            pass
        missing = [i for i, k in enumerate(keys) if not store.check([k])]
        if not missing or time.monotonic() >= deadline:
            return missing
        if time.monotonic() - start < WAIT_SLICE_S / 2:
            time.sleep(0.05)    # wait() returned early without its keys: try again, no spin


def _verdict(name: str, vals: dict[int, bytes], silent: list[int], timeout_s: float) -> str:
    """``"ok"`` or the JSON of a Failure, from the keys this rank saw."""
    failed: dict[int, str] = {}
    own: list[int] = list(silent)       # failures not caused by a peer
    for r, raw in vals.items():
        their, _, state = raw.decode(errors="replace").partition("\n")
        if their != name:
            failed[r] = (f"rank {r} was in agreement {their!r} while this one is {name!r}: "
                         f"the ranks' calls diverged")
            own.append(r)
        elif state != _OK:
            failed[r] = state[1:]
            if state[0] != "~":
                own.append(r)
    for r in silent:
        failed[r] = (f"rank {r} did not report within {timeout_s:g} s (it died or hangs); "
                     f"ranks that did not report: {silent}")
    if not failed:
        return _OK
    lo = min(own or failed)
    return json.dumps({"rank": lo, "message": failed[lo], "ranks": sorted(failed),
                       "silent": list(silent)})


_DEFAULT = Agreements()


def agree(name: str, err: str | None, timeout_s: float, peer_caused: bool = False
          ) -> Failure | None:
    """The agreement over the default process group's store (module docstring)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if world == 1:
        return _DEFAULT.run(None, 0, 1, name, err, timeout_s, peer_caused)
    from torch.distributed.distributed_c10d import _get_default_store

    return _DEFAULT.run(_get_default_store(), dist.get_rank(), world, name, err, timeout_s,
                        peer_caused)


def store_timeout_s() -> float:
    """The default group's store timeout in seconds: ``init_process_group`` sets it to the
    group's timeout (``comm_timeout_s`` in the app), the bound a collective would have had."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return 1800.0
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store().timeout.total_seconds()


def raise_if_any_failed(name: str, err: str | None, what: str,
                        error: type[Exception] = RuntimeError,
                        timeout_s: float | None = None) -> None:
    """Every rank learns whether any rank failed and, if one did, raises ``error`` naming the
    first failed rank's message: ``"{what} failed on rank(s) [..]: rank r: message"``, the same
    on every rank (so no rank carries on into a collective a failed rank never reaches); doubles
    as a barrier. ``name`` must be the same on every rank (``what`` may hold a path that is not).
    Deadline: ``timeout_s``, default the default group's timeout (``store_timeout_s``: the bound
    the collective this replaces had; a rank writing a big file is slow, not dead). A store that
    cannot be reached raises ``error`` too ("the ranks could not agree on its outcome")."""
    raise_failure(lambda: agree(name, err or None, store_timeout_s() if timeout_s is None
                                else timeout_s), what, error)


def raise_failure(decide: Callable[[], "Failure | None"], what: str,
                  error: type[Exception] = RuntimeError) -> None:
    """Raise ``error`` when the agreement ``decide()`` found a failed rank, or could not be
    reached: the one wording of every "did any rank fail?" (:func:`raise_if_any_failed`, and
    agreements of a sequence of their own, e.g. background checkpoint writes)."""
    try:
        bad = decide()
    except AgreementError as e:
        raise error(f"{what} failed: the ranks could not agree on its outcome ({e})") from None
    if bad is not None:
        raise error(f"{what} failed on rank(s) {list(bad.ranks)}: rank {bad.rank}: "
                    f"{bad.message}")
