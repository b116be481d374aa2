"""Config text: YAML files read safely, dotted `--set section.key=value` overrides, and their merge."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from paraloom.errors import UserError


def parse_overrides(items: list[str]) -> dict[str, dict[str, Any]]:
    """`["data.batch_size=128", ...]` -> nested dict; values are parsed as YAML scalars."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        dotted, sep, text = item.partition("=")
        section, dot, key = dotted.strip().partition(".")
        if not sep or not dot or not section or not key:
            raise UserError(f"--set {item!r} must look like section.key=value, e.g. data.batch_size=128")
        out.setdefault(section, {})[key] = _parse_scalar(text, dotted)
    return out


def _parse_scalar(text: str, key: str) -> Any:
    try:
        value = yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        return text
    if isinstance(value, (dict, list)):
        raise UserError(f"--set {key}= takes a single value, not {type(value).__name__}")
    if hasattr(value, "isoformat"):  # YAML dates stay text
        return text
    return value


def parse_yaml(text: str, source: str) -> Any:
    """yaml.safe_load (no tag constructs Python objects), a syntax error as one line naming `source`."""
    try:
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
        text = path.read_text()
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


def merge(base: dict[str, Any], overrides: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out = {k: (dict(v) if isinstance(v, dict) else v) for k, v in base.items()}
    for section, values in overrides.items():
        current = out.get(section)
        out[section] = {**(current if isinstance(current, dict) else {}), **values}
    return out
