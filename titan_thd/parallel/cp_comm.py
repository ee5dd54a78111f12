"""Autograd-aware context-parallel collectives over a CP process group.

Both are used inside the model's forward pass, so their backward passes are the adjoint
communication (the gradient of a gathered row flows back to the rank that owns the row):

    all_gather_rows(x_RD, group)      [R, ...] on every rank -> [cp * R, ...] (rank-major)
        backward: reduce-scatter (sum) of the gathered gradient back to the owners.
    left_halo(x_RD, rows, group)      the last `rows` rows of rank r-1 (zeros on rank 0)
        backward: the halo's gradient is sent back to rank r-1 and added to its rows.

Every rank must call them with the same shapes (gloo aborts on a size mismatch), so callers pad
to a fixed capacity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        world = dist.get_world_size(group)
        out = x.new_empty((world * x.shape[0], *x.shape[1:]))
        dist.all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad_in = grad_out.new_empty((grad_out.shape[0] // world, *grad_out.shape[1:]))
        dist.reduce_scatter_single(grad_in, grad_out.contiguous(), op=dist.ReduceOp.SUM, group=ctx.group)
        return grad_in, None


def all_gather_rows(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Concatenate every CP rank's `x` along dim 0 in rank order; differentiable."""
    return _AllGatherRows.apply(x, group)


def _shift_right(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `x` to the next rank, receive the previous rank's (zeros on rank 0)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.zeros_like(x)
    ops = []
    if rank + 1 < world:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, rank + 1), group))
    if rank > 0:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, rank - 1), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv


def _shift_left(x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `x` to the previous rank, receive the next rank's (zeros on the last rank)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    recv = torch.zeros_like(x)
    ops = []
    if rank > 0:
        ops.append(dist.P2POp(dist.isend, x.contiguous(), dist.get_global_rank(group, rank - 1), group))
    if rank + 1 < world:
        ops.append(dist.P2POp(dist.irecv, recv, dist.get_global_rank(group, rank + 1), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    return recv


class _LeftHalo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        assert 0 < rows <= x.shape[0], (rows, x.shape)
        ctx.group, ctx.rows, ctx.n = group, rows, x.shape[0]
        return _shift_right(x[-rows:], group)

    @staticmethod
    def backward(ctx, grad_halo: torch.Tensor):
        grad_tail = _shift_left(grad_halo, ctx.group)
        grad_x = grad_tail.new_zeros((ctx.n, *grad_tail.shape[1:]))
        grad_x[-ctx.rows :] = grad_tail
        return grad_x, None, None


def left_halo(x: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
    """The last `rows` rows of the previous CP rank's `x` (zeros on rank 0); differentiable."""
    return _LeftHalo.apply(x, rows, group)
