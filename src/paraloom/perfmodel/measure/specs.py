"""Model specs: `gpt:layers=96,hidden=12288`, `resnet50`, or a user's `package.module:factory` -> a model."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from paraloom.config.errors import UserError
from paraloom.factories import call_factory
from paraloom.models import MODELS

InputMaker = Callable[[int], torch.Tensor]  # batch size -> one input batch

SPEC_HELP = ("a model spec is a zoo name with optional arguments, e.g. 'resnet50', "
             "'gpt:layers=96,hidden=12288,heads=96,seq=2048,vocab=51200', 'mlp:input=784,hidden=1024,"
             "depth=4,classes=10', or 'package.module:factory[:key=value,...]'")

# input shape and classes when the spec does not say: the digits paraloom trains on by default for the
# small models, ImageNet for the classic image benchmarks, byte-level text (data.seq_len) for the gpt
ZOO_DEFAULTS: dict[str, tuple[tuple[int, ...], int]] = {
    "cnn": ((1, 8, 8), 10), "mlp": ((1, 8, 8), 10),
    "resnet18": ((3, 224, 224), 1000), "resnet50": ((3, 224, 224), 1000),
    "resnet101": ((3, 224, 224), 1000), "resnet152": ((3, 224, 224), 1000), "vgg16": ((3, 224, 224), 1000),
    "alexnet": ((3, 224, 224), 1000), "googlenet": ((3, 224, 224), 1000),
    "inception_v3": ((3, 299, 299), 1000),
    "gpt": ((128,), 256), "bert": ((128,), 256),
}
TOKEN_MODELS = ("gpt", "bert")  # they take token ids, and the gpt's spec keys
GPT_ALIASES = {"layers": "n_layers", "hidden": "d_model", "heads": "n_heads"}  # spec key -> GPT keyword
# per model: keys for (input shape, classes); others: input, classes
SHAPE_KEYS = {"gpt": ("seq", "vocab"), "bert": ("seq", "vocab")}
MAX_LAYERS = 4096  # deeper zoo specs are refused before anything is built
NOT_IN_SPEC = {"recompute": "give recompute as the profile option (recompute='full'), not in the spec"}


def _value(spec: str, key: str, text: str) -> Any:
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for kind in (int, float):
        try:
            return kind(low)
        except ValueError:
            pass
    if key in ("input", "seq"):
        try:
            return tuple(int(part) for part in low.split("x"))
        except ValueError:
            raise UserError(f"model spec {spec!r}: {key}={text!r} must be a number or a shape such as "
                            "3x224x224") from None
    if low.isidentifier():
        return low  # a name (gpt's style=llama); the model's keyword says whether it takes one
    raise UserError(f"model spec {spec!r}: {key}={text!r} must be a number, true/false or a name")


def parse_args(spec: str, text: str) -> dict[str, Any]:
    """`"layers=2,hidden=64"` -> {"layers": 2, "hidden": 64}; repeated or malformed keys are errors."""
    out: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key or not value.strip():
            raise UserError(f"model spec {spec!r}: argument {item!r} must look like key=value; {SPEC_HELP}")
        if key in out:
            raise UserError(f"model spec {spec!r} gives {key}= twice; give it once")
        out[key] = _value(spec, key, value)
    return out


def _keywords(cls: type) -> dict[str, Any]:
    """The model's keyword-only arguments and their defaults (a default fixes the type a value needs)."""
    params = inspect.signature(cls.__init__).parameters.values()
    return {p.name: p.default for p in params
            if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in NOT_IN_SPEC}


def _check_type(spec: str, key: str, value: Any, default: Any) -> None:
    kind = type(default)
    if default is None or kind is type(value) or (kind is float and type(value) is int):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 1:
            raise UserError(f"model spec {spec!r}: {key}={value} must be positive")
        return
    want = ("true or false" if kind is bool else "a number" if kind is float else "a name" if kind is str
            else "a whole number")
    raise UserError(f"model spec {spec!r}: {key}={value!r} must be {want}")


def _shape(spec: str, key: str, value: Any) -> tuple[int, ...]:
    shape = value if isinstance(value, tuple) else (value,)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise UserError(f"model spec {spec!r}: {key}= must be positive integers such as 3x224x224")
    return shape


