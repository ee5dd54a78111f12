"""Tensor parallelism with sequence parallelism: the rules and the few helpers both models share.

docs/design.md §5.1. Between blocks every activation is sequence-parallel: this rank's share of
the T/cp token rows, [T/cp/tp, ...] (`Shard(0)`); a block all-gathers the rows where it needs them
(attention, MLP / MoE), splits heads or hidden columns over the `tp` ranks, and reduce-scatters its
output back to rows. The LM head is vocabulary-parallel (`Shard(-1)` logits under `loss_parallel`,
components/loss.py), so the full [T, V] logits never exist on one rank.

    validate_tensor_parallel(degree=..., divides={"n_heads": 64}, tokens_per_cp_rank=...)  # start-up
    reduce_replicated_grads(model)                     # after backward (dsv4: params on SP rows)

The models' plans are literal `{fqn: ParallelStyle}` dicts in `models/<name>/parallelize.py`.
llama uses torch's styles only (DTensor activations inside each block). dsv4's attention and MoE
are custom code (sparse MQA, grouped einsum, mHC, expert loops), so they run on plain local
tensors inside a *partial-sum region* (Megatron's conjugate collectives), with these styles:

    GatherRows              region boundary: all-gather the input rows (backward: reduce-scatter),
                            reduce-scatter the partial output back to rows (backward: all-gather)
    ShardedLocal(dim)       a weight split over tp (DTensor Shard(dim)); the model multiplies its
                            local shard (`local(w)`), so the region's output is a partial sum
    ReplicatedPartialGrad   full weights on every tp rank, used on this rank's rows (norms, mHC)
                            or feeding only this rank's heads (q / KV projections, compressor,
                            router): each rank's gradient is a partial sum, added up over tp by
                            `reduce_replicated_grads` after backward
    ReplicatedFullGrad      full weights whose every use is the same on all tp ranks (the lightning
                            indexer: detached inputs, a loss with an all-reduced teacher): each
                            rank's gradient is already the whole one, nothing to reduce

Inside a region every activation gradient is a partial sum over tp, never a mixture of full and
partial ones, so one reduce-scatter at the region's entry is the whole adjoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from titan_thd.parallel.cp_comm import all_gather_rows
from titan_thd.parallel.shards import PAIRS

REPLICATED_GRADS = "_tp_replicated_grads"
"""Model attribute: (names of parameters whose gradients are partial over tp, the tp group)."""
_PARTIAL = "_tp_partial_grad"
_FULL = "_tp_full_grad"


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a tensor-parallel weight (the tensor itself when it is not a DTensor)."""
    return t.to_local() if isinstance(t, DTensor) else t


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        assert x.shape[0] % world == 0, (x.shape, world)
        out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
        dist.reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad_in = grad_out.new_empty((world * grad_out.shape[0], *grad_out.shape[1:]))
        dist.all_gather_single(grad_in, grad_out.contiguous(), group=ctx.group)
        return grad_in, None


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Sum the tp ranks' partial [T, ...] and keep this rank's T/tp rows; differentiable."""
    return _ReduceScatterRows.apply(x, group)


def _shard_params(module: nn.Module, mesh: DeviceMesh, dims: dict[str, int]) -> None:
    for name, dim in dims.items():
        p = module.get_parameter(name)
        assert not isinstance(p, DTensor) and p.shape[dim] % mesh.size() == 0, (name, p.shape, mesh)
        # Every rank holds the same full weights (built from one seed): take the local shard, no scatter.
        shard = distribute_tensor(p.data, mesh, [Shard(dim)], src_data_rank=None)
        module.register_parameter(name, nn.Parameter(shard, requires_grad=p.requires_grad))


class GatherRows(ParallelStyle):
    """The module computes on all T/cp rows: its first input is all-gathered from the sequence-
    parallel rows, its output (the first element of a tuple output) is a partial sum over tp and is
    reduce-scattered back to rows. `shard`: own parameters split over tp, {name: dim}."""

    def __init__(self, shard: dict[str, int] | None = None):
        super().__init__()
        self.shard = shard or {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        group = device_mesh.get_group()
        _shard_params(module, device_mesh, self.shard)

        def gather(_module, args):
            return (all_gather_rows(args[0], group), *args[1:])

        def scatter(_module, _args, out):
            if isinstance(out, tuple):
                return (reduce_scatter_rows(out[0], group), *out[1:])
            return reduce_scatter_rows(out, group)

        module.register_forward_pre_hook(gather)
        module.register_forward_hook(scatter)
        return module


class ShardedLocal(ParallelStyle):
    """Split the module's `weight` over tp on `dim` (0: output features, 1: input features), or
    each named parameter on its dim (`{name: dim}`: stacked experts); the model multiplies with
    `local(weight)` inside a GatherRows region (no communication here).

    A LoRA adapter (models/projection.py, the module's `PAIRS`) follows its base: a split of the
    output rows splits B [.., out, r] on the same dim, a split of the input columns splits A
    [.., r, in]; the other factor stays whole on every rank, with a partial gradient over tp."""

    def __init__(self, dim: int | dict[str, int]):
        super().__init__()
        self.dims = dim if isinstance(dim, dict) else {"weight": dim}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        pairs: dict[str, tuple[str, str]] = getattr(module, PAIRS, {})
        dims = dict(self.dims)
        for base, dim in self.dims.items():
            if base in pairs:
                out_dim = module.get_parameter(base).dim() - 2
                a_name, b_name = pairs[base]
                dims[b_name if dim == out_dim else a_name] = dim
        _shard_params(module, device_mesh, dims)
        for a_name, b_name in pairs.values():
            for name in (a_name, b_name):
                if name not in dims:
                    setattr(module.get_parameter(name), _PARTIAL, True)
        return module


class ReplicatedPartialGrad(ParallelStyle):
    """Full weights on every tp rank whose gradients are partial sums over tp (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for p in module.parameters():
            setattr(p, _PARTIAL, True)
        return module


class ReplicatedFullGrad(ParallelStyle):
    """Full weights on every tp rank whose gradients are already whole on every rank."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for p in module.parameters():
            setattr(p, _FULL, True)
        return module


def collect_replicated_grads(model: nn.Module, group: dist.ProcessGroup) -> None:
    """After the plan: record the ReplicatedPartialGrad parameters for `reduce_replicated_grads`,
    and check that the plan placed every parameter (sharded, or replicated with a known gradient)."""
    names, unplaced = [], []
    for name, p in model.named_parameters():
        if getattr(p, _PARTIAL, False):
            if p.requires_grad:  # a frozen base has no gradient to sum (LoRA)
                names.append(name)
        elif not isinstance(p, DTensor) and not getattr(p, _FULL, False):
            unplaced.append(name)
    assert not unplaced, f"the TP plan does not place {unplaced}"
    mark_replicated_grads(model, names, group)


def present(model: nn.Module, plan: dict[str, ParallelStyle]) -> dict[str, ParallelStyle]:
    """The entries of `plan` whose module this model holds: a pipeline stage keeps its own layers
    and sets the other stages' top-level modules (embedding, head) to None."""
    names = {name for name, _ in model.named_modules()}
    return {fqn: style for fqn, style in plan.items() if fqn in names}


def valid_degrees(sizes: Iterable[int]) -> list[int]:
    """Degrees that divide every size (the divisors of their gcd)."""
    g = math.gcd(*sizes)
    return [d for d in range(1, g + 1) if g % d == 0]


def validate_tensor_parallel(
    *, degree: int, divides: dict[str, int], tokens_per_cp_rank: int, model: str
) -> None:
    """tp must divide every named model size and the token rows of one CP rank (sequence parallelism
    cuts them into tp equal shares); the message names the numbers and the nearest valid degrees."""
    if degree == 1:
        return
    sizes = {f"model {model} {k}": v for k, v in divides.items()}
    sizes["training.tokens_per_microbatch / context_parallel_degree"] = tokens_per_cp_rank
    bad = {k: v for k, v in sizes.items() if v % degree}
    if not bad:
        return
    ok = valid_degrees(sizes.values())
    below = max(d for d in ok if d < degree)
    above = [d for d in ok if d > degree]
    nearest = f"{below}" + (f" or {above[0]}" if above else "")
    raise ValueError(
        f"parallelism.tensor_parallel_degree = {degree} does not divide "
        + ", ".join(f"{k} = {v}" for k, v in bad.items())
        + f"; the nearest valid degrees are {nearest} (valid: {', '.join(map(str, ok))})"
    )


def mark_replicated_grads(model: nn.Module, names: list[str], group: dist.ProcessGroup) -> None:
    """Record parameters that every tp rank holds in full but uses on different rows (or on its share
    of the heads): each rank's gradient is a partial sum, `reduce_replicated_grads` adds them up."""
    setattr(model, REPLICATED_GRADS, (tuple(names), group))


@torch.no_grad()
def reduce_replicated_grads(model: nn.Module) -> None:
    """Sum the partial gradients of `mark_replicated_grads` parameters over tp (one coalesced
    all-reduce per dtype); a no-op for a model without such parameters."""
    names, group = getattr(model, REPLICATED_GRADS, ((), None))
    if not names:
        return
    params = dict(model.named_parameters())
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for name in names:
        p = params[name]
        if p.grad is None:  # unused on every rank alike (the data-dependent graph is the same on tp peers)
            continue
        g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, group=group)
        for g, part in zip(grads, flat.split([g.numel() for g in grads])):
            g.copy_(part.view_as(g))


def _redistribute(module: nn.Module, placements: dict[str, Shard | Replicate], mesh: DeviceMesh, src) -> None:
    for name, placement in placements.items():
        p = module.get_parameter(name)
        t = distribute_tensor(p.data, mesh, [placement], src_data_rank=src)
        module.register_parameter(name, nn.Parameter(t, requires_grad=p.requires_grad))


class ColwiseWithAdapter(ColwiseParallel):
    """torch's ColwiseParallel whose LoRA adapter (models/projection.py) follows the base: B [out, r] split
    on its output rows with the weight, A [r, in] whole on every rank (torch's style would split every
    parameter of the module on dim 0, A's rank too)."""

    def _partition_linear_fn(self, name, module, device_mesh):
        placements = {n: Replicate() if n == "lora_A" else Shard(0) for n, _ in module.named_parameters()}
        _redistribute(module, placements, device_mesh, self.src_data_rank)


class RowwiseWithAdapter(RowwiseParallel):
    """torch's RowwiseParallel whose LoRA adapter follows the base: A [r, in] split on its input
    columns with the weight, B [out, r] whole on every rank."""

    def _partition_linear_fn(self, name, module, device_mesh):
        super()._partition_linear_fn(name, module, device_mesh)
        if module._parameters.get("lora_A") is not None:
            placements = {"lora_A": Shard(1), "lora_B": Replicate()}
            _redistribute(module, placements, device_mesh, self.src_data_rank)
