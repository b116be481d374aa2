"""Config text: YAML read safely, dotted `--set` overrides, their merge, values checked against types
and built into a section.

YAML is bounded before anything is built from it: a file over MAX_BYTES is refused before parsing,
and text is refused from its parse events, before they are composed, where its values number over
MAX_NODES with every alias counted as the value it names (a "billion laughs", nine lists of nine
aliases of the list before, is 600 bytes and 387 million values once expanded, as writing the config
out expands it) or nest deeper than MAX_DEPTH (yaml's composer recurses).
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from pathlib import Path
from typing import Any

import yaml

from paraloom.config import rules
from paraloom.config.errors import UserError

MAX_BYTES = 1 << 20  # a config holds settings, not data: real ones are a few kB
MAX_NODES = 10_000  # values of a config or a --set value, every alias counted as what it stands for
MAX_DEPTH = 100  # nesting; yaml's composer fails near 300 levels with a RecursionError
_PARSER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml, where PyYAML was built with it: 15x faster


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["data.batch_size=128", "model.options.width=256", ...]` -> nested dict; values are parsed
    as YAML scalars. A key below a section's key (`model.options.width`) sets one entry of a mapping."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        dotted, sep, text = item.partition("=")
        path = dotted.strip().split(".")
        if not sep or len(path) < 2 or not all(path):
            raise UserError(f"--set {item!r} must look like section.key=value, e.g. data.batch_size=128")
        node: dict[str, Any] = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {item!r} sets a key below {part!r}, which another --set gave a value")
        node[path[-1]] = _parse_scalar(text, dotted)
    return out


def _parse_scalar(text: str, key: str) -> Any:
    try:
        check_bounds(text, f"--set {key}=")
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)):
        raise UserError(f"--set {key}= takes a single value, not {type(value).__name__}")
    if hasattr(value, "isoformat"):  # YAML dates stay text
        return text
    if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
        return float(value)  # YAML 1.1 reads "1e-6" as text; a mapping's entries are not coerced later
    return value


def check_bounds(text: str, source: str) -> None:
    """UserError naming `source` if YAML `text` is over MAX_BYTES, or, aliases expanded, over MAX_NODES
    values or MAX_DEPTH levels deep, or holds itself; yaml.YAMLError, as safe_load's, if it is not YAML."""
    if len(text) > MAX_BYTES:
        raise UserError(f"{source} is {len(text):,} characters, over the {MAX_BYTES:,} a config may hold: "
                        "refused; give data as a path to a file of its own")
    try:
        _count(text, source, _PARSER)
    except yaml.YAMLError:
        if _PARSER is yaml.SafeLoader:
            raise
        _count(text, source, yaml.SafeLoader)  # what libyaml refuses, safe_load may read: it decides


def _count(text: str, source: str, loader: Any) -> None:
    """check_bounds on `loader`'s parse events, each anchored value's size counted once."""
    sizes: dict[str, int] = {}  # an anchored value's size, aliases in it expanded
    open_: list[list[Any]] = []  # [anchor, size so far] of each sequence or mapping being read
    total = 0
    for event in yaml.parse(text, Loader=loader):
        if isinstance(event, yaml.CollectionStartEvent):
            open_.append([event.anchor, 1])
            total += 1
            if len(open_) > MAX_DEPTH:
                raise UserError(f"{source} nests deeper than {MAX_DEPTH} levels: refused")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            anchor, size = open_.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1
            total += 1
        elif isinstance(event, yaml.AliasEvent):
            if any(frame[0] == event.anchor for frame in open_):
                raise UserError(f"{source} holds an alias *{event.anchor} inside the value it names: "
                                "a value that contains itself is refused")
            anchor, size = None, sizes.get(event.anchor, 1)  # an undefined one: the load says so
            total += size
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if open_:
            open_[-1][1] += size
        if total > MAX_NODES:
            raise UserError(f"{source} holds more than {MAX_NODES:,} values, aliases expanded: refused; "
                            "give data as a path to a file of its own")


