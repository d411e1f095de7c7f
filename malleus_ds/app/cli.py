"""``malleus-plan``, ``malleus-sim`` and ``malleus-export`` commands.

    malleus-plan PROBLEM.json [-o PLAN.json] [--seed S] [--time-limit SEC] [--multi-objective]
    malleus-sim  PROBLEM.json [PLAN.json] [--plot FILE.png]
    malleus-sim  replay PROBLEM.json TRACE.csv --step-s SEC ... (``replay_cli.py``)
    malleus-sim  trace --gpus N --hours H --regime R -o TRACE.csv (``replay_cli.py``)
    malleus-export CHECKPOINT_DIR OUT_DIR [--dtype fp32|bf16|fp16] [--force]

Bad input (missing file, invalid JSON, invalid problem or plan) prints ``<prog>: error: ...``
on stderr and exits with code 2, like argparse's own usage errors.
"""
from __future__ import annotations

import argparse
import sys
from typing import Sequence

from ..plan import Plan, PlanError
from .cli_common import fail as _fail, load_problem as _load_problem


def plan_main(argv: Sequence[str] | None = None) -> int:
    prog = "malleus-plan"
    ap = argparse.ArgumentParser(prog=prog, description="Plan a straggler-aware Malleus layout.")
    ap.add_argument("problem", help="problem JSON (format: docs/DESIGN.md §3; examples: "
                                    "examples/problem_*.json)")
    ap.add_argument("-o", "--output", help="write the plan JSON here (default: stdout)")
    ap.add_argument("--seed", type=int, default=0, help="search seed (default 0)")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds the planner may take (default: 1.8 s up to 64 GPUs, growing to "
                         "50 s at 1024); the plan is valid regardless")
    ap.add_argument("--multi-objective", action="store_true",
                    help="with current_plan: search step time vs state moved; print the Pareto set")
    ap.add_argument("--pareto-dir", help="with --multi-objective: write each Pareto plan here as "
                                         "pareto_<k>.json (fastest first)")
    args = ap.parse_args(argv)
    if args.time_limit is not None and args.time_limit <= 0:
        return _fail(prog, f"--time-limit={args.time_limit} must be > 0 seconds")
    try:
        pr = _load_problem(args.problem)
    except PlanError as e:
        return _fail(prog, f"{args.problem}: {e}")
    from ..planner import plan

    try:
        res = plan(pr, seed=args.seed, time_limit=args.time_limit,
                   multi_objective=args.multi_objective)
    except PlanError as e:
        return _fail(prog, str(e))
    summary = f"{pr.name}: {res.summary()}"
    if args.output:
        try:
            res.plan.save(args.output)
        except OSError as e:
            return _fail(prog, f"cannot write {args.output}: {e}")
        print(summary)
    else:
        print(res.plan.dumps())
        print(summary, file=sys.stderr)
    stream = sys.stderr if not args.output else sys.stdout
    for k, pt in enumerate(res.pareto):
        where = ""
        if args.pareto_dir:
            from pathlib import Path

            out = Path(args.pareto_dir) / f"pareto_{k}.json"
            try:
                out.parent.mkdir(parents=True, exist_ok=True)
                pt.plan.save(out)
            except OSError as e:
                return _fail(prog, f"cannot write {out}: {e}")
            where = f" -> {out}"
        print(f"  pareto[{k}]: step_time={pt.step_time:.2f} moved={pt.moved_units:.1f} "
              f"layer-units{where}", file=stream)
    if args.multi_objective and pr.current_plan is None:
        print("  note: --multi-objective needs problem.current_plan; planned for step time only",
              file=stream)
    return 0


def sim_main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("replay", "trace"):
        from . import replay_cli

        return (replay_cli.replay_main if argv[0] == "replay" else replay_cli.trace_main)(argv[1:])
    prog = "malleus-sim"
    ap = argparse.ArgumentParser(prog=prog, description="Evaluate a plan under a problem's rates.")
    ap.add_argument("problem", help="problem JSON (format: docs/DESIGN.md §3; examples: "
                                    "examples/problem_*.json)")
    ap.add_argument("plan", nargs="?", help="plan JSON (format: docs/DESIGN.md §3; default: "
                                            "the static plan)")
    ap.add_argument("--plot", help="write a Gantt chart PNG of one step here")
    args = ap.parse_args(argv)
    try:
        pr = _load_problem(args.problem)
    except PlanError as e:
        return _fail(prog, f"{args.problem}: {e}")
    from ..cost import validate_for_problem
    from ..planner import all_baselines
    from ..simulate import build_timeline, gantt, summarize

    try:
        pl = Plan.load(args.plan) if args.plan else pr.static_plan()
        validate_for_problem(pr, pl)
    except PlanError as e:
        return _fail(prog, f"{args.plan or 'static plan'}: {e}")
    tl = build_timeline(pr, pl)
    s = summarize(pr, pl, tl)
    print(f"{pr.name}: plan {args.plan or '(static)'}: {len(pl.pipelines)} pipelines, "
          f"{sum(len(p.stages) for p in pl.pipelines)} stages")
    print(s.text())
    from ..cost import efficiency

    parts = []
    for k, p in all_baselines(pr).items():
        parts.append(f"{k}={'n/a' if p is None else f'{efficiency(pr, p):.3f}'}")
    print("baselines eta: " + " ".join(parts))
    if args.plot:
        try:
            gantt(pr, pl, args.plot, tl)
        except OSError as e:
            return _fail(prog, f"cannot write {args.plot}: {e}")
        print(f"wrote {args.plot}")
    return 0


def export_main(argv: Sequence[str] | None = None) -> int:
    """``malleus-export`` (``malleus_ds/export/``: what it writes and from which engines)."""
    from ..export import DTYPES, PROG, ExportError, _export_checkpoint, _summary

    ap = argparse.ArgumentParser(
        prog=PROG, description="Write a training checkpoint as a Hugging Face model folder "
                               "(config.json + model.safetensors).")
    ap.add_argument("checkpoint", help="checkpoint.dir of a launch/train.py run (its 'latest' is "
                                       "exported) or one of its global_step* folders")
    ap.add_argument("out", help="output folder (created; must be empty unless --force)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32",
                    help="dtype of the written weights (default fp32)")
    ap.add_argument("--force", action="store_true",
                    help="write into an existing non-empty output folder")
    ap.add_argument("--to", choices=("hf", "deepspeed-universal"), default="hf",
                    help="hf: a Hugging Face model folder (default); deepspeed-universal: a "
                         "DeepSpeed universal checkpoint (weights, Adam state, LR schedule) "
                         "that stock DeepSpeed continues with checkpoint.load_universal")
    args = ap.parse_args(argv)
    if args.to == "deepspeed-universal":
        from ..export.ds_universal import summary, write_universal

        try:
            t, rec = write_universal(args.checkpoint, args.out, args.force)
        except ExportError as e:
            return _fail(PROG, str(e))
        except OSError as e:
            return _fail(PROG, f"cannot export {args.checkpoint} to {args.out}: {e}")
        print(summary(t, rec))
        return 0
    try:
        res, d, run = _export_checkpoint(args.checkpoint, args.out, args.dtype, args.force)
    except ExportError as e:
        return _fail(PROG, str(e))
    except OSError as e:
        return _fail(PROG, f"cannot export {args.checkpoint} to {args.out}: {e}")
    print(f"{_summary(res)} from {d} (engine={run.get('engine')}, step {run.get('step')})")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(plan_main())
