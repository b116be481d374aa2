"""A user's `package.module:factory`: imported, its options checked against its signature, called;
every way that can fail is one line that starts with the setting that named it (torch-free)."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from paraloom.config.errors import UserError


def first_line(exc: BaseException) -> str:
    """`exc` in one line: its type and its message's first line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def import_factory(where: str, target: str, returns: str) -> Callable[..., Any]:
    """The callable `target` ("package.module:factory", the factory possibly dotted) names; `where`
    starts every error ("data.name='x:y'"), `returns` says what the factory should give."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise UserError(f"{where} must look like package.module:factory")
    try:
        factory: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(f"{where}: cannot import {module_name!r} ({exc}); install it or add its "
                        "folder to PYTHONPATH") from None
    except Exception as exc:  # the user's module failed while importing: say how, in one line
        raise UserError(f"{where}: importing {module_name!r} raised {first_line(exc)}") from None
    for part in attr.split("."):
        if not hasattr(factory, part):
            raise UserError(f"{where}: {module_name!r} has no attribute {attr!r}; name a function "
                            f"that returns {returns}")
        factory = getattr(factory, part)
    if not callable(factory):
        raise UserError(f"{where}: {attr!r} is not callable (type {type(factory).__name__}); name a "
                        f"function that returns {returns}")
    return factory


def check_options(where: str, factory: Callable[..., Any], options: Mapping[str, Any]) -> None:
    """Refuse options the factory does not take, naming them and what it takes."""
    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):
        return  # no signature to read (some builtins): the call says what is wrong
    try:
        signature.bind(**options)
    except TypeError as exc:
        params = signature.parameters.values()
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        unknown = [] if takes_any else sorted(set(options) - named)
        if unknown:
            raise UserError(f"{where}: the factory takes no option {', '.join(map(repr, unknown))}; "
                            f"it takes: {', '.join(sorted(named)) or 'none'}") from None
        raise UserError(f"{where}: the factory cannot be called with these options ({exc})") from None


def call_factory(key: str, target: str, options: Mapping[str, Any] | None = None, *,
                 returns: str = "what the setting needs") -> Any:
    """Import `target`, check `options` against it and call it with them; errors start `key=target`."""
    where, options = f"{key}={target!r}", dict(options or {})
    factory = import_factory(where, target, returns)
    check_options(where, factory, options)
    try:
        return factory(**options)
    except UserError as exc:  # raised inside the factory (a DataSets it built, say): say whose
        raise UserError(f"{where}: {exc}") from None
    except Exception as exc:  # the user's factory failed: say how, in one line
        raise UserError(f"{where}: the factory raised {first_line(exc)}") from None
