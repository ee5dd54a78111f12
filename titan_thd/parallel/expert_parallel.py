"""Expert parallelism for the DSv4 MoE: tokens to their experts' ranks and back (docs/design.md §5.2).

Legend:  E routed experts   ep ranks in the group   L = E / ep experts per rank (rank r holds the
global ids r L .. r L + L - 1)   N routed rows (tokens x k) of this rank

`apply_ep` makes every MoE's stacked experts ([E, out, in], models/dsv4/moe.py) DTensors sharded
over the ep mesh on the expert dimension: each rank keeps its own E / ep experts (the full model is
built from the seed on every rank, so the kept slices hold the values one process would; no data
moves), while names and global shapes stay those of one process, so DCP reshards a checkpoint
across ep degrees. `dispatch_combine` runs one layer's routed experts over the group:

1. the per-expert row counts [E] go through an all-to-all under no_grad: rank r learns how many
   rows each peer sends to each of its L experts ([ep, L]); the split sizes are their row sums;
2. the rows (sorted by global expert id, hence by destination rank) go through an autograd-aware
   `all_to_all_single`; the received rows are peer-major, and a stable sort groups them by local
   expert for one grouped matmul per projection;
3. the outputs are put back in peer-major order and return by the inverse all-to-all; the caller
   weights them and `index_add`s them into its tokens.

Every rank takes part in both all-to-alls (forward and backward) whatever it routes: a rank that
sends no row, or an expert that gets none, is a zero-size chunk or group, never a skipped call.
Router load counts stay with the gate, which sees this rank's own tokens only: summed over the
`loss` mesh (dp x cp, every rank that routed a token) they count each token once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from titan_thd.parallel.recompute import decided_once
from titan_thd.parallel.shards import PAIRS


def local_expert_ids(n_experts: int, ep: int, ep_rank: int) -> range:
    """Global ids of the experts rank `ep_rank` holds (a contiguous block of E / ep)."""
    assert n_experts % ep == 0, (n_experts, ep)
    per_rank = n_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


EXPERT_WEIGHTS = ("w1", "w2", "w3")
"""The stacked parameters of `moe.experts`, each [E, out, in]."""


def apply_ep(moes: list[nn.Module], mesh: DeviceMesh, ep_tp_mesh: DeviceMesh | None = None) -> None:
    """Shard every MoE's experts over the 1-D ep `mesh` (`Shard(0)`: rank r holds
    `local_expert_ids(E, ep, r)`) and route through its group.

    Under tensor parallelism (`ep_tp_mesh`: the 2-D (ep, tp) mesh) the stacks arrive split on their
    hidden columns over tp (the TP plan ran first); they become DTensors on (ep, tp) with
    `[Shard(0), Shard(hidden dim)]`: expert tensor parallelism equal to tp, so the MoE region's
    output stays a partial sum over tp and its reduce-scatter completes it.

    LoRA adapters of the experts (models/projection.py: [E, ...] stacks, one per expert) travel with their
    experts; one that tensor parallelism left whole (A of w1 / w3, B of w2) is `Replicate()` over tp
    and keeps its partial-gradient mark."""
    for moe in moes:
        ids = local_expert_ids(moe.n_experts, mesh.size(), mesh.get_local_rank())
        adapters = {n for pair in getattr(moe.experts, PAIRS, {}).values() for n in pair}
        for name in (*EXPERT_WEIGHTS, *sorted(adapters)):
            p = getattr(moe.experts, name)
            split_by_tp = isinstance(p, DTensor)
            assert p.shape[0] == moe.n_experts and (
                split_by_tp == (ep_tp_mesh is not None) or name in adapters
            )
            placements, out_mesh, data = [Shard(0)], mesh, p.data
            if split_by_tp:  # this tp rank's hidden columns of every expert
                (tp_placement,) = p.placements
                assert isinstance(tp_placement, Shard) and tp_placement.dim != 0, (name, p.placements)
                placements, out_mesh, data = [Shard(0), tp_placement], ep_tp_mesh, p.to_local()
            elif ep_tp_mesh is not None:  # an adapter whole on every tp rank
                placements, out_mesh = [Shard(0), Replicate()], ep_tp_mesh
            # Every rank holds the full stack (built from one seed): keep a copy of the local slice
            # (no scatter; a view would keep the whole stack's storage alive).
            mine = data[ids.start : ids.stop].clone()
            shard = DTensor.from_local(
                mine, out_mesh, placements, run_check=False, shape=p.shape, stride=p.stride()
            )
            param = nn.Parameter(shard, requires_grad=p.requires_grad)
            param.__dict__.update(p.__dict__)  # the tensor-parallel gradient marks
            moe.experts.register_parameter(name, param)
        moe.ep_group = mesh.get_group()


def _is_fake(group: dist.ProcessGroup) -> bool:
    return dist.get_backend(group) == "fake"


def dispatch_combine(
    x_ND: torch.Tensor,
    counts_E: torch.Tensor,
    group: dist.ProcessGroup,
    experts: Callable[[torch.Tensor, list[int]], torch.Tensor],
) -> torch.Tensor:
    """Rows `x_ND` sorted by global expert (counts_E[e] rows for expert e) -> their experts' outputs,
    in the same order. `experts(rows, counts)` runs this rank's L experts on rows grouped by them."""
    ep = dist.get_world_size(group)
    n_experts = counts_E.numel()
    assert n_experts % ep == 0 and int(counts_E.sum()) == x_ND.shape[0], (counts_E, x_ND.shape, ep)
    per_rank = n_experts // ep
    # Decided once: a recomputation (activation_checkpoint) reuses the counts and split sizes.
    recv_PL, send_splits, recv_splits = decided_once(lambda: _splits(counts_E, group, ep, per_rank))
    x_recv = all_to_all_single_autograd(x_ND, recv_splits, send_splits, group)
    # Received rows: peer-major, then local-expert-major. Group them by local expert (stable, so
    # each expert sees its rows peer by peer, as one process would see them by token order).
    local_ids = torch.arange(per_rank, device=x_ND.device).repeat(ep)
    expert_of_row = torch.repeat_interleave(local_ids, recv_PL.flatten())
    order = torch.argsort(expert_of_row, stable=True)
    y = experts(x_recv[order], recv_PL.sum(0).tolist())
    y_back = y[torch.argsort(order)]
    return all_to_all_single_autograd(y_back, send_splits, recv_splits, group)


