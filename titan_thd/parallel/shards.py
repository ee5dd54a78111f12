"""A parameter's name and this rank's part of it, as the unwrapped, unsharded model sees them.

    canonical_name("layers.0._checkpoint_wrapped_module._orig_mod.attn.wq.weight")
        -> "layers.0.attn.wq.weight"
    local, box = local_box(t)   # t[box] of the global tensor is `local` on this rank

Used wherever a parameter is matched by name or filled, read or written by its global rows: the seeded
init, the Hugging Face load, the checkpoint fingerprint and the evaluation copy.
"""

from __future__ import annotations

import re

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

UNSHARDED = "fsdp_unsharded_params"
"""Attribute of a module: names of its parameters that FSDP leaves alone (a LoRA run's base kept as
released: models/packed_weight.py swaps them for their codes after the model is sharded)."""
PAIRS = "lora_pairs"
"""Attribute of a module with LoRA adapters (models/projection.py): {base parameter: (A's name, B's
name)}. Each adapter is sharded by its base's rule (`tensor_parallel.ShardedLocal`,
`expert_parallel.apply_ep`) and drawn by the seeded init (`seeded_init.adapter_rules`)."""

WRAPPER_NAMES = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
"""Module names torch inserts into a parameter's name: activation checkpointing, torch.compile, FSDP1."""

_WRAPPERS = re.compile(r"(^|\.)(" + "|".join(WRAPPER_NAMES) + r")\.")


def canonical_name(fqn: str) -> str:
    """`fqn` without any wrapper name (`WRAPPER_NAMES`, nested or repeated, at any depth)."""
    while True:
        cleaned = _WRAPPERS.sub(r"\1", fqn)
        if cleaned == fqn:
            return fqn
        fqn = cleaned


def local_box(t: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...]]:
    """(this rank's local tensor, the box of the global tensor it holds): all of a plain tensor, a
    DTensor's placements' box as DCP computes it (an empty box on a rank that holds no rows)."""
    if not isinstance(t, DTensor):
        return t, tuple(slice(0, n) for n in t.shape)
    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local()
    assert tuple(local.shape) == tuple(shape), (tuple(local.shape), shape, t.placements)
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
