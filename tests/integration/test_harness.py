import pytest
import torch

from tests.integration.harness import run_distributed


def _allreduce(rank, world):
    import torch.distributed as dist
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


def _hang(rank, world):
    import torch.distributed as dist
    if rank == 0:
        dist.barrier()  # rank 1 never joins
    return rank


def _tensor_result(rank, world):
    return {"rank": rank, "t": torch.full((3,), float(rank))}


def test_tensors_come_back_after_ranks_exit():
    out = run_distributed(_tensor_result, 2)
    assert [o["rank"] for o in out] == [0, 1]
    assert torch.equal(out[1]["t"], torch.ones(3))


def test_allreduce_two_ranks():
    assert run_distributed(_allreduce, 2) == [3.0, 3.0]


def test_error_reports_traceback():
    with pytest.raises(AssertionError, match="boom on rank 1"):
        run_distributed(_fail_on_one, 2)


def test_hang_times_out():
    with pytest.raises((TimeoutError, AssertionError, RuntimeError)):
        run_distributed(_hang, 2, timeout=15)
