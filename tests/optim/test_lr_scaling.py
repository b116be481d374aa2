"""The linear scaling rule: the learning rate grows with the global batch."""

import pytest

from paraloom.config.errors import UserError
from paraloom.optim import scaled_lr


def test_the_rate_scales_with_the_global_batch():
    assert scaled_lr(0.1, 1024, 256) == pytest.approx(0.4)
    assert scaled_lr(0.1, 256, 256) == 0.1
    assert scaled_lr(0.1, 64, 256) == pytest.approx(0.025)


@pytest.mark.parametrize("global_batch, base_batch", [(0, 256), (256, 0), (-8, 256)])
def test_batches_must_be_positive(global_batch, base_batch):
    with pytest.raises(UserError, match="positive batch sizes"):
        scaled_lr(0.1, global_batch, base_batch)
