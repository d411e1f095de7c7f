"""Runner registry: ``engine=<name>`` -> a module with ``run(cfg, env) -> RunSummary``.

The runner interface (what ``malleus_ds/app/runners/<name>_runner.py`` implements)::

    def validate(cfg: RunConfig) -> None          # optional; engine-specific checks.
        # Called on every rank BEFORE any process group exists; raise
        # malleus_ds.app.config.ConfigError with field names and numbers.

    def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
        # Called on every rank after torch.distributed's default group is up
        # (gloo on CPU, nccl on GPU; also for world_size 1). Train cfg.train.steps steps.
        # Use the shared pieces in malleus_ds.app.runners.common:
        #   replica_micro_batches(cfg, step, replica, replicas)  -> sample ids per micro-batch
        #   ComputeClock(cfg, env): clock.start_step(step); `with clock.compute(): fwd+bwd`
        #       (or clock.add(seconds)) -> measures compute and applies straggler emulation;
        #       communication inside a timed span goes in `with clock.excluded():` (or wrap
        #       methods with exclude_calls(obj, [names], clock)) so waiting is not compute
        #   Checkpointer(cfg, env) (app/runners/checkpoint.py): ck.start (first step; > 0 when
        #       resuming from ck.resumed), ck.after_step(done, write, reporter) each step,
        #       ck.finish(steps, write, reporter), reporter.finish(**ck.summary())
        #   StepReporter(cfg, env, first_step=ck.start): reporter.step_done(step,
        #       global_mean_loss, step_time_s, clock) on EVERY rank each step (it all-gathers
        #       compute seconds, or reads them from sums=, a step all-reduce's StepSums; rank 0
        #       writes cfg.run_dir/metrics.jsonl and the progress bar);
        #       return reporter.finish(**ck.summary()).
        # The loss passed to step_done is the global-batch mean (DESIGN.md §5), same on all ranks.

``cfg`` is a frozen :class:`malleus_ds.app.config.RunConfig`: ``cfg.model`` (ModelConfig),
``cfg.train`` (steps, batch sizes, seed, ``.optim`` -> OptimConfig), ``cfg.parallel`` (tp/pp/dp),
``cfg.cluster`` (gpus_per_node, nodes), ``cfg.straggler`` (StragglerSchedule),
``cfg.deepspeed`` (the ds_config dict + its file), ``cfg.plan`` ("static" or a plan JSON path),
``cfg.run_dir`` (rank 0 only), ``cfg.world_size``.

Modules are imported lazily by path, so ``engine=torch`` never imports deepspeed and a missing
runner only fails when it is selected.
"""
from __future__ import annotations

import importlib
from types import ModuleType

from ..run_config import ConfigError, RunConfig
from ...emulation.cpu_compete import release as release_competitors
from ...emulation.cpu_quota import release as release_quota
from .base import DistEnv, RunSummary, destroy_process_group, init_process_group
from .resume import nothing_to_run, resume_point, start_line
from .stream import check_monitor_packages

RUNNERS: dict[str, str] = {
    "torch": "malleus_ds.app.runners.torch_runner",
    "deepspeed": "malleus_ds.app.runners.deepspeed_runner",
    "malleus": "malleus_ds.app.runners.malleus_runner",
}

__all__ = ["RUNNERS", "DistEnv", "RunSummary", "get_runner", "validate", "run", "execute"]


def get_runner(engine: str) -> ModuleType:
    if engine not in RUNNERS:
        raise ConfigError(f"engine={engine!r} is not known; choose one of {sorted(RUNNERS)}")
    path = RUNNERS[engine]
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError as e:
        if e.name == path:
            raise ConfigError(f"engine={engine!r} is not available in this install: its runner "
                              f"module {path} does not exist yet") from None
        raise


def validate(cfg: RunConfig) -> ModuleType:
    """Engine-specific checks and, with ``checkpoint.resume``, the checkpoint to resume from (no
    process group needed). Returns the runner module."""
    mod = get_runner(cfg.engine)
    check_straggler_method(cfg.straggler)
    check = getattr(mod, "validate", None)
    if check is not None:
        check(cfg)
    check_monitor_packages(cfg)         # a ds_config monitor whose package is missing
    resume_point(cfg)
    return mod


def check_straggler_method(schedule, where: str = "straggler") -> None:
    """``straggler.method=quota`` (``compete``) on a machine that cannot cap a process's CPU
    (pin it) is a ConfigError naming the reason (every rank, before any process group)."""
    from ...emulation.straggler import StragglerError, check_method

    try:
        check_method(schedule, where=where)
    except StragglerError as e:
        raise ConfigError(str(e)) from None


def run(cfg: RunConfig, env: DistEnv) -> RunSummary:
    """Run ``cfg`` on this rank inside an existing default process group; a CPU quota or
    competitors the run set (``straggler.method=quota|compete``) are lifted when it ends."""
    try:
        return validate(cfg).run(cfg, env)
    finally:
        release_quota()
        release_competitors()


def execute(cfg: RunConfig, env: DistEnv | None = None) -> RunSummary:
    """The app's whole sequence on one rank: validate -> process group -> run -> tear down."""
    env = env or DistEnv.from_environ(cfg.device)
    mod = validate(cfg)
    saved = resume_point(cfg)
    if saved is not None and saved.step >= cfg.train.steps:
        return nothing_to_run(cfg, saved)       # no engine, no process group, no files
    from .guard import (
        STOP,
        LauncherWatch,
        Stopped,
        launchers_above,
        leave_when_a_peer_is_gone,
        start_watchdog)

    init_process_group(env, cfg.comm_timeout_s)
    if env.is_rank0:        # a big model takes a while to build or load: say what is going on
        from ..config import activation_checkpointing_note

        notes = [n for n in (getattr(cfg.model, "seq_len_note", None),
                             activation_checkpointing_note(cfg)) if n]
        print(f"[malleus_ds] building engine={cfg.engine} model={cfg.model.name} on "
              f"{env.world_size} rank(s)" + "".join(f"; {n}" for n in notes), flush=True)
        for n in cfg.deepspeed.notes + cfg.emulation_notes:
            print(f"[malleus_ds] {n}", flush=True)
        line = start_line(cfg, saved)
        if line:
            print(line, flush=True)
    STOP.install()
    orphan_watch = LauncherWatch(launchers_above(), env.rank).start()
    dog = start_watchdog(cfg, env)
    if dog is not None:     # a signal while a peer is dead: leave now (torchrun restarts us)
        STOP.on_first.append(lambda signum: leave_when_a_peer_is_gone(dog, env.rank, signum))
    try:
        try:
            summary = mod.run(cfg, env)
        except Stopped:             # every rank stopped after the same step
            _leave_together(env)
            raise
        except Exception:
            if dog is not None:     # a collective failed: a peer's process gone? name it
                dog.end_if_peers_gone()
            raise
        _leave_together(env)
        return summary
    finally:
        release_quota()             # straggler.method=quota: this process's cgroup, if any
        release_competitors()       # ...=compete: its competing processes, if any
        if dog is not None:
            dog.stop()
        orphan_watch.stop()
        STOP.uninstall()
        STOP.on_first.clear()
        destroy_process_group()


def _leave_together(env: DistEnv) -> None:
    """Every rank leaves together: a rank tearing gloo down while a peer still finishes its last
    transfer can abort the peer at exit ("terminate called without an active exception",
    SIGABRT) after a run that succeeded."""
    import torch.distributed as dist

    if dist.is_initialized() and env.world_size > 1:
        dist.barrier()
