"""Model families. `get_model_spec(name)` imports only the family that is asked for."""

from __future__ import annotations

import importlib

from titan_thd.models.spec import ModelOutput, ModelSpec

MODEL_NAMES = ("llama", "dsv4")


def get_model_spec(name: str) -> ModelSpec:
    if name not in MODEL_NAMES:
        raise ValueError(f"model.name: got {name!r}, expected one of {', '.join(MODEL_NAMES)}")
    return importlib.import_module(f"titan_thd.models.{name}").spec


def get_model_args(name: str, flavor: str):
    """The args of `flavor` ("" = the family's default flavor)."""
    spec = get_model_spec(name)
    flavor = flavor or spec.default_flavor or next(iter(spec.flavors), "")
    if flavor not in spec.flavors:
        raise ValueError(
            f"model.flavor: got {flavor!r} for {name}, expected one of {', '.join(spec.flavors)}"
        )
    return spec.flavors[flavor]


__all__ = ["MODEL_NAMES", "ModelOutput", "ModelSpec", "get_model_args", "get_model_spec"]
