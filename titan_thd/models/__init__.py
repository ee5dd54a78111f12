"""Model families. `get_model_spec(name)` imports only the family that is asked for.

The family names are the config's `ModelName` (titan_thd/config/choices.py), one per family package
of this folder. A family is a package `titan_thd/models/<name>/` exposing `spec = ModelSpec(...)`
(docs/adding_a_model.md).
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Mapping
from typing import Any, get_args

from titan_thd.config import coerce
from titan_thd.config.choices import ModelName
from titan_thd.models.spec import ModelSpec

MODEL_NAMES: tuple[str, ...] = get_args(ModelName)


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_NAMES:
        raise ValueError(f"model.name: got {name!r}, expected one of {', '.join(MODEL_NAMES)}")
    return importlib.import_module(f"titan_thd.models.{name}").spec


def get_model_args(name: str, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The args of `flavor` ("" = the family's default flavor) with `overrides` ([model.args]) applied,
    each coerced to its field's type; ValueError for a name the args do not have (with their list) or
    a value of the wrong type."""
    spec = get_model_spec(name)
    flavor = flavor or spec.default_flavor or next(iter(spec.flavors), "")
    if flavor not in spec.flavors:
        raise ValueError(
            f"model.flavor: got {flavor!r} for {name}, expected one of {', '.join(spec.flavors)}"
        )
    args = spec.flavors[flavor]
    if not overrides:
        return args
    hints = typing.get_type_hints(type(args))
    own = [f.name for f in dataclasses.fields(args) if f.name != "vocab_size"]
    typed = {}
    for key, value in overrides.items():
        if key == "vocab_size":
            raise ValueError(
                "model.args.vocab_size: the vocabulary is the tokenizer's (rounded up to a multiple of 64) or "
                "the Hugging Face checkpoint's; remove it"
            )
        if key not in own:
            raise ValueError(
                f"model.args.{key}: model {name} has no such setting; its settings: {', '.join(own)}"
            )
        typed[key] = coerce(f"model.args.{key}", value, hints[key], from_cli=isinstance(value, str))
    return dataclasses.replace(args, **typed)


__all__ = ["MODEL_NAMES", "ModelName", "get_model_args", "get_model_spec"]
