"""Model families. `get_model_spec(name)` imports only the family that is asked for.

The family names are the config's `ModelName` (titan_thd/config/choices.py), one per family package
of this folder. A family is a package `titan_thd/models/<name>/` exposing `spec = ModelSpec(...)`
(docs/adding_a_model.md).
"""

from __future__ import annotations

import importlib
from typing import Any, get_args

from titan_thd.config.choices import ModelName
from titan_thd.models.spec import ModelSpec

MODEL_NAMES: tuple[str, ...] = get_args(ModelName)


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_NAMES:
        raise ValueError(f"model.name: got {name!r}, expected one of {', '.join(MODEL_NAMES)}")
    return importlib.import_module(f"titan_thd.models.{name}").spec


def get_model_args(name: str, flavor: str) -> Any:
    """The args of `flavor` ("" = the family's default flavor)."""
    spec = get_model_spec(name)
    flavor = flavor or spec.default_flavor or next(iter(spec.flavors), "")
    if flavor not in spec.flavors:
        raise ValueError(
            f"model.flavor: got {flavor!r} for {name}, expected one of {', '.join(spec.flavors)}"
        )
    return spec.flavors[flavor]


__all__ = ["MODEL_NAMES", "ModelName", "get_model_args", "get_model_spec"]
