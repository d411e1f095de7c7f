"""Process groups live only as long as a plan uses them or their layout is one of the last 3 held
(malleus_ds/engine/groups.py, malleus_ds/migrate/group_sets.py), on a real gloo world of 4 ranks with
three engines in each process:

* ``keep`` (never switches, trains once at the end: its groups must survive everything);
* ``drop`` (dropped before a different switch on each rank, as garbage collection would);
* ``eng``, which makes 50 live switches among five plans (TP 4, TP 2, a suspended rank,
  different stage cuts), training once before and once under each of the other four plans, then
  6 more back and forth between two of the recent layouts.

Checked on every rank: nothing but ``GroupCache.ensure`` creates a group, at build or at a switch
(torch's own counter ``_world.group_count`` moves only with ours; DeepSpeed's base engine makes
none), a step creates or destroys none, after each switch the cache holds exactly the sets of the
live engines' plans and of the last 3 layouts held plus the singletons and torch's registry
``_world.pg_map`` exactly this rank's share of them; ``drop``'s sets go once every rank has dropped
it and its layout is not recent; groups of a layout 5 switches old are destroyed; switches back
and forth between recent layouts create and destroy none; memory does not grow: the live tensors
and the bytes of their distinct storages after the last switch (under HETERO, every engine
``drop`` gone) are no more than 20 switches earlier under the same plan; and the math is
intact: ``eng``'s losses and final shards equal one run without switches, ``keep``'s first step
equals its own.
"""
from tests.integration.harness import run_distributed
from tests.cases import CFG, EPS, check, ds_config
from tests.cases import HETERO
from tests.integration.test_malleus_switch import B, C, D, E

PLANS = [B, C, E, D, HETERO]
SWITCHES = 50
EVERY = 11                      # a step after switches 10, 21, 32, 43: under B, C, E, D
MEM_AT = SWITCHES - 1 - 4 * len(PLANS)     # switch 29: HETERO, as the last one, every drop done
BACK_AND_FORTH = [D, HETERO] * 3            # D and HETERO are among the last 3 layouts held