def _splits(
    counts_E: torch.Tensor, group: dist.ProcessGroup, ep: int, per_rank: int
) -> tuple[torch.Tensor, list[int], list[int]]:
    """(rows each peer sends to each local expert [ep, L], send and receive split sizes): the counts'
    all-to-all. The split sizes must be host integers (one device-to-host sync per layer on a GPU)."""
    with torch.no_grad():
        if _is_fake(group):  # a dry run's collectives return garbage: pretend every peer routes alike
            recv_PL = counts_E.view(ep, per_rank).clone()
        else:
            recv_PL = torch.empty_like(counts_E)
            dist.all_to_all_single(recv_PL, counts_E, group=group)
            recv_PL = recv_PL.view(ep, per_rank)
    return recv_PL, counts_E.view(ep, per_rank).sum(1).tolist(), recv_PL.sum(1).tolist()


def validate_expert_parallel(*, degree: int, n_experts: int, model: str) -> None:
    """ep must split the model's `n_experts` routed experts evenly (0 = none; dp x cp is ParallelDims'
    check)."""
    if degree == 1:
        return
    if n_experts == 0:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {degree}: model {model} has no routed experts; use 1"
        )
    if n_experts % degree:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {degree} does not divide model {model}'s n_experts = "
            f"{n_experts} (every rank holds n_experts / ep experts)"
        )
