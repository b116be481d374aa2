"""The linear scaling rule for the learning rate (Goyal et al. 2017, arXiv:1706.02677)."""

from __future__ import annotations

from paraloom.config.errors import UserError


def scaled_lr(lr: float, global_batch: int, base_batch: int) -> float:
    """`lr * global_batch / base_batch`: "when the minibatch size is multiplied by k, multiply the
    learning rate by k" ("Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour", section 2.1).

    `lr` is the rate tuned for a global batch of `base_batch` samples. The rule breaks down early
    in training, when the weights change fast: pair it with a gradual warm-up that ramps the rate
    linearly up to the scaled value (the paper uses 5 epochs; `make_schedule(warmup_steps=...)`),
    and past ~8k samples per batch on ImageNet it stops holding at all -- LARS or LAMB
    (paraloom.optim) are the optimizers made for such batches.
    """
    if not global_batch >= 1 or not base_batch >= 1:
        raise UserError(f"the linear scaling rule needs positive batch sizes, not global_batch="
                        f"{global_batch} and base_batch={base_batch}")
    return lr * global_batch / base_batch
