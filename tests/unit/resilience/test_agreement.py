"""malleus_ds/resilience/agreement.py without processes: threads play the ranks over one store (HashStore,
FileStore as in tests/integration/harness.py, TCPStore as under torchrun). Each thread has its own
Agreements (its own counter), as each process has one."""
import datetime
import threading

import pytest
import torch.distributed as dist

from malleus_ds.resilience.agreement import MAX_MESSAGE_BYTES, AgreementError, Agreements, Failure


def _stores(kind, world, tmp_path):
    """One store client per rank, all on the same store."""
    if kind == "hash":
        s = dist.HashStore()
        return [s] * world
    if kind == "file":
        return [dist.FileStore(str(tmp_path / "store"), world) for _ in range(world)]
    master = dist.TCPStore("127.0.0.1", 0, world, True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    return [master] + [dist.TCPStore("127.0.0.1", master.port, world, False,
                                     timeout=datetime.timedelta(seconds=30))
                       for _ in range(world - 1)]


def _run(stores, errs, names=None, timeout_s=20.0, skip=(), ags=None):
    """Every rank not in ``skip`` runs one agreement in a thread; returns {rank: result}."""
    world = len(stores)
    ags = ags or [Agreements() for _ in range(world)]
    out = {}

    def one(r):
        try:
            out[r] = ags[r].run(stores[r], r, world, (names or ["x"] * world)[r], errs[r],
                                timeout_s)
        except BaseException as e:  # noqa: BLE001 - the test inspects it
            out[r] = e

    ts = [threading.Thread(target=one, args=(r,)) for r in range(world) if r not in skip]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=timeout_s + 30)
        assert not t.is_alive(), "an agreement hung past its deadline"
    return out


@pytest.mark.parametrize("kind", ["hash", "file", "tcp"])
def test_all_ok_then_one_fails(kind, tmp_path):
    stores = _stores(kind, 4, tmp_path)
    ags = [Agreements() for _ in range(4)]
    assert _run(stores, [None] * 4, ags=ags) == {r: None for r in range(4)}
    out = _run(stores, [None, None, "OSError: disk full on /ck", "ValueError: late"], ags=ags)
    want = Failure(2, "OSError: disk full on /ck", (2, 3), ())
    assert out == {r: want for r in range(4)}


@pytest.mark.parametrize("kind", ["hash", "tcp"])
def test_a_rank_that_never_reports_is_named_and_nobody_hangs(kind, tmp_path):
    stores = _stores(kind, 3, tmp_path)
    out = _run(stores, [None, "RuntimeError: recv from rank 2 failed", None], timeout_s=0.5,
               skip=(2,))
    assert set(out) == {0, 1}
    for r in (0, 1):
        f = out[r]
        assert isinstance(f, Failure), f
        assert f.rank == 1 and f.message == "RuntimeError: recv from rank 2 failed"
        assert f.ranks == (1, 2) and f.silent == (2,)
    stores = _stores(kind, 3, tmp_path)          # a fresh job: only a silent rank this time
    out = _run(stores, [None, None, None], timeout_s=0.5, skip=(1,))
    for r in (0, 2):
        assert out[r].rank == 1 and "did not report within 0.5 s" in out[r].message, out[r]


def test_the_cause_outranks_lower_ranks_that_only_timed_out_on_it():
    store, ags = dist.HashStore(), [Agreements() for _ in range(3)]
    out = {}

    def one(r, err, peer):
        out[r] = ags[r].run(store, r, 3, "m", err, 10.0, peer_caused=peer)

    args = [(0, "MigrationError: recv from rank 2 timed out", True), (1, None, False),
            (2, "OSError: NIC went away", False)]
    ts = [threading.Thread(target=one, args=a) for a in args]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=30)
    assert out[0] == out[1] == out[2] == Failure(2, "OSError: NIC went away", (0, 2), ())
    # only victims: the lowest of them
    f = ags[0].run(dist.HashStore(), 0, 1, "m", "MigrationError: x", 1.0, peer_caused=True)
    assert f == Failure(0, "MigrationError: x", (0,), ())


def test_a_late_rank_gets_the_verdict_the_others_agreed():
    store = dist.HashStore()
    ags = [Agreements() for _ in range(2)]
    early = ags[0].run(store, 0, 2, "save", None, 0.2)           # rank 1 is not there yet
    late = ags[1].run(store, 1, 2, "save", None, 0.2)            # it reports after the deadline
    assert early == late and early.silent == (1,) and "did not report" in early.message


def test_diverged_calls_fail_at_once_and_name_both():
    out = _run([dist.HashStore()] * 2, [None, None], names=["migrate@step3", "ckpt-save"])
    assert out[0] == out[1]
    assert "diverged" in out[0].message and out[0].ranks in ((0,), (1,)), out[0]
    assert "migrate@step3" in out[0].message and "ckpt-save" in out[0].message


def test_messages_are_capped_and_world_one_needs_no_store():
    out = _run([dist.HashStore()] * 2, [None, "é" * MAX_MESSAGE_BYTES])
    assert 0 < len(out[0].message.encode()) <= MAX_MESSAGE_BYTES and out[0] == out[1]
    ag = Agreements()
    assert ag.run(None, 0, 1, "x", None, 1.0) is None
    assert ag.run(None, 0, 1, "x", "boom", 1.0) == Failure(0, "boom", (0,), ())


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="timeout_s=0 must be a number > 0"):
        Agreements().run(dist.HashStore(), 0, 2, "x", None, 0)
    with pytest.raises(ValueError, match="rank=2 is not in 0..world-1"):
        Agreements().run(dist.HashStore(), 2, 2, "x", None, 1.0)


def test_keys_are_cleaned_up_over_many_rounds():
    store, world = dist.HashStore(), 3
    ags = [Agreements() for _ in range(world)]
    for i in range(40):
        errs = [None, f"err {i}", None] if i % 7 == 3 else [None] * world
        out = _run([store] * world, errs, ags=ags)
        assert all((o is None) == (errs[1] is None) for o in out.values()), out
        # the last agreement's keys (world + verdict) and nothing older
        assert store.num_keys() <= world + 1, (i, store.num_keys())


def test_a_dead_store_raises_instead_of_hanging():
    class Dead:
        def set(self, *a):
            raise RuntimeError("Connection reset by peer")

    with pytest.raises(AgreementError, match="store failed .*Connection reset"):
        Agreements().run(Dead(), 0, 2, "x", None, 5.0)


def test_raise_if_any_failed_words_the_first_failure_the_same_everywhere():
    """The one helper every "did any rank fail?" site uses (checkpoint save and load, export,
    DeepSpeed resume): one process, no process group."""
    from malleus_ds.resilience.agreement import raise_if_any_failed

    raise_if_any_failed("ok-check", None, "saving x")            # nobody failed: no error
    raise_if_any_failed("ok-check2", "", "saving x")              # an empty error is none
    with pytest.raises(KeyError, match=r"saving x failed on rank\(s\) \[0\]: rank 0: disk full"):
        raise_if_any_failed("bad-check", "disk full", "saving x", KeyError)
