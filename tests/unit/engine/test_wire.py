"""engine/wire.py: every plan's pipeline messages obey NCCL's rules (matched by order per pair,
one API, no deadlock when each rank's calls run in order on one stream) -- without processes."""
import dataclasses
import random

import pytest

from malleus_ds.engine.wire import (Op, deadlock_problems, nccl_problems, order_problems,
                                    pipeline_peers, plan_calls)
from malleus_ds.plan import Pipeline, Plan, Stage


def random_plan(rng: random.Random) -> Plan:
    """1-4 pipelines side by side, each 1-8 stages of TP 1/2/4 (TP sizes differ between
    neighbours), 1-8 micro-batches each; some ranks suspended."""
    L = 8
    rank, pipes = 0, []
    for _ in range(rng.randint(1, 4)):
        S = rng.randint(1, 8)
        cuts = sorted(rng.sample(range(1, L), S - 1))
        bounds = [0, *cuts, L]
        stages = []
        for j in range(S):
            g = rng.choice([1, 1, 2, 4])
            stages.append(Stage(ranks=tuple(range(rank, rank + g)),
                                layers=(bounds[j], bounds[j + 1])))
            rank += g
        pipes.append(Pipeline(micro_batches=rng.randint(1, 8), stages=tuple(stages)))
    suspended = tuple(range(rank, rank + rng.randint(0, 2)))
    gbs = sum(p.micro_batches for p in pipes)
    return Plan(num_layers=L, global_batch_size=gbs, micro_batch_size=1, pipelines=tuple(pipes),
                suspended=suspended)


def test_random_plans_obey_nccl_rules():
    rng = random.Random(0)
    seen_deep = 0
    for _ in range(400):
        plan = random_plan(rng)
        assert nccl_problems(plan) == [], plan.describe()
        seen_deep += any(len(p.stages) >= 3 for p in plan.pipelines)
        for r in plan.suspended:
            assert pipeline_peers(plan, r) is None
    assert seen_deep > 100


@pytest.mark.parametrize("stages,micro", [(4, 4), (3, 2), (2, 1), (8, 1), (8, 8)])
def test_the_cases_that_used_to_hang(stages, micro):
    """Before: a send not followed by a receive went out as a single isend, received by a single
    recv on the other side or inside a batch: the checker finds that wiring wrong, and finds the
    engine's wiring right."""
    plan = Plan(num_layers=8, global_batch_size=micro, micro_batch_size=1,
                pipelines=(Pipeline(micro, tuple(Stage((j,), (j * 8 // stages, (j + 1) * 8 // stages))
                                                 for j in range(stages))),))
    calls = plan_calls(plan)
    assert order_problems(calls) == [] and deadlock_problems(calls) == []
    # the old wiring: lone sends/receives used the single-op API, paired ones were batched
    old = {r: [tuple(dataclasses.replace(o, api="batch" if len(c) > 1 else "single") for o in c)
               for c in cs] for r, cs in calls.items()}
    if stages >= 3 or micro == 1:
        assert any("via single" in p and "via batch" in p for p in order_problems(old)), \
            order_problems(old)


def test_the_checkers_can_fail():
    # a swapped order on one side, and two ranks each waiting to receive first
    calls = {0: [(Op(0, True, 1, "act", 0),), (Op(0, True, 1, "act", 1),)],
             1: [(Op(1, False, 0, "act", 1),), (Op(1, False, 0, "act", 0),)]}
    assert len(order_problems(calls)) == 2
    assert deadlock_problems(calls)
    calls = {0: [(Op(0, False, 1, "grad", 0),), (Op(0, True, 1, "act", 0),)],
             1: [(Op(1, False, 0, "act", 0),), (Op(1, True, 0, "grad", 0),)]}
    assert order_problems(calls) == []
    assert deadlock_problems(calls) == ["rank 0 stuck in call 0: recv grad 0 from 1",
                                        "rank 1 stuck in call 0: recv act 0 from 0"]


def test_nccl_process_group_setup_is_eager_and_traced():
    import torch

    from malleus_ds.app.runners.base import DistEnv, init_kwargs, nccl_env_defaults

    gpu = DistEnv(rank=1, world_size=2, local_rank=1, local_world_size=2, device="cuda:1",
                  backend="nccl")
    assert init_kwargs(gpu) == {"device_id": torch.device("cuda:1")}
    env = nccl_env_defaults(gpu)
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert int(env["TORCH_NCCL_TRACE_BUFFER_SIZE"]) > 0
    cpu = DistEnv()
    assert init_kwargs(cpu) == {} and nccl_env_defaults(cpu) == {}