def _lifetime(rank, world, switches, every):
    import gc
    import math
    import weakref

    from torch.distributed import distributed_c10d as c10d

    import malleus_ds
    from malleus_ds.engine.groups import GROUPS, plan_rank_sets
    from malleus_ds.plan import Plan

    W = c10d._world
    # the ~400k objects the fork server preloaded (torch, DeepSpeed, transformers; no tensor
    # among them) go to the permanent generation: the collections and scans below (0.5 s each
    # over them) see only the objects made from here on
    gc.collect()
    gc.freeze()

    def snap():
        return W.group_count, len(W.pg_map), GROUPS.created, GROUPS.destroyed

    def build(pj):
        s0 = snap()
        e, *_ = malleus_ds.initialize(model=CFG, config=ds_config(1), plan=Plan.from_json(pj))
        s1 = snap()
        assert s1[0] - s0[0] == s1[2] - s0[2], f"build made groups outside GroupCache: {s0}->{s1}"
        mine = [rs for rs in GROUPS.sets() if rank in rs]
        assert len(W.pg_map) == 1 + len(mine), ("build", len(W.pg_map), mine)   # + world group
        return e

    def sets(pj):
        return set(plan_rank_sets(Plan.from_json(pj), world))

    def recent(held, k=3):
        """The sets of the last ``k`` distinct layouts in ``held`` (the rule, by hand)."""
        fams = []
        for pj in held:
            f = frozenset(sets(pj))
            fams = [x for x in fams if x != f] + [f]
        return set().union(*fams[-k:])

    def memory():
        """(live tensors, bytes of their distinct storages): a view that keeps a larger
        allocation alive counts the whole allocation."""
        import torch

        gc.collect()
        live = [o for o in gc.get_objects() if torch.is_tensor(o)]
        stores = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for t in live if t.device.type != "meta"}
        return len(live), sum(stores.values())

    def step(e):
        s0 = snap()
        loss = e.train_batch()
        assert snap() == s0, f"a training step created or destroyed groups: {s0} -> {snap()}"
        assert math.isfinite(loss)
        return loss

    keep, drop, eng = build(HETERO), build(D), build(HETERO)
    drop_ref, drop_at = weakref.ref(drop), 10 + 5 * rank       # before switch 10, 15, 20, 25
    last_drop = 10 + 5 * (world - 1)
    losses, counts, held = [step(eng)], [], [HETERO, D, HETERO]
    for i in range(switches):
        if i == drop_at:
            del drop
            gc.collect()                # the engine holds reference cycles (its controller)
            assert drop_ref() is None, "the dropped engine is still alive"
        pj = PLANS[i % len(PLANS)]
        s0 = snap()
        eng.switch_plan(Plan.from_json(pj))
        s1 = snap()
        held.append(pj)
        assert s1[0] - s0[0] == s1[2] - s0[2], f"switch made groups outside GroupCache: {s0}->{s1}"
        live = recent(held) | sets(HETERO) | (sets(D) if i < last_drop else set())
        assert set(GROUPS.sets()) == live, (i, sorted(set(GROUPS.sets()) ^ live))
        mine = [rs for rs in GROUPS.sets() if rank in rs]
        assert len(W.pg_map) == 1 + len(mine), (i, len(W.pg_map), mine)     # + the world group
        assert GROUPS.owners() == (3 if i < last_drop else 2), (i, GROUPS.owners())
        counts.append((GROUPS.count(), len(W.pg_map)))
        if i == MEM_AT:
            assert i >= last_drop and pj == PLANS[(switches - 1) % len(PLANS)], i
            mem = [memory()]
        if i % every == every - 1:
            losses.append(step(eng))
    before = snap(), GROUPS.count()
    for pj in BACK_AND_FORTH:       # switches back to a recent layout: no group made or destroyed
        eng.switch_plan(Plan.from_json(pj))
        assert (snap(), GROUPS.count()) == before, (before, snap(), GROUPS.count())
    mem.append(memory())
    kept_loss = step(keep)          # its groups outlived 50 switches of another engine
    shards = {n: (t.numpy(), d, a, b) for n, (t, d, a, b) in eng.local_shards().items()}
    return (losses, shards), kept_loss, counts, GROUPS.created, GROUPS.destroyed, mem


def test_fifty_switches_keep_groups_bounded_and_the_math():
    from malleus_ds.engine.groups import plan_rank_sets
    from malleus_ds.plan import Plan

    sizes = [plan_rank_sets(Plan.from_json(pj), 4) for pj in PLANS]
    res = run_distributed(_lifetime, 4, SWITCHES, EVERY, timeout=180)
    steps = 1 + SWITCHES // EVERY
    assert {(i % len(PLANS)) for i in range(EVERY - 1, SWITCHES, EVERY)} == {0, 1, 2, 3}
    assert BACK_AND_FORTH[-1] == PLANS[(SWITCHES - 1) % len(PLANS)]
    check(PLANS[(SWITCHES - 1) % len(PLANS)], [r[0] for r in res], steps=steps, eps=EPS)
    for rank, (run, kept_loss, counts, created, destroyed, mem) in enumerate(res):
        assert abs(kept_loss - run[0][0]) <= 1e-6 * abs(run[0][0]), (rank, kept_loss, run[0][0])
        # singletons + the sets of keep's, drop's and the 3 recent layouts (of 5 in turn)
        assert max(g for g, _ in counts) <= 4 + 5 * max(len(s) - 4 for s in sizes), counts
        assert destroyed > 0 and created - destroyed == counts[-1][0], (created, destroyed)
        (t1, e1), (t2, e2) = mem
        assert t2 <= t1 and e2 <= e1, f"rank {rank}: live tensors {t1} -> {t2}, bytes {e1} -> {e2}"
    assert len({r[3] for r in res}) == 1          # every rank created the same number of groups
