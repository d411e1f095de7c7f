#!/usr/bin/env python
"""malleus_ds training app (Hydra). Runs under torchrun, the ``deepspeed`` launcher, or bare python.

    torchrun --nproc_per_node 2 launch/train.py engine=deepspeed train.steps=20
    deepspeed --num_gpus 2 launch/train.py engine=deepspeed   # GPUs (CPU: docs/getting-started.md)
    python launch/train.py                                          # one process (engine=torch)
    python launch/train.py nproc_per_node=2 engine=deepspeed        # spawns 2 ranks via torchrun
    python launch/train.py --multirun experiment=straggler_sweep 'straggler.schedule=[],[{rank:1,rate:4.0}]'

This file is only the edge: it makes Hydra behave under multi-process launchers, turns the
DictConfig into a frozen :class:`malleus_ds.app.config.RunConfig` (validated on every rank before any
process group exists) and hands it to the runner registry (:mod:`malleus_ds.app.runners`).

Multi-process rules:
- the ``--local_rank=K`` argument the deepspeed launcher appends is removed from ``sys.argv``
  before Hydra parses it (its value goes to ``LOCAL_RANK``);
- only rank 0 owns the Hydra run folder; other ranks get ``hydra.run.dir=.``,
  ``hydra.output_subdir=null`` and console-only logging, so they create no folders or files;
- a bare ``python launch/train.py nproc_per_node=N`` (N > 1) and every ``--multirun`` job (any N)
  launch their ``N`` ranks through torchrun as a subprocess, passing the job's overrides and its
  run folder; Hydra itself runs in the one outer process.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
if str(REPO) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

_LAUNCHED = ("RANK", "LOCAL_RANK")  # env vars torchrun / the deepspeed launcher set per rank
FATAL_NAME = "fatal.txt"     # in the run folder: why a rank ended the restarts
_END_RESTARTS_WAIT_S = 30.0  # under restarts, how long other ranks wait for local rank 0
#: a rank with a config error waits at most this long for the others to print theirs (they
#: leave as soon as all have: runners/said.py). 3 s was too short on a loaded machine: rank 0,
#: which sets up the Hydra run folder first, came 3+ s after its peer and was stopped unheard
_CONFIG_ERROR_GRACE_S = 15.0
_STOP_GRACE_S = 120.0  # after SIGTERM/SIGINT, ranks get this long to checkpoint and exit
#: what _launch_ranks returns after SIGTERM / SIGINT reached it (128 + the signal number)
_STOPPED_BY_SIGNAL = (128 + signal.SIGTERM, 128 + signal.SIGINT)



def _line(msg: str) -> None:
    """One line to stderr in ONE write: ranks failing at the same moment (they agree on a
    failure and raise together) must not interleave their lines (``print`` writes the text and
    the newline separately)."""
    sys.stderr.flush()
    data = (msg + "\n").encode(errors="replace")
    while data:
        data = data[os.write(2, data):]

def strip_local_rank(argv: list[str]) -> list[str]:
    """Remove ``--local_rank=K`` / ``--local-rank K`` (deepspeed launcher, torch.distributed.launch)
    from ``argv``; export K as ``LOCAL_RANK`` if the launcher did not."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        for flag in ("--local_rank", "--local-rank"):
            if a == flag and i + 1 < len(argv):
                os.environ.setdefault("LOCAL_RANK", argv[i + 1])
                i += 2
                break
            if a.startswith(flag + "="):
                os.environ.setdefault("LOCAL_RANK", a.split("=", 1)[1])
                i += 1
                break
        else:
            out.append(a)
            i += 1
    return out


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _non_zero_rank_overrides() -> list[str]:
    return ["hydra.run.dir=.", "hydra.output_subdir=null", "hydra/job_logging=stdout",
            "hydra/hydra_logging=none"]


