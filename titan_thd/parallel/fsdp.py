"""FSDP2 over the `fsdp` mesh (dp × cp), layout-independent weights, and a memory estimate.

- `apply_fsdp` shards each block, then the root. Gradients are *summed* over the fsdp ranks, not
  averaged: the trainer divides the loss once by the global trained-token count, so a further
  division by the number of ranks would be wrong. `set_gradient_divide_factor(1.0)` alone makes
  FSDP2 reduce-scatter with PREMUL_SUM, which gloo rejects; `set_force_sum_reduction_for_comms`
  switches to SUM (then a division by 1.0), the same math on every backend.
- Sharding keeps the values the model already holds: the trainer builds the full model on CPU
  under `torch.manual_seed(seed)` and then shards it, so a seed gives the same weights on every
  parallel layout.
- Models too large to materialise (the dsv4 `flash` preset in a fake-PG dry run) are built on
  the meta device, sharded, then `materialize_sharded` allocates only the local shards.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_thd.parallel.parallel_dims import EP_TP_DIMS, ParallelDims


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    mp_param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    other_units: Iterable[tuple[nn.Module, DeviceMesh, int | Callable[[nn.Parameter], int]]] = (),
) -> nn.Module:
    """Shard `blocks` (each its own all-gather unit) and then the root over `fsdp_mesh`.

    `other_units` (unit, mesh, dim) are sharded first, each over its own mesh on the given
    parameter dimension, or `dim(param)` per parameter (expert-parallel routed experts over `efsdp`
    on dim 1, their dim 0 being ep's), so that their blocks leave them out.

    `mp_param_dtype` (e.g. bfloat16) is the dtype parameters are gathered in for compute; the
    sharded master weights and the gradient reduction stay in float32.
    """
    # 2-D: HSDP (replicate over dim 0, shard over dim 1), the sums stay sums across replicas too.
    assert fsdp_mesh is not None and fsdp_mesh.ndim in (1, 2), fsdp_mesh
    if mp_param_dtype is None:
        mp_policy = MixedPrecisionPolicy()
    else:
        mp_policy = MixedPrecisionPolicy(param_dtype=mp_param_dtype, reduce_dtype=torch.float32)
    for unit, mesh, dim in other_units:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp_policy,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=lambda p, dim=dim: Shard(dim(p) if callable(dim) else dim),
        )
    for block in blocks:
        fully_shard(block, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=fsdp_mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            # The graph depends on the data: an all-padding microbatch skips attention, a MoE
            # expert may get no tokens on one rank. Without zero gradients for the parameters
            # a rank did not use, ranks reduce-scatter different buffers and the collective
            # mismatches (gloo aborts, NCCL hangs).
            module.set_reduce_scatter_unused_params(True)
    return model


def build_on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    """`build()` on the meta device: shapes only, no memory, no initialisation cost."""
    with torch.device("meta"):
        return build()


@torch.no_grad()
def materialize_sharded(model: nn.Module, device: str | torch.device = "cpu", std: float = 0.02) -> None:
    """Allocate the local shards of a meta-built (and sharded) model and fill them.

    Values are for dry runs only: the model's own `init_weights()` when it defines one (it must
    work on sharded parameters), else N(0, std) for parameters and zeros for buffers, drawn
    locally per shard so that no collective (and no DTensor RNG) is involved.
    """
    model.to_empty(device=device)
    init_weights = getattr(model, "init_weights", None)
    if callable(init_weights):
        init_weights()
        return
    for p in model.parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        local.normal_(0.0, std)
    for b in model.buffers():
        (b.to_local() if isinstance(b, DTensor) else b).zero_()


def largest_unsharded_unit_bytes(model: nn.Module) -> int:
    """Bytes of the largest FSDP unit's full (unsharded) parameters: what one all-gather of a
    forward or backward materialises on a rank, whatever the fsdp degree (its tp share under TP,
    its own experts under EP)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] or [model]
    nested = {u: [v for v in u.modules() if v is not u and isinstance(v, FSDPModule)] for u in units}
    largest = 0
    for unit in units:
        inner = {id(p) for v in nested[unit] for p in v.parameters()}
        own = [p for p in unit.parameters() if id(p) not in inner]
        # A DTensor's global shape, less its tp / ep split (an FSDP all-gather stops at them).
        largest = max(largest, sum(math.prod(_model_parallel_shape(p)) * p.element_size() for p in own))
    return largest


