"""Convergence on real data: every compressor at its defaults trains digits to within 1 pt of uncompressed.

The real trainer on 2 ranks: the default job (cnn, batch 64) for 24 epochs. Compression slows
early progress (error feedback sends what top-k or a sign dropped a few steps late), so the
comparison is at a length where uncompressed training has converged; at the default 12 epochs
top-k and EF-sign are still 2-2.5 pt behind. DGC's momentum correction replaces the optimizer's
momentum (Lin et al. 2018), so DGC is compared under momentum SGD, the setting it is made for;
every other compressor under the default Adam.
"""

import pytest
import torch
from distributed import run_workers

from paraloom.config import load_config
from paraloom.train import train

EPOCHS = 24
ADAM = ("none", "fp16", "bf16", "qsgd", "onebit", "efsign", "topk", "randomk", "powersgd")
SGD = ("none", "dgc")


def _accuracies(rank, world, compressors, overrides):
    out = {}
    for name in compressors:
        cfg = load_config(None, [f"comm.compressor={name}", f"optim.epochs={EPOCHS}", "run.save_model=false",
                                 *overrides])
        out[name] = train(cfg, None, device=torch.device("cpu"))["test_accuracy"]
    return out


@pytest.mark.timeout(400)
@pytest.mark.parametrize("compressors, overrides", [(ADAM, []), (SGD, ["optim.name=sgd", "optim.lr=0.05"])],
                         ids=["adam", "sgd"])
def test_every_compressor_reaches_uncompressed_accuracy_within_one_point(compressors, overrides):
    per_rank = run_workers(_accuracies, 2, compressors, overrides, timeout=360)
    assert per_rank[0] == per_rank[1]  # the accuracy is all-reduced: every rank reports it
    accuracy = per_rank[0]
    assert accuracy["none"] >= 0.97, accuracy
    behind = {name: round(accuracy["none"] - acc, 4) for name, acc in accuracy.items()
              if acc < accuracy["none"] - 0.01}
    assert not behind, f"more than 1 pt below uncompressed: {behind}; all: {accuracy}"