def _restartable_run_dir(argv: list[str], env) -> list[str]:
    """Under ``torchrun --max-restarts N`` (N > 0) without a ``hydra.run.dir`` of the user's: a
    run folder named for torchrun's run id (the same in every restart, the same on every node),
    so each restart continues the job's metrics.jsonl instead of starting a new folder."""
    run_id = env.get("TORCHELASTIC_RUN_ID")
    if int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0) <= 0 or not run_id or run_id == "none":
        return []
    if any(a.lstrip("+").startswith("hydra.run.dir=") for a in argv):
        return []
    return [f"hydra.run.dir=outputs/elastic/{run_id}"]


def _launch_ranks(nproc: int, task_overrides: list[str], run_dir: str,
                  max_restarts: int = 0) -> int:
    """Start ``nproc`` local ranks of this app via torchrun; they re-compose the same config.

    torchrun runs in a session of its own and its workers in theirs, so a terminal's Ctrl-C
    reaches only this process: SIGTERM / SIGINT here are passed to every rank directly (they
    stop together at the next step boundary, checkpoint when ``checkpoint.dir`` is set, and
    exit cleanly, so torchrun ends quietly); a second signal, or ranks still running after
    :data:`_STOP_GRACE_S`, kills them all. No rank outlives this process. ``max_restarts``:
    torchrun restarts every rank when one fails, up to that many times (each continues from the
    latest checkpoint: ``checkpoint.resume=auto``)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}",
           str(Path(__file__).resolve()),
           *[o for o in task_overrides if not o.startswith("nproc_per_node=")],
           "nproc_per_node=1", f"hydra.run.dir={run_dir}"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["MALLEUS_DS_WRAPPED"] = "1"
    from malleus_ds.app.runners.elastic import FATAL_FILE_ENV
    env[FATAL_FILE_ENV] = str(Path(run_dir).absolute() / FATAL_NAME)
    Path(env[FATAL_FILE_ENV]).unlink(missing_ok=True)   # a reused run folder's old reason
    env["MALLEUS_DS_WRAPPER_PID"] = str(os.getpid())  # ranks stop when this process is gone
    print(f"[malleus_ds] launching {nproc} ranks: {' '.join(cmd)}", flush=True)
    from malleus_ds.resilience.procs import descendants

    proc = subprocess.Popen(cmd, env=env, start_new_session=True)
    got: list[int] = []
    got_at: list[float] = []

    def kill_all() -> None:
        for pid in descendants(proc.pid) + [proc.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def on_signal(signum, frame) -> None:
        if got:                                  # second signal: no more waiting
            kill_all()
            return
        got.append(signum)
        got_at.append(time.monotonic())
        print(f"[malleus_ds] {signal.Signals(signum).name}: stopping every rank at the next "
              f"step boundary (again to kill now)", file=sys.stderr, flush=True)
        for pid in descendants(proc.pid):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        killed = False
        while True:       # short waits: a signal handled meanwhile starts the grace period
            try:
                rc = proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                if got_at and not killed and time.monotonic() - got_at[0] > _STOP_GRACE_S:
                    print(f"[malleus_ds] ranks still running {_STOP_GRACE_S:.0f} s after the "
                          f"signal: killing them", file=sys.stderr, flush=True)
                    kill_all()
                    killed = True
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 128 + got[0] if got else rc


def _gave_up(plain: dict, restarts: int, run_dir: str) -> None:
    """The last word of a job torchrun stopped restarting: the checkpoint to resume from, and
    where torchrun's own report (above) names the failed rank; or, when a rank stopped the
    restarts (``app/runners/elastic.py``), why."""
    from malleus_ds.app.runners.resume import latest_note

    ck = (plain.get("checkpoint") or {}).get("dir")
    fatal = Path(run_dir) / FATAL_NAME
    if fatal.is_file():
        _line(f"[malleus_ds] the job stopped without restarting: every attempt would fail the "
              f"same way ({fatal.read_text().strip()}). {latest_note(ck)}")
        return
    _line(f"[malleus_ds] the job failed after {restarts} restart(s) (max_restarts={restarts}); "
          f"torchrun's report above names the failed rank and its exit code. "
          f"{latest_note(ck)}; metrics: {run_dir}/metrics.jsonl")


def _run_compare(engines: tuple[str, ...], plain: dict, nproc: int, task_overrides: list[str],
                 run_dir: str) -> int:
    """``compare=[e1,e2,...]``: the whole config once per engine, each in ``run_dir/<engine>``,
    then the side-by-side table (``malleus_ds/report/compare.py``) and the plot. Every engine's config
    is checked before the first one starts."""
    from malleus_ds.report.compare import no_straggler_note, report
    from malleus_ds.app.config import ConfigError, build_run_config
    from malleus_ds.app.runners import validate

    cfgs = {}
    try:
        for e in engines:
            cfgs[e] = build_run_config(dict(plain, engine=e, compare=[]), world_size=nproc,
                                       local_world_size=nproc,
                                       ds_search_dirs=(CONF_DIR / "deepspeed",))
            validate(cfgs[e])
    except ConfigError as err:
        print(f"[malleus_ds] config error (compare: engine={e}): {err}", file=sys.stderr,
              flush=True)
        return 2
    cfg = cfgs[engines[0]]
    warm, steps = cfg.train.warmup_steps, cfg.train.steps
    note = no_straggler_note(cfg.straggler.rates, warm, steps, nproc)
    if note:
        print(f"[malleus_ds] note: {note}", file=sys.stderr, flush=True)
    keep = [o for o in task_overrides
            if o.split("=", 1)[0].lstrip("+~") not in ("engine", "compare", "nproc_per_node")]
    for e in engines:
        print(f"[malleus_ds] compare: engine={e} ({engines.index(e) + 1} of {len(engines)})",
              flush=True)
        rc = _launch_ranks(nproc, [*keep, f"engine={e}", "compare=[]"], f"{run_dir}/{e}")
        if rc != 0:
            print(f"[malleus_ds] compare: the engine={e} run ended with status {rc}; no "
                  f"comparison", file=sys.stderr, flush=True)
            return rc
    text, png = report(run_dir, engines, warm)
    print(text, flush=True)
    if png is not None:
        print(f"  plot: {png}", flush=True)
    return 0


def main() -> None:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import DictConfig, OmegaConf

    @hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
    def app(cfg: DictConfig) -> None:
        from malleus_ds.app.config import ConfigError, build_run_config
        from malleus_ds.app.runners import DistEnv, execute, validate
        from malleus_ds.app.runners.guard import Stopped
        from malleus_ds.app.runners.common import format_summary
        from malleus_ds.migrate.transport import MigrationError
        from malleus_ds.resilience.watchdog import HANG_EXIT_CODE

        hc = HydraConfig.get()
        launched = any(k in os.environ for k in _LAUNCHED)
        nproc = cfg.get("nproc_per_node", 1)
        # a bad value (0, -1, 2.5, "abc", null) takes the in-process path: build_run_config
        # below refuses it with "nproc_per_node=... must be an integer >= 1"
        nproc = nproc if isinstance(nproc, int) and not isinstance(nproc, bool) and nproc > 1 else 1
        # --multirun jobs always get fresh rank processes: DeepSpeed keeps process-group state
        # in module globals, so two jobs in one process would share (destroyed) groups
        from hydra.types import RunMode
        plain = OmegaConf.to_container(cfg, resolve=True)
        from malleus_ds.app.config import compare_engines
        try:
            engines = compare_engines(plain.get("compare"))
        except ConfigError as e:
            print(f"[malleus_ds] config error: {e}", file=sys.stderr, flush=True)
            sys.exit(2)
        if engines and launched:
            print("[malleus_ds] config error: compare=... runs each engine as a job of its own: "
                  "start it from one process (python launch/train.py nproc_per_node=N "
                  "compare=[...]), not under torchrun or deepspeed", file=sys.stderr, flush=True)
            sys.exit(2)
        if engines:
            rc = _run_compare(engines, plain, nproc, list(hc.overrides.task),
                              hc.runtime.output_dir)
            if rc != 0:
                sys.exit(rc)
            return
        if not launched and (nproc > 1 or hc.mode == RunMode.MULTIRUN):
            try:  # fail here, with one clear message, before starting any rank
                validate(build_run_config(plain, world_size=nproc, local_world_size=nproc,
                                          ds_search_dirs=(CONF_DIR / "deepspeed",)))
            except ConfigError as e:
                print(f"[malleus_ds] config error: {e}", file=sys.stderr, flush=True)
                sys.exit(2)
            restarts = cfg.get("max_restarts", 0)
            rc = _launch_ranks(nproc, list(hc.overrides.task), hc.runtime.output_dir, restarts)
            if rc != 0:
                if restarts and rc not in _STOPPED_BY_SIGNAL:   # a stop says its own last line
                    _gave_up(plain, restarts, hc.runtime.output_dir)
                sys.exit(rc)
            return
        env = DistEnv.from_environ(str(cfg.get("device", "auto")))
        run_dir = hc.runtime.output_dir if env.is_rank0 else None
        try:
            rc = build_run_config(plain, world_size=env.world_size,
                                  local_world_size=env.local_world_size, run_dir=run_dir,
                                  ds_search_dirs=(CONF_DIR / "deepspeed",),
                                  elastic=env.restartable)
            summary = execute(rc, env)
        except Stopped as e:            # SIGTERM / SIGINT: every rank stopped together
            if env.is_rank0:
                _line(f"[malleus_ds] {e}")
            # under this app's own launcher the wrapper reports the signal: a clean exit here
            # keeps torchrun from printing a failure report for a stop that was asked for. When
            # the launcher died, whoever started it is gone too: a non-zero status would only
            # make a surviving deepspeed.launcher.launch SIGTERM the ranks still leaving
            from malleus_ds.app.runners.guard import LAUNCHER_GONE
            quiet = os.environ.get("MALLEUS_DS_WRAPPED") or e.signum == LAUNCHER_GONE
            sys.exit(0 if quiet else e.exit_code)
        except ConfigError as e:
            _line(f"[malleus_ds] config error (rank {env.rank}): {e}")
            # torchrun stops the other ranks as soon as one exits; the checks are the same
            # everywhere, so every rank prints its own message before they leave together
            # (rank 0 reaches them last: it sets up the Hydra run folder first)
            from malleus_ds.app.runners.said import leave_together
            leave_together(env, _CONFIG_ERROR_GRACE_S)
            if env.restartable:         # every attempt would fail so: no restart loop
                from malleus_ds.app.runners.elastic import end_restarts
                end_restarts(env, f"config error: {e}", _line)
                if env.local_rank != 0:     # exiting first would start a restart: let the
                    import time             # node's first rank stop the agent, which ends us
                    time.sleep(_END_RESTARTS_WAIT_S)
            sys.exit(2)
        except MigrationError as e:     # a plan switch failed; every rank raises it (agreed)
            # one line, and the watchdog's status: the job ends for a restart from a checkpoint
            _line(f"[malleus_ds] {' '.join(str(e).split())}")
            sys.exit(HANG_EXIT_CODE)
        if env.is_rank0:
            print(format_summary(rc, summary), flush=True)

    # run folders: time + pid, so two runs started in the same second never share one
    if not OmegaConf.has_resolver("pid"):
        OmegaConf.register_new_resolver("pid", lambda: str(os.getpid()))
    sys.argv = strip_local_rank(sys.argv)
    if any(k in os.environ for k in _LAUNCHED) and ({"--multirun", "-m"} & set(sys.argv)):
        print("[malleus_ds] --multirun inside torchrun/deepspeed is not supported (every rank "
              "would run the whole sweep). Run the sweep from one process instead: "
              "python launch/train.py --multirun nproc_per_node=N <overrides>", file=sys.stderr)
        sys.exit(2)
    if _rank() != 0:
        sys.argv += _non_zero_rank_overrides()
    else:
        sys.argv += _restartable_run_dir(sys.argv, os.environ)
    from malleus_ds.app.quick_exit import exit_quickly
    try:
        app()
    except SystemExit as e:
        exit_quickly(e.code)
    exit_quickly(0)


if __name__ == "__main__":
    main()
