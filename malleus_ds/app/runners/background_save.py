"""Checkpoints written while training goes on (``checkpoint.background``, engine=malleus).

At the step boundary every rank copies its state to host memory (``snapshot_checkpoint``:
collective, the only part training waits for); a thread of its own then writes the rank file
and, once every rank's file is complete, rank 0 commits the engine's ``meta.json``, the app's
``run.json`` and ``latest``, in that order. The next save, a stop and the end of the run wait
for the write in flight. A crash mid-write leaves ``latest`` on the previous checkpoint: the
folder being written has no ``run.json`` yet.

"Did every rank's write succeed?" is agreed through the job's store by the writing threads,
with an agreement sequence of their own (``Agreements`` under ``malleus_ckpt_bg``), so they never
interleave with the training thread's; a failure reaches every rank, which raises it at its
next wait (:class:`~malleus_ds.app.runners.checkpoint.CheckpointSaveError`).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

#: ``persist(agree)``: writes one save's files and commits it; ``agree(err, what)`` raises on
#: every rank when any rank failed
Persist = Callable[[Callable[[str | None, str], None]], None]


class EngineWriter:
    """The app's writer for an engine with DeepSpeed's ``save_checkpoint`` (stock DeepSpeed and
    MalleusEngine): ``writer(root, tag, done)`` saves on this thread, the engine's own files
    with the step as client state (the app writes ``latest`` itself, after ``run.json``).
    :meth:`snapshot` (engines with ``snapshot_checkpoint``) splits a save for the background."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def __call__(self, root: Path, tag: str, done: int) -> None:
        self.engine.save_checkpoint(str(root), tag=tag, client_state={"step": done},
                                    save_latest=False)

    @property
    def can_snapshot(self) -> bool:
        return hasattr(self.engine, "snapshot_checkpoint")

    def snapshot(self, root: Path, tag: str, done: int) -> Persist:
        from ...engine.checkpoint_save import write_snapshot

        snap = self.engine.snapshot_checkpoint(str(root), tag=tag, client_state={"step": done},
                                               save_latest=False)
        return lambda agree: write_snapshot(snap, agree)


@dataclass
class InFlight:
    """One save being written in the background."""

    tag: str
    path: Path
    step: int = 0                   # the steps done that it saves
    thread: threading.Thread | None = None
    error: str | None = None
    write_s: float = 0.0
    event: dict = field(default_factory=dict)


_AGREEMENTS = None


def _agreements():
    """The writing threads' agreement sequence: one per process, like the training thread's
    (``agreement.agree``), so a second run in one process (tests, notebooks) does not reuse
    the first run's numbers and read its keys."""
    global _AGREEMENTS
    if _AGREEMENTS is None:
        from ...resilience.agreement import Agreements
        _AGREEMENTS = Agreements("malleus_ckpt_bg")
    return _AGREEMENTS


class BackgroundSaves:
    """Runs each save's write on a thread; :meth:`wait` joins it and raises its (agreed) error.
    ``commit()``: rank 0's part after the engine's files (``run.json`` and ``latest``)."""

    def __init__(self, rank: int, world: int, error: type[Exception]) -> None:
        self.rank, self.world, self.error = rank, world, error
        self._agreements = _agreements()
        self._client = None
        self.current: InFlight | None = None

    def _store(self):
        """A client of the default group's store of the writing thread's own (``clone``: a
        client is not shared across threads); the agreements' keys live under
        ``malleus_ckpt_bg``. The default store is this attempt's (``base.attempt_store``), so
        no key of a dead attempt is read."""
        if self.world == 1:
            return None
        if self._client is None:
            from torch.distributed.distributed_c10d import _get_default_store

            self._client = _get_default_store().clone()
        return self._client

    def agree(self, err: str | None, what: str) -> None:
        from ...resilience.agreement import raise_failure, store_timeout_s

        try:
            store = self._store()
        except Exception as e:  # noqa: BLE001 - the store's host is gone
            raise self.error(f"{what} failed: the job's store cannot be reached ({e})") from None
        raise_failure(lambda: self._agreements.run(store, self.rank, self.world,
                                                   what.split("(", 1)[0], err,
                                                   store_timeout_s()), what, self.error)

    def start(self, job: InFlight, persist: Persist, commit: Callable[[], str | None]) -> None:
        """Write ``job`` on a thread: the engine's files (``persist``), then rank 0's
        ``commit()`` (returns an error text or None), agreed by every rank."""
        def run() -> None:
            t0 = time.perf_counter()
            try:
                persist(self.agree)
                err = commit() if self.rank == 0 else None
                self.agree(err, f"saving checkpoint {job.path}")
            except Exception as e:  # noqa: BLE001 - raised on every rank by wait()
                job.error = str(e) if isinstance(e, self.error) else \
                    f"saving checkpoint {job.path} failed: {type(e).__name__}: {e}"
            job.write_s = time.perf_counter() - t0

        job.thread = threading.Thread(target=run, name=f"malleus-ckpt-{job.tag}", daemon=True)
        self.current = job
        job.thread.start()

    def wait(self) -> InFlight | None:
        """The save in flight, written and committed (None if there is none); raises its error
        on every rank."""
        job, self.current = self.current, None
        if job is None:
            return None
        job.thread.join()
        if job.error is not None:
            raise self.error(job.error)
        return job
