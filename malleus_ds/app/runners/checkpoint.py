"""App checkpoints (``checkpoint.dir`` / ``every`` / ``resume``), shared by the three runners.

One folder per ``checkpoint.dir``::

    DIR/latest               the tag of the newest complete checkpoint (rank 0 writes it last)
    DIR/global_step{N}/      one checkpoint; N = optimizer steps done
        run.json             the app's record (resume.py), written after every engine file
        ...                  the engine's own files:
                               engine=malleus    malleus_rank*.pt + meta.json (engine/checkpoint.py)
                               engine=deepspeed  DeepSpeed's stock files (mp_rank_*, zero_pp_*)
                               engine=torch      torch_state.pt (rank 0: model, optimizer, step)

What ``run.json`` holds and how a run resumes from it: :mod:`.resume`. Saving
(:class:`Checkpointer`) writes the engine's files, then ``run.json``, then ``latest``; with
``checkpoint.background`` the write runs on a thread of its own (:mod:`.background_save`).

A save that fails (a full or read-only disk, on any rank: every rank learns it) does not end the
job: ``latest`` still names the last committed checkpoint, the half-written folder is removed,
every rank warns, and the save is tried again after 1, 2, 4, ... steps (at most
``checkpoint.every``). The saves a run cannot go on without, at its end and on a stop, are tried
:data:`MUST_TRIES` times before the error ends the job.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

from ...files.ckpt_format import LATEST, RUN_FILE
from ..run_config import ConfigError, RunConfig
from ...files.fileio import atomic_write_text
from ...resilience.watchdog import phase
from .base import DistEnv
from .resume import read_saved, resume_point, run_record, tag_of


def _raise_first_error(err: str | None, what: str) -> None:
    """Every rank learns every rank's error (so none carries on alone) and raises the first
    (``agreement.raise_if_any_failed``)."""
    from ...resilience.agreement import raise_if_any_failed

    raise_if_any_failed("app-checkpoint", err, what, CheckpointSaveError)


def _barrier(env: DistEnv) -> None:
    if env.world_size > 1:
        import torch.distributed as dist

        dist.barrier()


class CheckpointSaveError(RuntimeError):
    """Saving a checkpoint failed (on some rank); raised on every rank."""


#: a save the run cannot go on without (its end, a stop) is tried this many times...
MUST_TRIES = 3
#: ...waiting this many seconds before the second try, twice as long before each next one
MUST_WAIT_S = 2.0


#: ``write(root, tag, step)``: the engine's save of its state after ``step`` steps into
#: ``root/tag`` (collective for engine=malleus/deepspeed), without touching ``root/latest``.
Writer = Callable[[Path, str, int], None]


def engine_writer(engine) -> Writer:
    """A :data:`Writer` for an engine with DeepSpeed's ``save_checkpoint`` (stock DeepSpeed and
    MalleusEngine; ``background_save.EngineWriter``, which also splits a save for the
    background where the engine can)."""
    from .background_save import EngineWriter

    return EngineWriter(engine)


def prune(root: Path, newest: int, keep: int) -> list[tuple[Path, str | None]]:
    """``checkpoint.keep``: delete the checkpoints of ``root`` older than the ``keep`` newest,
    after ``global_step{newest}`` was committed (``latest`` names it, so what is deleted is never
    what a restart would load). Only ``global_step<N>`` folders with ``N < newest`` are touched;
    the folder's ``run.json`` goes first, so a deletion cut short leaves an uncommitted folder,
    never a committed partial one. Returns ``[(folder, error or None)]`` of the folders deleted."""
    import re
    import shutil

    steps = sorted((int(m.group(1)), p) for p in root.iterdir()
                   if p.is_dir() and (m := re.fullmatch(r"global_step(\d+)", p.name))
                   and int(m.group(1)) < newest)
    out = []
    for _, p in steps[:max(0, len(steps) - (keep - 1))]:
        try:
            (p / RUN_FILE).unlink(missing_ok=True)
            shutil.rmtree(p)
            out.append((p, None))
        except OSError as e:
            out.append((p, str(e)))
    return out


class Checkpointer:
    """A runner's side of checkpointing: where the run starts, when it saves, summary facts.

    Loop::

        ck = Checkpointer(cfg, env)
        if ck.resumed: <engine load from ck.resumed.root / ck.resumed.tag>
        for step in range(ck.start, cfg.train.steps):
            ...; reporter.step_done(step, ...)
            ck.after_step(step + 1, write, reporter)
        ck.finish(cfg.train.steps, write, reporter)
        return reporter.finish(**ck.summary())
    """

    def __init__(self, cfg: RunConfig, env: DistEnv) -> None:
        self.cfg, self.env = cfg, env
        self.resumed = resume_point(cfg)
        self.start = self.resumed.step if self.resumed else 0
        #: the newest step this run has committed (``latest`` names it)
        self.committed: int | None = self.start if self.resumed else None
        self.tags: list[str] = []
        #: saves that failed: ``{"step", "error"}`` each (the summary lists them)
        self.failed: list[dict] = []
        self._retry_at: int | None = None   # after a failed save: the step to try again at
        self._backoff = 1                   # ...and how many steps the next failure waits
        #: rank 0: more of ``run.json`` at each save (engine=malleus: the measured rates)
        self.extra: Callable[[], dict] | None = None
        c = cfg.checkpoint
        self._background = None     # background_save.BackgroundSaves (checkpoint.background)
        if c.enabled and c.background:
            from .background_save import BackgroundSaves
            self._background = BackgroundSaves(env.rank, env.world_size, CheckpointSaveError)
        if c.enabled and not c.resume and env.is_rank0:
            try:
                old = read_saved(Path(c.dir))
            except ConfigError:
                old = None
            if old is not None:
                print(f"[malleus_ds] note: checkpoint.dir={c.dir} already holds checkpoints "
                      f"('latest' = {old.tag}); this run starts from scratch "
                      f"(checkpoint.resume=false) and overwrites the tags it reaches",
                      file=sys.stderr, flush=True)

    def after_step(self, done: int, write: Writer, reporter=None) -> None:
        """Save if ``checkpoint.every`` divides ``done`` (steps done), or a failed save is due
        again; a stop some rank was asked for saves (a save it must make) and raises
        :class:`~.guard.Stopped`."""
        c = self.cfg.checkpoint
        due = c.enabled and ((c.every > 0 and done % c.every == 0)
                             or (self._retry_at is not None and done >= self._retry_at))
        if due:
            self._try(done, lambda: self.save(done, write, reporter), reporter)
        if reporter is not None and reporter.stop_signal:     # agreed by every rank
            from .guard import Stopped

            try:
                self._must(done, write, reporter)   # the checkpoint named below is committed
            except CheckpointSaveError as e:
                # the stop still stops (every rank learns the failure alike): an error here
                # would have torchrun restart a job it was asked to end; the next run
                # continues from the latest checkpoint and does the steps since again
                reporter.close()
                raise Stopped(reporter.stop_signal, done, unsaved=str(e)) from None
            reporter.close()
            raise Stopped(reporter.stop_signal, done,
                          str(Path(c.dir) / tag_of(done)) if c.enabled else None)

    def finish(self, done: int, write: Writer, reporter=None) -> None:
        """The end-of-run save (when ``checkpoint.dir`` is set and it has not just saved)."""
        self._must(done, write, reporter)

    def _must(self, done: int, write: Writer, reporter) -> None:
        """Nothing in flight, and ``done`` saved and committed where the run saves and trained
        since its start: tried :data:`MUST_TRIES` times (every rank the same, since every rank
        learns each failure), then the error raised."""
        wait_s = MUST_WAIT_S
        for attempt in range(1, MUST_TRIES + 1):
            last = attempt == MUST_TRIES
            then = "no tries left" if last else f"trying again in {wait_s:g} s"
            try:
                self.wait(reporter, then=then)
                c = self.cfg.checkpoint
                if c.enabled and done > self.start and self.committed != done:
                    try:
                        self.save(done, write, reporter)
                    except CheckpointSaveError as e:
                        self._note_failure(done, str(e), reporter, then)
                        raise
                    self.wait(reporter, then=then)
                return
            except CheckpointSaveError as e:
                if last:
                    raise CheckpointSaveError(f"{e} ({MUST_TRIES} tries; the latest checkpoint "
                                              f"is {self._latest_text()})") from None
                time.sleep(wait_s)
                wait_s *= 2

    def wait(self, reporter=None, then: str | None = None) -> None:
        """The background save in flight (``checkpoint.background``), written and committed.
        Its failure (the same on every rank) is noted; then, without ``then``, it is a warning
        and the save is tried again after a few steps; with ``then`` (what happens next, for
        the warning) it is raised. No-op without a save in flight."""
        if self._background is None or self._background.current is None:
            return
        step = self._background.current.step
        with phase("checkpoint"):       # patient: a big write is slow, not hung
            try:
                job = self._background.wait()
            except CheckpointSaveError as e:
                if then is not None:
                    self._note_failure(step, str(e), reporter, then)
                    raise
                self._failed(step, str(e), reporter)
                return
        self._committed_at(job.step)
        self.tags.append(job.tag)
        if reporter is not None:
            reporter.note(dict(job.event, write_s=round(job.write_s, 6)))

    def _try(self, done: int, save: Callable[[], None], reporter) -> None:
        try:
            save()
        except CheckpointSaveError as e:
            self._failed(done, str(e), reporter)

    def _committed_at(self, step: int) -> None:
        self.committed = step
        self._retry_at, self._backoff = None, 1

    def _failed(self, step: int, err: str, reporter) -> None:
        """A periodic save of ``step`` failed: training goes on, and the save is tried again
        after 1, 2, 4, ... steps (at most ``checkpoint.every``)."""
        self._retry_at = step + self._backoff
        self._backoff = min(2 * self._backoff, max(1, self.cfg.checkpoint.every))
        self._note_failure(step, err, reporter,
                           f"training goes on; trying again after step {self._retry_at}")

    def _note_failure(self, step: int, err: str, reporter, then: str) -> None:
        """Every rank: the failed save of ``step`` recorded (rank 0 removes its half-written
        folder), an event line, and rank 0's warning saying ``then``, what happens next."""
        self.failed.append({"step": step, "error": err})
        if self.env.is_rank0:
            self._drop_partial(step)
            print(f"[malleus_ds] warning: {err}; {then}; the latest checkpoint is "
                  f"{self._latest_text()}", file=sys.stderr, flush=True)
        if reporter is not None:
            reporter.note({"event": "checkpoint_failed", "step": step, "error": err,
                           "then": then, "latest": self._latest_tag()})

    def _latest_tag(self) -> str | None:
        """The tag ``latest`` names on disk now (what a restart would load), or None."""
        try:
            return (Path(self.cfg.checkpoint.dir) / LATEST).read_text().strip() or None
        except OSError:
            return None

    def _latest_text(self) -> str:
        tag = self._latest_tag()
        return "none yet" if tag is None else str(Path(self.cfg.checkpoint.dir) / tag)

    def _drop_partial(self, step: int) -> None:
        """Rank 0: remove the uncommitted folder of a failed save (space back on a full disk),
        unless ``latest`` names it (a folder of an earlier run, then overwritten)."""
        import shutil

        tag = tag_of(step)
        if self._latest_tag() != tag:
            shutil.rmtree(Path(self.cfg.checkpoint.dir) / tag, ignore_errors=True)

    def save(self, done: int, write: Writer, reporter=None) -> None:
        """``write`` the engine state into ``dir/global_step{done}``, then rank 0 commits it:
        ``run.json`` and ``latest``, each only after every rank's files are complete."""
        with phase("checkpoint"):
            self._save(done, write, reporter)

    def _save(self, done: int, write: Writer, reporter=None) -> None:
        t0 = time.perf_counter()    # "seconds": what this save holds the training thread
        self.wait(reporter)         # one save in flight at a time
        root, tag = Path(self.cfg.checkpoint.dir), tag_of(done)
        err = None
        if self.env.is_rank0:       # an older save under this tag is uncommitted from here on
            try:
                (root / tag).mkdir(parents=True, exist_ok=True)
                (root / tag / RUN_FILE).unlink(missing_ok=True)
            except OSError as e:
                err = f"cannot prepare {root / tag}: {e}"
        _raise_first_error(err, f"saving checkpoint {root / tag}")
        # rank 0's record is taken now, at the step it describes (rates included)
        rec = dict(run_record(self.cfg, done), **(self.extra() if self.extra else {})) \
            if self.env.is_rank0 else None

        def commit() -> str | None:     # rank 0, after every rank's engine files
            try:
                atomic_write_text(root / tag / RUN_FILE, json.dumps(rec, indent=1) + "\n")
                atomic_write_text(root / LATEST, tag)
            except OSError as e:
                return f"cannot commit {root / tag / RUN_FILE}: {e}"
            if self.cfg.checkpoint.keep:
                for gone, why in prune(root, done, self.cfg.checkpoint.keep):
                    if why:
                        print(f"[malleus_ds] checkpoint.keep: could not delete {gone}: {why}",
                              file=sys.stderr, flush=True)
            return None

        event = {"event": "checkpoint", "step": done, "path": str(root / tag)}
        if self._background is not None and getattr(write, "can_snapshot", False):
            from .background_save import InFlight
            try:
                persist = write.snapshot(root, tag, done)     # collective: host copies
            except Exception as e:  # noqa: BLE001 - the engine agreed it on every rank
                raise CheckpointSaveError(f"saving checkpoint {root / tag} failed: {e}") from None
            pause = time.perf_counter() - t0
            job = InFlight(tag, root / tag, step=done,
                           event=dict(event, seconds=round(pause, 6), background=True))
            self._background.start(job, persist, commit)
            return
        try:
            write(root, tag, done)
        except Exception as e:  # noqa: BLE001 - reported on every rank by _agree
            err = f"{type(e).__name__}: {e}"
        _raise_first_error(err, f"saving checkpoint {root / tag}")
        if self.env.is_rank0:
            err = commit()
        _raise_first_error(err, f"saving checkpoint {root / tag}")
        self._committed_at(done)
        self.tags.append(tag)
        if reporter is not None:
            reporter.note(dict(event, seconds=round(time.perf_counter() - t0, 6)))

    def summary(self) -> dict:
        """``RunSummary.extra`` entries for :func:`common.format_summary`."""
        out: dict[str, Any] = {}
        if self.resumed is not None:
            out["resumed_from"] = {"step": self.resumed.step, "path": str(self.resumed.path)}
        if self.tags:
            out["checkpoints"] = {"dir": self.cfg.checkpoint.dir, "tags": list(self.tags)}
        if self.failed:
            out["failed_saves"] = list(self.failed)
        return out
