"""One real batch of the data through the model, in the launching process, before any worker starts.

What only real tensors show is found here, in one line, rather than as a traceback on every rank
after the workers started: a data set whose `__getitem__` raises, samples of different shapes that
cannot be stacked, a model whose parameters' dtype is not the data's, inputs the model cannot take
(the module where it failed named), targets outside the model's classes, a returned loss that is
not one number, and a factory that fails only off the meta device (the model is built here for
real once). The batch holds the first and the last sample of a set (the last one catches a
`__len__` that promises a sample too many); the training batch goes forward and backward, the
evaluation set's forward. A model of `REAL_LIMIT` parameters or more is not built here: its
batch runs on the meta device, where shapes and dtypes fail as they would but values are unknown.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from paraloom.config import Config
from paraloom.config.errors import UserError
from paraloom.data import DataSets, TensorPairs, collate
from paraloom.factories import first_line
from paraloom.models.make import make_model
from paraloom.optim.precision import autocast
from paraloom.train.loss_eval import batch_loss

REAL_LIMIT = 200_000_000  # parameters: a larger model would cost the launcher its memory and seconds
IGNORED = -100  # a target cross-entropy skips (F.cross_entropy's ignore_index): padding


def check_batch(cfg: Config, data: DataSets, meta_model: nn.Module, *, on_gpus: bool = False) -> None:
    """Two samples of each set through the model `cfg` names (`meta_model`: it, built on meta);
    `on_gpus`: the workers train on GPUs, which may have kernels this CPU lacks."""
    probe = Probe(cfg, on_gpus=on_gpus)
    real = sum(p.numel() for p in meta_model.parameters()) < REAL_LIMIT
    model = make_model(cfg, data) if real else meta_model  # a factory that raises off meta, here
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    model.train()
    for role, dataset in (("training", data.train), ("evaluation", data.eval)):
        x, y = (_to(part, device) for part in first_batch(dataset, role, probe.data))
        training = role == "training"
        smoothing = cfg.optim.label_smoothing if training else 0.0  # of the training loss only
        with torch.set_grad_enabled(training):
            loss = probe.forward(model, x, y, data, role, smoothing=smoothing)
        if loss is None:
            return  # a kernel missing here: nothing more to learn on this CPU
        if training and real:
            try:
                loss.backward()
            except Exception as exc:  # noqa: BLE001 (the user's backward: any error, one line)
                raise UserError(f"{probe.model}'s backward pass failed on a batch of {probe.data}: "
                                f"{first_line(exc)}") from None
        model.eval()


class Probe:
    """A model and a data set under test: how the messages name them (`model.name=...`), and the
    forward pass whose failures those messages explain."""

    def __init__(self, cfg: Config, *, on_gpus: bool = False) -> None:
        self.model, self.data = f"model.name={cfg.model.name}", f"data.name={cfg.data.name}"
        self.precision, self.on_gpus = cfg.run.precision, on_gpus

    def forward(self, model: nn.Module, x: Any, y: Any, data: DataSets, role: str, *,
                smoothing: float) -> torch.Tensor | None:
        """The loss of batch (x, y) as training computes it (in `run.precision` on a CPU); a
        failure, or an output the loss cannot take, as one line. None for an operation this
        device has no kernel for, where the workers' GPUs may have one."""
        watch = Watch(model)
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        mixed = autocast(device, self.precision) if device.type == "cpu" else contextlib.nullcontext()
        try:
            with mixed:
                loss, _ = batch_loss(model, x, y, scale=1.0, loss=data.loss, smoothing=smoothing)
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 (the user's model and data: any error, one line)
            if self.on_gpus and isinstance(exc, NotImplementedError):
                return None  # a kernel this CPU lacks (a CUDA extension's op): the GPUs may have it
            raise UserError(self.explain(exc, model, watch, x, y, data, role)) from None
        finally:
            watch.remove()
        out = watch.output
        if data.loss == "model" and not (torch.is_tensor(out) and out.numel() == 1):
            raise UserError(f"{self.model} returns its own loss ({self.data}'s loss='model') but returned "
                            f"{describe(out)}: return the batch's mean loss, one number")
        if data.loss != "model":
            self.check_classes(out, y, data, role)
        return loss

    def explain(self, exc: Exception, model: nn.Module, watch: Watch, x: Any, y: Any, data: DataSets,
                role: str) -> str:
        """What failed: the model's dtype against the data's, its input, or the loss on its output."""
        batch = f"a batch of {self.data}'s {role} samples (input {describe(x)})"
        if watch.stack:  # in the model's forward: the innermost module running when it raised
            name = watch.stack[-1]
            clash = _dtype_clash(model, x)
            if clash is not None:
                return (f"{self.model}'s parameters are {clash} but {self.data}'s batches are {x.dtype}: "
                        f"give them one dtype (the model's .to({x.dtype}) in its factory, or the samples' "
                        f"tensors .to({clash}))")
            where = f"in its module {name!r} ({type(watch.modules[name]).__name__})" if name else \
                "in its forward"
            return (f"{self.model} failed on {batch} {where}: {first_line(exc)}; make the model take "
                    "the data's samples, or the data set give what the model takes")
        out = watch.output
        if data.loss != "model":
            self.check_classes(out, y, data, role)
        target = "targets" if data.loss == "model" else f"targets {describe(y)}"
        return (f"the loss ({data.loss}) failed on {self.model}'s output {describe(out)} against "
                f"{self.data}'s {role} {target}: {first_line(exc)}")

    def check_classes(self, out: Any, y: Any, data: DataSets, role: str) -> None:
        """Targets within the model's classes (the output's last dimension): the batch's, or the
        whole set's where it is in memory, and the classes the data set declares."""
        if not (torch.is_tensor(out) and out.dim() >= 1 and torch.is_tensor(y)) or y.is_floating_point():
            return
        classes = out.shape[-1]
        if data.n_classes is not None and data.n_classes > classes:
            raise UserError(f"{self.data} has {data.n_classes} classes (its n_classes) but {self.model}'s "
                            f"output has {classes} (its last dimension): size the model's head to the "
                            "data's classes")
        if y.is_meta:
            return
        dataset = data.train if role == "training" else data.eval
        targets = dataset.y if isinstance(dataset, TensorPairs) else y
        targets = targets[targets != IGNORED]
        if targets.numel() and (int(targets.max()) >= classes or int(targets.min()) < 0):
            raise UserError(f"{self.data}'s {role} targets run from {int(targets.min())} to "
                            f"{int(targets.max())} but {self.model}'s output has {classes} classes (its last "
                            f"dimension): targets must lie in 0..{classes - 1}; size the model's head to "
                            "the data's classes")


class Watch:
    """The modules whose forward is running, innermost last (forward hooks), and the model's output."""

    def __init__(self, model: nn.Module) -> None:
        self.stack: list[str] = []
        self.output: Any = None
        self.modules = dict(model.named_modules())
        self.handles = []
        for name, module in self.modules.items():
            self.handles.append(module.register_forward_pre_hook(self._enter(name)))
            self.handles.append(module.register_forward_hook(self._leave(name == "")))

    def _enter(self, name: str):
        def hook(module: nn.Module, args: Any) -> None:
            self.stack.append(name)
        return hook

    def _leave(self, root: bool):
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.stack.pop()
            if root:
                self.output = output
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def first_batch(dataset: Any, role: str, data: str) -> list[Any]:
    """The first and the last sample of `dataset` as the training loader batches them: (x, y)."""
    n = len(dataset)
    indices = sorted({0, n - 1})
    getitems = getattr(dataset, "__getitems__", None)
    if callable(getitems):  # torch's fetcher asks for the batch at once where a data set can give it
        samples = _fetch(lambda: getitems(indices), data, role, f"samples {indices}", n)
    else:
        samples = [_fetch(lambda i=i: dataset[i], data, role, f"sample {i}", n) for i in indices]
    try:
        batch = collate(samples)
    except Exception as exc:  # noqa: BLE001 (torch's default_collate on the user's samples)
        shapes = [shape_of(sample) for sample in samples]
        if len(set(map(str, shapes))) > 1:
            raise UserError(f"{data}'s {role} samples differ in shape (sample {indices[0]}: {shapes[0]}, "
                            f"sample {indices[-1]}: {shapes[-1]}), so they cannot be stacked into a batch: "
                            "give every sample the same shape (pad or crop them in __getitem__)") from None
        raise UserError(f"{data}'s {role} samples cannot be batched ({first_line(exc)}): return tensors "
                        "or numbers from __getitem__") from None
    if not (isinstance(batch, list | tuple) and len(batch) == 2):
        raise UserError(f"{data}'s {role} samples must be (input, target) pairs; sample 0 is "
                        f"{describe(samples[0])}")
    return list(batch)


def _fetch(get, data: str, role: str, which: str, n: int) -> Any:
    try:
        return get()
    except Exception as exc:  # noqa: BLE001 (the user's __getitem__: any error, one line)
        raise UserError(f"{data}'s {role} set raised on {which} (of the {n} its __len__ gives): "
                        f"{first_line(exc)}; fix its __getitem__") from None


def shape_of(value: Any) -> Any:
    """A sample's structure, tensors as their shapes: (3,), ((3,), 'int')."""
    if hasattr(value, "shape"):
        return tuple(value.shape)
    if isinstance(value, list | tuple):
        return tuple(shape_of(v) for v in value)
    return type(value).__name__


def describe(value: Any) -> str:
    """A tensor as its shape and dtype, anything else as its type (a sequence, element by element)."""
    if torch.is_tensor(value):
        return f"{tuple(value.shape)} {value.dtype}"
    if isinstance(value, list | tuple):
        return f"({', '.join(describe(v) for v in value)})"
    return f"a {type(value).__name__}"


def _dtype_clash(model: nn.Module, x: Any) -> torch.dtype | None:
    """A floating-point dtype of the model's parameters that the floating input `x` does not have."""
    if not (torch.is_tensor(x) and x.is_floating_point()):
        return None
    return next((p.dtype for p in model.parameters() if p.is_floating_point() and p.dtype != x.dtype), None)


def _to(value: Any, device: torch.device) -> Any:
    if torch.is_tensor(value):
        return value.to(device)
    if isinstance(value, list | tuple):
        return type(value)(_to(v, device) for v in value)
    return value