def parse_yaml(text: str, source: str) -> Any:
    """yaml.safe_load (no tag constructs Python objects) of bounded text (check_bounds), a syntax error
    as one line naming `source`."""
    try:
        check_bounds(text, source)
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" (line {mark.line + 1})" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise UserError(f"{source} is not valid YAML{line}: {problem}") from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping safely; no tag may construct Python objects."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_BYTES + 1)  # no more, whatever the file (a device, a 50 MB file)
        if len(data) > MAX_BYTES:
            raise UserError(f"config file {str(path)!r} is over {MAX_BYTES:,} bytes: refused before parsing; "
                            "a config holds settings, give data as a path to a file of its own")
        text = data.decode()
    except FileNotFoundError:
        raise UserError(f"config file {str(path)!r} does not exist") from None
    except IsADirectoryError:
        raise UserError(f"config file {str(path)!r} is a directory; give a YAML file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read config file {str(path)!r}: {exc.__class__.__name__}") from None
    raw = parse_yaml(text, f"config file {str(path)!r}")
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {str(path)!r} must be a mapping of sections, "
                        f"got {type(raw).__name__}")
    return raw


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`overrides` laid over `base`, mappings merged key by key at every depth (neither is changed)."""
    out = dict(base)
    for key, value in overrides.items():
        current = out.get(key)
        out[key] = merge(current, value) if isinstance(value, dict) and isinstance(current, dict) else value
    return out


def type_text(tp: Any) -> str:
    if typing.get_origin(tp) is dict:
        return "mapping"
    args = typing.get_args(tp)
    if args:
        return " or ".join(type_text(a) for a in args)
    return "null" if tp is type(None) else tp.__name__


_FLOAT_TEXT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def coerce(key: str, value: Any, tp: Any, allowed: tuple[str, ...] | None, factory: bool = False) -> Any:
    """Check one value against its annotation; ints widen to floats, nothing else converts."""
    options = (tp,) if typing.get_origin(tp) is dict else typing.get_args(tp) or (tp,)
    if value is None:
        if type(None) in options:
            return None
        raise UserError(f"{key} must not be empty (null)")
    for option in options:
        if typing.get_origin(option) is dict and isinstance(value, dict):
            if not all(isinstance(k, str) for k in value):
                raise UserError(f"{key} must map names to values, got keys {list(value)!r}")
            return value
        if option is bool and isinstance(value, bool):
            return value
        if option is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if option is float and not isinstance(value, bool):
            if isinstance(value, str) and _FLOAT_TEXT.fullmatch(value.strip()):
                value = float(value)  # YAML 1.1 reads "1e-3" as text
            if isinstance(value, (int, float)):
                if not math.isfinite(value):
                    raise UserError(f"{key} must be a finite number, got {value!r}")
                return float(value)
        if option is str and isinstance(value, str):
            if factory and rules.is_factory(value):
                return value
            return rules.check_name(key, value, allowed, factory=factory) if allowed else value
    wanted = " or ".join("a mapping" if typing.get_origin(o) is dict else type_text(o)
                         for o in options if o is not type(None))
    raise UserError(f"{key} must be {wanted}, got {value!r}")


def build_section(name: str, section_type: type, values: dict[str, Any]) -> Any:
    """A config section (a dataclass) from its mapping of keys: unknown keys and mistyped values refused."""
    hints = typing.get_type_hints(section_type)
    fields = {f.name: f for f in dataclasses.fields(section_type)}
    kwargs = {}
    for key, value in values.items():
        if key not in fields:
            raise UserError(f"unknown key {name}.{key}; keys of {name}: {', '.join(fields)}")
        metadata = fields[key].metadata
        kwargs[key] = coerce(f"{name}.{key}", value, hints[key], metadata.get("choices"),
                             metadata.get("factory", False))
    return section_type(**kwargs)
