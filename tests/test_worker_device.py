"""Which GPU a rank takes: one each, or shared round-robin under gloo; NCCL refuses sharing in one line."""

import pytest

from paraloom.errors import UserError
from paraloom.worker import cuda_index


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
