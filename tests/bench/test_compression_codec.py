"""bench.compression: every variant's encode+decode timing runs, and DGC's momentum follows the optimizer."""

import pytest
import torch

from paraloom.bench.compression_speed import (
    VARIANTS,
    bench_optimizer,
    codec_seconds,
    dgc_momentum,
    engine_variant,
)


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_variant_times_its_codec(variant):
    torch.manual_seed(0)
    matrices = [torch.randn(64, 32), torch.randn(10, 64)]
    flat = torch.cat([m.reshape(-1) for m in matrices] + [torch.randn(74)])
    seconds = codec_seconds(variant, list(flat.split([1000, flat.numel() - 1000])), 2, matrices, "sgd")
    assert seconds >= 0
    assert (seconds == 0) == (variant in ("ddp", "wait_free"))


def test_dgc_takes_the_optimizers_momentum_only_under_sgd():
    expected = ("dgc", {"density": 0.001, "warmup_steps": 4, "momentum": 0.9})
    assert engine_variant("dgc_0.001", "sgd") == expected
    assert engine_variant("dgc", "adam")[1]["momentum"] == 0.0 == dgc_momentum("adam")
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert bench_optimizer(params, "sgd", 0.1, dgc=True).param_groups[0]["momentum"] == 0.0
    assert bench_optimizer(params, "sgd", 0.1).param_groups[0]["momentum"] == 0.9
    with pytest.raises(ValueError, match="choose adam or sgd"):
        bench_optimizer(params, "lamb", 0.1)
