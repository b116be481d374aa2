"""Help text for the config: every section's keys with type, default and the comment beside the field."""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from typing import Any

from paraloom.config.sections import section_types
from paraloom.config.yaml_io import type_text


def section_keys() -> dict[str, list[tuple[str, str, Any, str]]]:
    """Section -> [(key, type text, default, the comment beside the field)], for help texts."""
    out = {}
    for name, section_type in section_types().items():
        hints = typing.get_type_hints(section_type)
        comments = dict(_FIELD_COMMENT.findall(inspect.getsource(section_type)))
        rows = []
        for f in dataclasses.fields(section_type):
            kind = f.metadata.get("choices")
            text = "|".join(kind) if kind else type_text(hints[f.name])
            if f.metadata.get("factory"):
                text += "|package.module:factory"
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f.name, text, default, comments.get(f.name, "")))
        out[name] = rows
    return out


_FIELD_COMMENT = re.compile(r"^    (\w+): [^#\n]*#\s*(.*)$", re.MULTILINE)
