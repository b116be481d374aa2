"""Which GPU a rank takes: one each, or shared round-robin under gloo; NCCL refuses sharing in one line."""

import os

import pytest

from paraloom.config.errors import UserError
from paraloom.run.worker import cuda_index


def test_ranks_take_a_gpu_each_or_share_them_under_gloo():
    assert [cuda_index(r, 4, 4, backend="nccl") for r in range(4)] == [0, 1, 2, 3]
    assert [cuda_index(r, 2, 8, backend="auto") for r in range(2)] == [0, 1]
    assert [cuda_index(r, 4, 2, backend="gloo") for r in range(4)] == [0, 1, 0, 1]
    assert [cuda_index(r, 2, 1, backend="gloo") for r in range(2)] == [0, 0]


@pytest.mark.parametrize("backend", ["nccl", "auto"])
def test_nccl_refuses_two_ranks_on_one_gpu_in_one_line(backend):
    with pytest.raises(UserError, match=r"^NCCL needs a GPU per rank: 2 ranks on this node share 1 GPU; "
                                        r"run at most 1 per node, or set comm.backend=gloo"):
        cuda_index(1, 2, 1, backend=backend)


@pytest.mark.parametrize(("given", "expected"), [(None, "2"), ("3", "3")], ids=["default", "users"])
def test_nccl_timeouts_abort_the_communicator_so_the_loop_sees_them(monkeypatch, given, expected):
    """Under NCCL a timed-out collective aborts its communicator (TORCH_NCCL_ASYNC_ERROR_HANDLING=2)
    and the next collective raises into the loop, which names the silent rank as under gloo; a
    value the user set is kept. CUDA tensors go to NCCL, the loop's few host tensors to gloo (NCCL
    refuses them). (Two GPUs are needed to see a real timeout: not tested here.)"""
    import torch
    import torch.distributed as dist

    from paraloom.config import CommConfig
    from paraloom.run.worker import init_distributed

    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", given or "")  # restored after the test
    if given is None:
        monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING")
    joined = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kwargs: joined.append(backend))
    init_distributed(CommConfig(backend="nccl"), torch.device("cuda", 0), interface=None)
    assert joined == ["cpu:gloo,cuda:nccl"] and os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == expected
