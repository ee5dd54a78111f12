"""ModelSpec: what the trainer needs to know about a model family, in one small record.

Every model family (`titan_thd/models/<name>/__init__.py`) exposes `spec = ModelSpec(...)`; the
trainer looks it up by `model.name` through `titan_thd.models.get_model_spec`.

Model contract (docs/design.md §3.4):
    model = spec.build(args)            # full weights on CPU, initialised from the current RNG state
    out = model(tokens_T, meta)         # tokens: [T_local] int64, meta: BatchMeta
    out.logits                          # [T_local, V] float
    out.aux_losses                      # {"name": scalar} SUMS over this rank's rows, coefficients
                                        # already applied; the trainer divides them, like the main
                                        # cross-entropy sum, by the global trained-token count.
Initialisation is a function of the RNG state only (never of the parallel layout): build the
model under `torch.manual_seed(seed)` on CPU, then shard it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    """[T_local, V] logits of this rank's rows."""
    aux_losses: dict[str, torch.Tensor]
    """Extra loss terms as sums over this rank's rows (coefficients applied)."""


@dataclass
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """flavor name -> model args dataclass (must have `vocab_size`)."""
    build: Callable[[Any], nn.Module]
    """args -> model with initialised full weights (call under a seeded RNG)."""
    flops_per_step: Callable[[Any, Sequence[int]], float]
    """(args, real document lengths of a step) -> forward+backward FLOPs of those documents."""
    parallelize: Callable[..., nn.Module] | None = None
    """(model, parallel_dims, parallelism_config) -> model; applies TP / CP / FSDP in a fixed order."""
    cp_modes: tuple[str, ...] = ("zigzag", "contiguous")
    """Context-parallel modes the model computes exactly."""
    min_tokens_per_cp_rank: Callable[[Any], int] = field(default=lambda args: 1)
    """Smallest local shard (T / cp) the model supports, e.g. its CP halo width."""
    matrix_params: Callable[[nn.Module], list[str]] | None = None
    """Names of parameters that Muon updates (the rest go to AdamW); None = every 2-D weight except
    embeddings and the LM head."""
    hooks: dict[str, Callable[..., Any]] = field(default_factory=dict)
    """Optional trainer hooks, e.g. "after_optimizer_step": (model, reduce_group) -> None."""


def build_initialised(make: Callable[[], nn.Module]) -> nn.Module:
    """`make()` with weights drawn by its `init_weights()` from the current RNG, on CPU.

    The module is constructed on the meta device first, so no throw-away default initialisation
    runs. Under `with torch.device("meta")` (fake-process-group dry runs) it stays on meta: shapes
    only, initialised later shard by shard.
    """
    on_meta = torch.get_default_device().type == "meta"
    with torch.device("meta"):
        model = make()
    if not on_meta:
        model.to_empty(device="cpu")
        model.init_weights()
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def as_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]
