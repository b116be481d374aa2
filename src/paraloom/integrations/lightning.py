"""Lightning bridges: ParaloomStrategy (DDPStrategy with `paraloom.DataParallel` as the wrapper) and
CommHookCallback (paraloom's DDP comm hooks in any Lightning DDP run, CPU included).

    Trainer(accelerator="cpu", devices=2,
            strategy=ParaloomStrategy(scheduler="priority", compressor="powersgd"))
    Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[CommHookCallback("powersgd")])

Needs `pip install paraloom[lightning]`. Lightning launches, sets up the process group (gloo on
CPU), shards the data and runs its loop as for DDP; only the wrapper differs. Every keyword not
Lightning's own goes to `DataParallel`: paraloom's (`scheduler=`, `compressor=`, `algorithm=`,
`bucket_mb=`, `compressor_options=`, ...) and DDP's (`find_unused_parameters=`, ...), which
`DataParallel` accepts as torch's DDP does. `Trainer(strategy="paraloom")` works once this module
is imported.
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.strategies import DDPStrategy, StrategyRegistry
from torch.nn import Module

from paraloom.compress import ddp_hook
from paraloom.data_parallel import DataParallel, DistributedOptimizer


class ParaloomStrategy(DDPStrategy):
    """DDPStrategy whose wrapper is `paraloom.DataParallel`; see the module docstring.

    Gradients are averaged by the end of backward, as under DDP, so Lightning's own
    `optimizer.step()` needs nothing more; where the engine applies the update itself (the
    priority scheduler, one-step-delay or local SGD, a sharded optimizer) Lightning's optimizers
    are wrapped in `paraloom.DistributedOptimizer`, whose `step()` is the engine's.
    `ddp_comm_hook=` / `ddp_comm_state=` (/ `ddp_comm_wrapper=`) are registered on the engine,
    on CPU as on CUDA.
    """

    strategy_name = "paraloom"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("model_averaging_period") is not None:
            raise ValueError("ParaloomStrategy does not take model_averaging_period= (torch's post-local "
                             "SGD): give paraloom's sync='local_sgd', local_steps=H instead")
        super().__init__(*args, **kwargs)

    def _setup_model(self, model: Module) -> DataParallel:
        """Wrap the LightningModule; DDP's `device_ids` only where DDP would get them (not on CPU)."""
        device_ids = self.determine_ddp_device_ids()
        options = dict(self._ddp_kwargs)
        if device_ids is not None:
            options["device_ids"] = device_ids
        return DataParallel(model, **options)

    def _register_ddp_hooks(self) -> None:
        """DDPStrategy registers comm hooks on CUDA only (torch's reducer once needed NCCL); the
        engine takes them on any device."""
        hook = self._ddp_comm_hook
        if hook is None:
            return
        if self._ddp_comm_wrapper is not None:
            hook = self._ddp_comm_wrapper(hook)
        self.model.register_comm_hook(self._ddp_comm_state, hook)

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        super().setup_optimizers(trainer)
        engine = self.model
        if isinstance(engine, DataParallel) and not engine.updater.plain_optimizer_step:
            self.optimizers = [DistributedOptimizer(optimizer, engine) for optimizer in self.optimizers]

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: Lightning only knows DDP's `no_sync`; ours has the same name."""
        if isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield None
        else:
            yield None

    def teardown(self) -> None:
        """Land what is in flight, remove the engine's hooks, and hand Lightning its module back."""
        if isinstance(self.model, DataParallel):
            self.model.close()
            self.model = self.lightning_module
        super().teardown()

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Only "paraloom": DDPStrategy's names stay DDPStrategy's."""
        strategy_registry.register(cls.strategy_name, cls, description="DDP with paraloom.DataParallel")


class CommHookCallback(pl.Callback):
    """Registers `paraloom.compress.ddp_hook(name, **options)` on the wrapped model when fitting starts.

    Lightning's `DDPStrategy(ddp_comm_hook=...)` registers hooks on CUDA only and silently ignores
    them on CPU; this works under DDPStrategy and ParaloomStrategy on either. `state` is the
    hook's state once fitting has started (`state.bytes`: payload bytes this rank sent).
    """

    def __init__(self, name: str, **options: Any) -> None:
        self.name, self.options = name, options
        self.state = None

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        model = trainer.strategy.model
        if model is pl_module or not hasattr(model, "register_comm_hook"):
            return  # one process, no wrapper: nothing to average
        self.state, hook = ddp_hook(self.name, **self.options)
        model.register_comm_hook(self.state, hook)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self.state is not None:
            self.state.close()


if ParaloomStrategy.strategy_name not in StrategyRegistry:
    ParaloomStrategy.register_strategies(StrategyRegistry)
