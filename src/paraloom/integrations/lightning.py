"""Lightning bridges: ParaloomStrategy (DDPStrategy with `paraloom.DataParallel` as the wrapper) and
CommHookCallback (paraloom's DDP comm hooks in any Lightning DDP run, CPU included).

    Trainer(accelerator="cpu", devices=2,
            strategy=ParaloomStrategy(scheduler="priority", compressor="powersgd"))
    Trainer(accelerator="cpu", devices=2, strategy="paraloom")
    Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[CommHookCallback("powersgd")])

Lightning ships one trainer under two package names: `lightning.pytorch` (package `lightning`,
`pip install "paraloom[lightning]"`) and the legacy `pytorch_lightning` (`paraloom[pytorch-lightning]`).
A Trainer takes only a strategy derived from its own package's classes, so the two classes here are
built from one body for each package that is installed (`Bridge`). `ParaloomStrategy` and
`CommHookCallback` are `lightning.pytorch`'s where `lightning` is installed and `pytorch_lightning`'s
otherwise (`PACKAGE` says which); `for_package("pytorch_lightning")` or `for_package("lightning")`
gives one package's explicitly. Importing this module registers `strategy="paraloom"` in every
installed package's StrategyRegistry.

Lightning launches, sets up the process group (gloo on CPU), shards the data and runs its loop as
for DDP; only the wrapper differs. Every keyword not Lightning's own goes to `DataParallel`:
paraloom's (`scheduler=`, `compressor=`, `algorithm=`, `bucket_mb=`, `compressor_options=`, ...) and
DDP's (`find_unused_parameters=`, ...), which `DataParallel` accepts as torch's DDP does.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from torch.nn import Module

from paraloom.compress import ddp_hook
from paraloom.data_parallel import DataParallel, DistributedOptimizer
from paraloom.integrations import MissingExtra

# a package name as a user writes it -> the module whose Trainer, Callback and strategies it holds
PACKAGES = {"lightning": "lightning.pytorch", "lightning.pytorch": "lightning.pytorch",
            "pytorch_lightning": "pytorch_lightning"}
EXTRAS = {"lightning.pytorch": "lightning", "pytorch_lightning": "pytorch-lightning"}


@dataclass(frozen=True)
class Bridge:
    """One Lightning package's classes; `package` is "lightning.pytorch" or "pytorch_lightning"."""

    package: str
    ParaloomStrategy: type
    CommHookCallback: type


def _import(package: str) -> Any:
    """The package's module, or None where it is not installed (an error inside it still raises)."""
    try:
        return importlib.import_module(package)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (package + ".").startswith(exc.name + "."):
            return None
        raise


class StrategyBody:
    """DDPStrategy whose wrapper is `paraloom.DataParallel`; see the module docstring. (The body of
    each package's `ParaloomStrategy`, placed before that package's DDPStrategy.)

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

    def setup_optimizers(self, trainer: Any) -> None:
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


class CallbackBody:
    """Registers `paraloom.compress.ddp_hook(name, **options)` on the wrapped model when fitting starts.
    (The body of each package's `CommHookCallback`, placed before that package's Callback.)

    Lightning's `DDPStrategy(ddp_comm_hook=...)` registers hooks on CUDA only and silently ignores
    them on CPU; this works under DDPStrategy and ParaloomStrategy on either. `state` is the
    hook's state once fitting has started (`state.bytes`: payload bytes this rank sent).
    """

    def __init__(self, name: str, **options: Any) -> None:
        self.name, self.options = name, options
        self.state = None

    def on_fit_start(self, trainer: Any, pl_module: Module) -> None:
        model = trainer.strategy.model
        if model is pl_module or not hasattr(model, "register_comm_hook"):
            return  # one process, no wrapper: nothing to average
        self.state, hook = ddp_hook(self.name, **self.options)
        model.register_comm_hook(self.state, hook)

    def teardown(self, trainer: Any, pl_module: Module, stage: str) -> None:
        if self.state is not None:
            self.state.close()


def _build(package: str, attribute: str) -> Bridge | None:
    """The strategy and the callback for one installed package, registered there as "paraloom";
    `attribute` is this module's name for the result, by which the classes pickle."""
    pl = _import(package)
    if pl is None:
        return None
    strategies = importlib.import_module(f"{package}.strategies")
    made = {}
    for name, body, base in (("ParaloomStrategy", StrategyBody, strategies.DDPStrategy),
                             ("CommHookCallback", CallbackBody, pl.Callback)):
        made[name] = type(name, (body, base), {"__module__": __name__, "__qualname__": f"{attribute}.{name}",
                                               "__doc__": body.__doc__})
    if StrategyBody.strategy_name not in strategies.StrategyRegistry:
        made["ParaloomStrategy"].register_strategies(strategies.StrategyRegistry)
    return Bridge(package, **made)


_lightning = _build("lightning.pytorch", "_lightning")
_pytorch_lightning = _build("pytorch_lightning", "_pytorch_lightning")
_BRIDGES = {bridge.package: bridge for bridge in (_lightning, _pytorch_lightning) if bridge is not None}
if not _BRIDGES:
    raise MissingExtra("lightning (or the legacy pytorch_lightning)", "lightning")


def for_package(name: str) -> Bridge:
    """The classes for one Lightning package: "lightning" (its `lightning.pytorch`) or "pytorch_lightning"."""
    if name not in PACKAGES:
        raise ValueError(f"{name!r} is not a Lightning package; choose one of: lightning, pytorch_lightning")
    package = PACKAGES[name]
    if package not in _BRIDGES:
        raise MissingExtra(package, EXTRAS[package])
    return _BRIDGES[package]


_default = _lightning if _lightning is not None else _pytorch_lightning
PACKAGE: str = _default.package
ParaloomStrategy = _default.ParaloomStrategy
CommHookCallback = _default.CommHookCallback
