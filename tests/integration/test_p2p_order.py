"""Real runs obey NCCL's matching rules (engine/wire.py): every point-to-point call of 4 gloo
ranks is logged (the API, the peer, the shape), and for every ordered pair the k-th message sent
must be the k-th received, through the same API, with the same shape -- gloo matches by tag and
would forgive a mismatch that hangs NCCL. Plans: a 4-stage pipeline, a hetero 3-stage + 1-stage
plan, pp=2 with one micro-batch per pipeline, and a live switch between two of them (the
migration's messages count too). The losses still equal the single-process reference."""
from __future__ import annotations

from tests.integration.harness import run_distributed
from tests.cases import CFG, EPS, check, ds_config, plan_json

FOUR_STAGES = plan_json([(8, [([0], (0, 1)), ([1], (1, 2)), ([2], (2, 3)), ([3], (3, 4))])])
THREE_PLUS_ONE = plan_json([(5, [([0], (0, 1)), ([2], (1, 3)), ([1], (3, 4))]),
                            (3, [([3], (0, 4))])])
ONE_MICRO = plan_json([(1, [([0], (0, 2)), ([1], (2, 4))]), (1, [([2], (0, 2)), ([3], (2, 4))])],
                      G=2)
STEPS = 3


def _logged(rank, world, plans):
    """Train each (plan, then optionally switch to another) with every p2p call logged."""
    import torch.distributed as dist

    import malleus_ds
    from malleus_ds.plan import Plan

    import torch.distributed.distributed_c10d as c10d

    log: list[tuple] = []
    names = ("isend", "irecv", "send", "recv", "batch_isend_irecv")
    real = {n: getattr(c10d, n) for n in names}
    inside = []             # batch_isend_irecv calls its ops' functions: log each message once

    def single(name):
        def f(tensor, *a, **kw):
            if not inside:          # (recv may call irecv itself: one message, one line)
                peer = kw.get("dst", kw.get("src", a[0] if a else None))
                log.append((name, "send" if name in ("isend", "send") else "recv", int(peer),
                            tuple(tensor.shape), str(tensor.dtype)))
            inside.append(1)
            try:
                return real[name](tensor, *a, **kw)
            finally:
                inside.pop()
        f.__name__ = name
        return f

    def batch(ops):
        for op in ops:
            log.append(("batch", "send" if op.op.__name__ == "isend" else "recv", int(op.peer),
                        tuple(op.tensor.shape), str(op.tensor.dtype)))
        inside.append(1)
        try:
            return real["batch_isend_irecv"](ops)
        finally:
            inside.pop()

    fakes = {n: single(n) for n in names[:4]}
    fakes["batch_isend_irecv"] = batch
    for n, f in fakes.items():          # P2POp checks its op against c10d's own names
        setattr(c10d, n, f)
        setattr(dist, n, f)
    out = []
    try:
        for first, then in plans:
            eng = malleus_ds.initialize(model=CFG, config=ds_config(1),
                                        plan=Plan.from_json(first))[0]
            log.clear()
            losses = [eng.train_batch() for _ in range(STEPS)]
            if then is not None:
                eng.switch_plan(Plan.from_json(then))
                losses += [eng.train_batch() for _ in range(STEPS)]
            shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
            out.append((list(log), losses, shards))
    finally:
        for n, f in real.items():
            setattr(c10d, n, f)
            setattr(dist, n, f)
    return out


def _order_problems(logs: list[list[tuple]]) -> list[str]:
    sent, got = {}, {}
    for r, log in enumerate(logs):
        for api, kind, peer, shape, dtype in log:
            pair = (r, peer) if kind == "send" else (peer, r)
            (sent if kind == "send" else got).setdefault(pair, []).append((api, shape, dtype))
    out = []
    for pair in sorted(set(sent) | set(got)):
        s, g = sent.get(pair, []), got.get(pair, [])
        if len(s) != len(g):
            out.append(f"{pair}: {len(s)} sent, {len(g)} received")
        out += [f"{pair[0]}->{pair[1]} message {k}: sent {a}, received {b}"
                for k, (a, b) in enumerate(zip(s, g)) if a != b]
    return out


def test_logged_p2p_calls_match_pair_by_pair():
    cases = [(FOUR_STAGES, None), (THREE_PLUS_ONE, None), (ONE_MICRO, None),
             (FOUR_STAGES, THREE_PLUS_ONE)]
    res = run_distributed(_logged, 4, cases, timeout=240)
    for c, (first, then) in enumerate(cases):
        logs = [res[r][c][0] for r in range(4)]
        assert sum(len(x) for x in logs) > 0
        assert _order_problems(logs) == [], (c, _order_problems(logs)[:5])
        apis = {e[0] for x in logs for e in x}
        assert apis == {"batch"}, apis              # one API: one communicator on NCCL
        # the same math as one process (after the switch too)
        check(first, [(res[r][c][1], res[r][c][2]) for r in range(4)],
              steps=STEPS * (2 if then else 1), eps=EPS)