def _zoo(spec: str, name: str, args: dict[str, Any], device: torch.device) -> tuple[nn.Module, InputMaker]:
    cls = MODELS[name]
    shape, n_classes = ZOO_DEFAULTS.get(name, ((3, 224, 224), 1000))
    shape_key, classes_key = SHAPE_KEYS.get(name, ("input", "classes"))
    aliases = GPT_ALIASES if name in TOKEN_MODELS else {}
    keywords = _keywords(cls)
    valid = [shape_key, classes_key, *aliases, *keywords]
    kwargs: dict[str, Any] = {}
    for key, value in args.items():
        if key in NOT_IN_SPEC:
            raise UserError(f"model spec {spec!r}: {NOT_IN_SPEC[key]}")
        if key == shape_key:
            shape = _shape(spec, key, value)
        elif key == classes_key:
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"model spec {spec!r}: {key}={value!r} must be a positive whole number")
            n_classes = value
        elif key in valid:
            _check_type(spec, key, value, keywords[aliases.get(key, key)])
            kwargs[aliases.get(key, key)] = value
        else:
            raise UserError(f"model spec {spec!r}: {name} takes no argument {key!r}; "
                            f"choose from {', '.join(valid)}")
    for key in ("n_layers", "depth"):  # a model this deep would take minutes to build, even on meta
        if kwargs.get(key, 0) > MAX_LAYERS:
            raise UserError(f"model spec {spec!r}: {kwargs[key]:,} layers is more than the {MAX_LAYERS:,} "
                            "the planner profiles (the deepest published models have a few hundred)")
    with device:
        model = cls(shape, n_classes, **kwargs)
    if name in TOKEN_MODELS:
        return model, lambda batch: torch.randint(0, n_classes, (batch, *shape), device=device)
    return model, lambda batch: torch.randn(batch, *shape, device=device)


def _user(spec: str, target: str, args: dict[str, Any], device: torch.device,
          data: str | None = None) -> tuple[nn.Module, InputMaker]:
    """A user's model, as `paraloom train` builds it (`model.name=target`, `model.options=args`),
    with its example input: from the factory's (model, make_input) pair, the model's
    `example_input(batch)`, or samples of the data set `data` names (`package.module:factory[:k=v]`)."""
    with device:
        made = call_factory("--model", target, args, returns="a torch.nn.Module")
    if isinstance(made, tuple) and len(made) == 2 and isinstance(made[0], nn.Module) and callable(made[1]):
        model, maker = made
    elif isinstance(made, nn.Module) and data is not None:
        model, maker = made, data_input(data)
    elif isinstance(made, nn.Module) and callable(getattr(made, "example_input", None)):
        model, maker = made, made.example_input
    elif isinstance(made, nn.Module):
        model, maker = made, None  # the model alone serves, say, tp_sizes; profiling needs an input
    else:
        raise UserError(f"model spec {spec!r}: {target} must return an nn.Module (or (model, make_input) "
                        f"where make_input(batch) gives an input batch), not {type(made).__name__}")

    def make_input(batch: int) -> torch.Tensor:
        if maker is None:
            raise UserError(f"model spec {spec!r}: the planner needs an example input; give --data "
                            "package.module:factory (your data set), or a model with example_input(batch)")
        with device:  # tensors the maker creates land on the device (meta: no memory)
            return maker(batch).to(device)

    return model, make_input


def data_input(data: str) -> InputMaker:
    """Input batches of the first training samples of the data set `data` names
    (`package.module:factory[:key=value,...]`, as `data.name` and `data.options` in a config)."""
    from paraloom.data import collate, load_user_data

    head, _, rest = data.strip().partition(":")
    target, _, arg_text = rest.partition(":")
    train = load_user_data(f"{head}:{target}", parse_args(data, arg_text)).train

    def maker(batch: int) -> torch.Tensor:
        return collate([train[i % len(train)] for i in range(batch)])[0]

    return maker


def build_from_spec(spec: str, device: str | torch.device = "meta",
                    data: str | None = None) -> tuple[nn.Module, InputMaker]:
    """The model a spec names, built on `device` (meta: shapes only, no memory), and its input maker
    (a user's model may take it from the data set `data` names)."""
    if not isinstance(spec, str) or not spec.strip():
        raise UserError(f"the model spec is empty; {SPEC_HELP}")
    spec = spec.strip()
    head, _, rest = spec.partition(":")
    device = torch.device(device)
    if head in MODELS:
        return _zoo(spec, head, parse_args(spec, rest), device)
    target, _, arg_text = rest.partition(":")
    if _dotted(head) and _dotted(target):
        return _user(spec, f"{head}:{target}", parse_args(spec, arg_text), device, data)
    if not rest and _dotted(head):
        raise UserError(f"model {head!r} is not in the zoo ({', '.join(MODELS)}); for your own model "
                        "give package.module:factory")
    raise UserError(f"model spec {spec!r} is not understood; {SPEC_HELP}")


def _dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


__all__ = ["SPEC_HELP", "ZOO_DEFAULTS", "InputMaker", "build_from_spec", "data_input", "parse_args"]
