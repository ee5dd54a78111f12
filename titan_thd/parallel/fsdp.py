"""FSDP2 over the `fsdp` mesh (dp × cp) and layout-independent weights (the memory a rank's share
takes: memory/state.py).

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

from collections.abc import Callable, Iterable
from typing import Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.shards import UNSHARDED


class Precision(Protocol):
    """What FSDP reads of the run's dtypes (components/precision.py `Precision`, which sits above
    this package: components import parallel)."""

    compute: torch.dtype
    reduce: torch.dtype

    @property
    def mixed(self) -> bool: ...


def fsdp_mesh(parallel_dims: ParallelDims, precision: Precision | None) -> DeviceMesh | None:
    """The mesh FSDP shards over (dp x cp), or None when it would have nothing to do: one rank and
    no mixed precision (`precision` None: a pure run). Mixed precision is FSDP2's casting, so it shards even over one rank (the
    all-gather of one rank is a copy, and the same code path as every other layout)."""
    if parallel_dims.fsdp_enabled or (precision is not None and precision.mixed):
        return parallel_dims.get_mesh("fsdp")
    return None


def apply_fsdp(
    model: nn.Module,
    fsdp_mesh: DeviceMesh,
    blocks: Iterable[nn.Module],
    precision: Precision | None = None,
    reshard_after_forward: bool = True,
    other_units: Iterable[tuple[nn.Module, DeviceMesh, int | Callable[[nn.Parameter], int]]] = (),
    master_dtype_units: Iterable[nn.Module] = (),
) -> nn.Module:
    """Shard `blocks` (each its own all-gather unit) and then the root over `fsdp_mesh`.

    `other_units` (unit, mesh, dim) are sharded first, each over its own mesh on the given
    parameter dimension, or `dim(param)` per parameter (expert-parallel routed experts over `efsdp`
    on dim 1, their dim 0 being ep's), so that their blocks leave them out.

    `precision` (components/precision.py): under mixed precision every unit gathers its
    parameters in the compute dtype and reduce-scatters the gradients in the reduction dtype into
    the sharded master-dtype gradients; `master_dtype_units` (small modules inside the blocks
    whose parameters the model's reference keeps in float32, e.g. dsv4's mHC) are units of their
    own that compute in the master dtype (FSDP2 casts per unit, one dtype each). None, or a pure
    run: no casting, the reduction in the parameters' dtype.
    """
    # 2-D: HSDP (replicate over dim 0, shard over dim 1), the sums stay sums across replicas too.
    assert fsdp_mesh is not None and fsdp_mesh.ndim in (1, 2), fsdp_mesh
    policy = as_master = MixedPrecisionPolicy()
    if precision is not None and precision.mixed:
        policy = MixedPrecisionPolicy(param_dtype=precision.compute, reduce_dtype=precision.reduce)
    else:
        master_dtype_units = ()

    # A LoRA run's base kept as released stays out (models/packed_weight.py: replicated, never gathered).
    ignored = {getattr(m, n) for m in model.modules() for n in getattr(m, UNSHARDED, ())}

    def shard(unit: nn.Module, mesh: DeviceMesh, mp: MixedPrecisionPolicy, placement=None) -> None:
        fully_shard(
            unit,
            mesh=mesh,
            mp_policy=mp,
            reshard_after_forward=reshard_after_forward,
            shard_placement_fn=placement,
            ignored_params=ignored or None,
        )

    for unit, mesh, dim in other_units:
        shard(unit, mesh, policy, lambda p, dim=dim: Shard(dim(p) if callable(dim) else dim))
    for unit in master_dtype_units:
        shard(unit, fsdp_mesh, as_master)
    for block in blocks:
        shard(block, fsdp_mesh, policy)
    shard(model, fsdp_mesh, policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)
            # The graph depends on the data: an all-padding microbatch skips attention, a MoE
            # expert may get no tokens on one rank. Without zero gradients for the parameters
            # a rank did not use, ranks reduce-scatter different buffers and the collective
            # mismatches (gloo aborts, NCCL hangs).
            if hasattr(module, "set_reduce_scatter_unused_params"):
                module.set_reduce_scatter_unused_params(True)
            elif fsdp_mesh.shape[-1] > 1:  # torch 2.11 has no such switch; a shard group of one needs none
                raise ValueError(
                    f"FSDP over {fsdp_mesh.shape[-1]} ranks needs torch 2.13 (FSDPModule."
                    f"set_reduce_scatter_unused_params); this is torch {torch.__version__}: use torch 2.13, or "
                    "one data-parallel shard per model replica (parallelism.data_parallel_shard_degree 1)"
                )
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