# ============================================================================ memory estimate
@dataclass(frozen=True)
class MemoryEstimate:
    params: int
    """Parameters held by this rank (its FSDP shards)."""
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes

    def __str__(self) -> str:
        # One unit for the whole line: GiB for real models, MiB for the small ones of tests.
        unit, scale = ("GiB", 1024**3) if self.total_bytes >= 1024**3 else ("MiB", 1024**2)
        return (
            f"{self.params:,} parameters per rank; estimated memory per rank: "
            f"params {self.param_bytes / scale:.2f} {unit} + grads {self.grad_bytes / scale:.2f} {unit} + "
            f"optimizer {self.optimizer_bytes / scale:.2f} {unit} = {self.total_bytes / scale:.2f} {unit} "
            "(activations excluded)"
        )


def local_numel(shape: torch.Size | tuple[int, ...], shards: int, shard_rank: int = 0) -> int:
    """Elements of `shard_rank`'s FSDP shard: dim 0 is cut into ceil(d0 / shards) rows per rank."""
    if len(shape) == 0:
        return 1
    rows = math.ceil(shape[0] / shards)
    local_rows = max(0, min(rows, shape[0] - shard_rank * rows))
    return local_rows * math.prod(shape[1:])


_MODEL_PARALLEL_DIMS = ("tp", "ep", *EP_TP_DIMS)
"""Mesh dimensions that split a parameter for compute (FSDP's all-gather stops at them)."""


def _model_parallel_shape(p: torch.Tensor) -> tuple[int, ...]:
    """Global shape with the tensor- and expert-parallel dimensions cut to rank 0's share (ceil)."""
    shape = list(p.shape)
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    for i, name in enumerate(names):
        placement = p.placements[i]
        if name in _MODEL_PARALLEL_DIMS and isinstance(placement, Shard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(i))
    return tuple(shape)


def _sharded_numel(p: DTensor) -> int:
    """Elements of the coordinate-0 shard of a DTensor (the largest: torch.chunk's first part),
    every mesh dimension's `Shard(dim)` cutting its dimension in turn."""
    shape = list(p.shape)
    for i, placement in enumerate(p.placements):
        # _StridedShard (FSDP over a TP shard) is no Shard subclass in torch 2.13: the same share.
        if isinstance(placement, Shard | _StridedShard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(i))
    return math.prod(shape)


def estimate_memory_per_rank(
    model: nn.Module,
    parallel_dims: ParallelDims,
    optimizer: str = "adamw",
    dtype: torch.dtype = torch.float32,
    muon_params: Collection[str] = (),
) -> MemoryEstimate:
    """Parameter, gradient and optimizer-state bytes on the most loaded rank (fsdp rank 0).

    Works on a full, a sharded (DTensor shapes are global) or a meta model. Parameters and
    gradients are stored in `dtype`; AdamW keeps two states per parameter, Muon one for the
    parameters named in `muon_params` (AdamW for the rest). Under pipeline parallelism pass
    one stage's module; a tensor-parallel shard counts its share of the tp-split dimension;
    activations are excluded.
    """
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"estimate_memory_per_rank: optimizer {optimizer!r}, expected adamw or muon")
    itemsize = torch.empty((), dtype=dtype).element_size()
    shards = parallel_dims.fsdp_degree if parallel_dims.fsdp_enabled else 1
    params = states = 0
    for name, p in model.named_parameters():
        # A sharded parameter's own placements (expert-parallel experts: ep x efsdp); an unsharded
        # one as FSDP will cut it, on dim 0 over fsdp.
        n = _sharded_numel(p) if isinstance(p, DTensor) else local_numel(p.shape, shards)
        params += n
        states += n * (1 if optimizer == "muon" and name in muon_params else 2)
    return MemoryEstimate(params, params * itemsize, params * itemsize, states * itemsize)
