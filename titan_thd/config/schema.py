"""What the sections declare, read back: section names and types, field types, field docstrings and
the allowed values of every `Literal` field (`CHOICES`); and the closest-name hint of unknown keys.

The loader, the checks and `--help` all read the sections through these, so a field added to
sections.py is loadable, checked against its Literal and documented without further code.
"""

from __future__ import annotations

import ast
import difflib
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal

from titan_thd.config.sections import Config


def section_types() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in fields(Config)}  # type: ignore[misc]


def field_docs() -> dict[str, str]:
    """{"section.field": docstring} read from the string literal that follows each field."""
    # The docstrings of fields are not kept at run time: read them from the source of sections.py.
    tree = ast.parse(Path(__file__).with_name("sections.py").read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    docs: dict[str, str] = {}
    for section, cls in section_types().items():
        body = classes[cls.__name__].body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = ""
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    doc = " ".join(str(nxt.value.value).split())
                docs[f"{section}.{stmt.target.id}"] = doc
    return docs


def field_type(section_cls: type, name: str) -> Any:
    return typing.get_type_hints(section_cls)[name]


def _choices() -> dict[str, tuple[str, ...]]:
    """{"section.field": allowed values} of every field annotated `Literal[...]`."""
    return {
        f"{section}.{f.name}": typing.get_args(typ)
        for section, cls in section_types().items()
        for f in fields(cls)
        if typing.get_origin(typ := field_type(cls, f.name)) is Literal
    }


CHOICES: dict[str, tuple[str, ...]] = _choices()
"""Fields whose value must be one of a fixed set (their Literal annotations)."""


def closest(name: str, options: list[str]) -> str:
    """The ` Did you mean 'x'?` hint that ends an unknown-name error, or "" when nothing is close."""
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""
