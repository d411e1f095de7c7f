"""``malleus-sim replay`` and ``malleus-sim trace`` (``malleus_ds/replay/``):

    malleus-sim trace --gpus N --hours H --regime persistent|transient|mixed|flapping [--seed S]
                      [--gpus-per-node 8] -o TRACE.csv
    malleus-sim replay PROBLEM.json TRACE.csv --step-s SEC [--hours H] [--policies static,oracle]
                       [--planner-time-limit SEC] [--seed S] [--json OUT] [--plot FILE.png]
                       [--loop-config MALLEUS.json] [--switch-costs k=v,..]
                       [--restart-costs k=v,..] [--zero-stage 1]

Bad input prints ``malleus-sim <sub>: error: ...`` naming the row or the field, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from ..plan import PlanError
from .cli_common import EXIT_BAD_INPUT, fail as _fail, load_problem


def trace_main(argv: Sequence[str]) -> int:
    from ..replay.regimes import REGIMES, generate
    from ..replay.trace import write_csv

    prog = "malleus-sim trace"
    ap = argparse.ArgumentParser(prog=prog, description="Write a straggler trace CSV drawn from "
                                 "published statistics (docs/TRACES.md).")
    ap.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    ap.add_argument("--hours", type=float, required=True, help="length of the trace")
    ap.add_argument("--regime", choices=REGIMES, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("-o", "--out", required=True, help="the CSV to write")
    a = ap.parse_args(argv)
    try:
        events = generate(a.regime, a.gpus, a.hours, a.seed, a.gpus_per_node)
    except ValueError as e:
        return _fail(prog, str(e))
    try:
        n = write_csv(events, a.out)
    except OSError as e:
        return _fail(prog, f"cannot write {a.out}: {e.strerror or e}")
    slow = len({e.gpu for e in events})
    print(f"wrote {a.out}: {n} rows, {slow} of {a.gpus} GPUs slow at some point over "
          f"{a.hours:g} h ({a.regime}, seed {a.seed})")
    return 0


def _replay_parser(prog: str) -> argparse.ArgumentParser:
    """``malleus-sim replay``'s arguments."""
    from ..replay.summary import POLICIES

    ap = argparse.ArgumentParser(prog=prog, description="Replay a training job under a "
                                 "straggler trace, policy by policy (docs/DESIGN.md §10).")
    ap.add_argument("problem", nargs="?",
                    help="problem JSON (its nominal layout; its rates are ignored)")
    ap.add_argument("trace", nargs="?", help="trace CSV: start_s,end_s,gpu,rate")
    ap.add_argument("--step-s", type=float,
                    help="seconds of one healthy step of the problem's static plan")
    ap.add_argument("--from-run", metavar="RUN_DIR",
                    help="instead: predict a recorded engine=malleus run (its config, schedule, "
                         "healthy step, switch costs) and set the prediction per phase against "
                         "what it measured")
    ap.add_argument("--hours", type=float, default=None,
                    help="length of the replay (default: the trace's last row's end)")
    ap.add_argument("--policies", default=",".join(POLICIES),
                    help=f"comma-separated (default: {','.join(POLICIES)})")
    ap.add_argument("--planner-time-limit", type=float, default=None,
                    help="seconds per planning (default: the planner's own by problem size)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--plot", help="write a PNG of every policy's throughput over the trace")
    ap.add_argument("--loop-config", help="the malleus policy's loop settings: a JSON object "
                    "of the ds_config malleus section's loop keys (detect, check, "
                    "horizon_steps, min_improvement, migrate_gbps, ...); default: the loop's "
                    "defaults")
    ap.add_argument("--switch-costs", default="",
                    help="a live switch's terms, k=v,...: network_gbps, nvlink_gbps (per GPU, "
                         "one direction), communicators_s (where new groups), warmup_steps "
                         "(where buffers change), warmup_kept_steps, fixed_s (default: "
                         "H100/H200, docs/TRACES.md)")
    ap.add_argument("--restart-costs", default="",
                    help="a restart's seconds, k=v,...: save_s, transform_s, init_s, load_s "
                         "(default: docs/TRACES.md)")
    ap.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=1,
                    help="the job's ZeRO stage (what a switch moves of the optimizer state)")
    return ap


def replay_main(argv: Sequence[str]) -> int:
    """``malleus-sim replay``: every policy over a trace, or ``--from-run`` a recorded run's
    prediction; 0, or 2 with a one-line error on bad input."""
    from ..replay.output import plot, table
    from ..replay.costs import MigrationCost, RestartCost
    from ..replay.run import ReplayError
    from ..replay.summary import replay
    from ..replay.trace import TraceError, read_csv

    prog = "malleus-sim replay"
    ap = _replay_parser(prog)
    a = ap.parse_args(argv)
    if a.from_run:
        return _from_run(prog, a)
    if a.problem is None or a.trace is None or a.step_s is None:
        return _fail(prog, "give PROBLEM.json TRACE.csv --step-s SEC, or --from-run RUN_DIR")
    try:
        pr = load_problem(a.problem)
    except PlanError as e:
        return _fail(prog, f"{a.problem}: {e}")
    try:
        settings = _loop_settings(a.loop_config)
        sw, rs = MigrationCost.parse(a.switch_costs), RestartCost.parse(a.restart_costs)
    except ValueError as e:
        return _fail(prog, str(e))
    try:
        tr = read_csv(a.trace, pr.num_gpus, a.hours)
        res = replay(pr, tr, a.step_s, a.policies.split(","), a.planner_time_limit, a.seed,
                     settings, sw, rs, a.zero_stage, progress=sys.stderr.isatty())
    except (TraceError, ReplayError) as e:
        return _fail(prog, str(e))
    print(table(res))
    if a.json and _write_json(prog, res, a.json):
        return EXIT_BAD_INPUT
    if a.plot:
        try:
            plot(res, a.plot)
        except OSError as e:
            return _fail(prog, f"cannot write {a.plot}: {e.strerror or e}")
        print(f"wrote {a.plot}")
    return 0


def _from_run(prog: str, a) -> int:
    from ..replay.from_run import FromRunError, build, compare, table

    if a.problem or a.trace:
        return _fail(prog, "--from-run builds the problem and the trace from the run; give "
                           "no PROBLEM.json or TRACE.csv with it")
    try:
        res = compare(build(a.from_run))
    except (FromRunError, ValueError) as e:
        return _fail(prog, str(e))
    print(table(res))
    if a.json and _write_json(prog, res, a.json):
        return EXIT_BAD_INPUT
    return 0


def _write_json(prog: str, res: dict, path: str) -> bool:
    """Write ``res`` to ``path`` and say so; on failure print the one-line error and return
    True."""
    try:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)
    except OSError as e:
        _fail(prog, f"cannot write {path}: {e.strerror or e}")
        return True
    print(f"wrote {path}")
    return False


def _loop_settings(path: str | None):
    """The malleus policy's loop settings from ``--loop-config`` (None: the defaults)."""
    from ..adaptive.settings import AdaptiveSettings

    if path is None:
        return AdaptiveSettings()
    try:
        with open(path) as f:
            sec = json.load(f)
    except OSError as e:
        raise ValueError(f"--loop-config: cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--loop-config: {path} is not JSON: {e}") from None
    if not isinstance(sec, dict):
        raise ValueError(f"--loop-config: {path} must hold a JSON object, got "
                         f"{type(sec).__name__}")
    return AdaptiveSettings.from_config(sec, where="--loop-config")
