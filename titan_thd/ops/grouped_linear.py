"""Grouped linear: rows grouped by expert, each group times its own expert's weight (docs/dsv4.md §6).

Legend:  N rows (sorted by group)   G groups   I in-features   O out-features   counts[g] rows of group g

`grouped_linear(h_NI, counts, weights)` = rows [sum(counts[:g]), sum(counts[:g+1])) of `h_NI` times
`weights[g]^T` ([O, I] each, like `F.linear`), as one grouped matrix product.

Why an autograd function of its own: the grouped kernel takes the weights stacked to [G, I, O], and
autograd through `torch.stack` would save that stacked copy for the backward: per layer, every local
expert's weights again, alive from the forward to the backward of every in-flight microbatch (under
FSDP, exactly the memory that freeing the gathered experts after the forward saves). Here the forward
saves only the rows and references to the weights; the backward stacks them again (a transient copy)
and returns each expert's gradient as a slice of one grouped weight-gradient product.

`F.grouped_mm` takes float32 / bfloat16 / float16; float64 (the parity runs) goes through one batched
matmul over the groups padded to the largest: the same per-row dot products.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _stacked(weights_OI: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """The weights as one [G, O, I] tensor. On a CPU into a buffer kept per shape: a fresh
    allocation of this size comes from the OS page by page (at Flash widths the page faults cost
    more than the grouped product), and every layer stacks the same shape. The buffer is only
    read by the product that follows, so one per shape serves all layers, forward and backward.
    GPU allocators reuse blocks themselves."""
    w = weights_OI[0]
    shape = (len(weights_OI), *w.shape)
    if w.device.type != "cpu":
        return torch.stack(weights_OI)
    key = (shape, w.dtype)
    if key not in _WORKSPACE:
        _WORKSPACE[key] = torch.empty(shape, dtype=w.dtype)
    return torch.stack(weights_OI, out=_WORKSPACE[key])


def _offsets(counts: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def _padded_slots(counts: list[int], device: torch.device) -> tuple[torch.Tensor, int]:
    """Row r of group g -> slot g * width + (r - start of g) in a [G * width] padded layout."""
    width = max(counts)
    sizes = torch.tensor(counts, device=device)
    group = torch.repeat_interleave(torch.arange(len(counts), device=device), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    return group * width + torch.arange(int(sizes.sum()), device=device) - starts[group], width


def _padded(x_NC: torch.Tensor, slot: torch.Tensor, groups: int, width: int) -> torch.Tensor:
    out = x_NC.new_zeros(groups * width, x_NC.shape[1]).index_copy(0, slot, x_NC)
    return out.view(groups, width, -1)


def grouped_mm(h_NI: torch.Tensor, w_GIO: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[N, I] rows grouped by `counts` times their group's [I, O] matrix -> [N, O]."""
    if h_NI.dtype in _GROUPED_DTYPES:
        return F.grouped_mm(h_NI, w_GIO, offs=_offsets(counts, h_NI.device))
    slot, width = _padded_slots(counts, h_NI.device)
    out = torch.bmm(_padded(h_NI, slot, len(counts), width), w_GIO)
    return out.view(len(counts) * width, -1)[slot]


def grouped_weight_grad(g_NO: torch.Tensor, h_NI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per group g: g_g^T h_g, the [O, I] gradient of its weight -> [G, O, I]."""
    if h_NI.dtype in _GROUPED_DTYPES:
        return F.grouped_mm(g_NO.t(), h_NI, offs=_offsets(counts, h_NI.device))
    slot, width = _padded_slots(counts, h_NI.device)
    g, h = _padded(g_NO, slot, len(counts), width), _padded(h_NI, slot, len(counts), width)
    return torch.bmm(g.transpose(1, 2), h)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NI: torch.Tensor, counts: list[int], *weights_OI: torch.Tensor) -> torch.Tensor:
        ctx.counts = counts
        ctx.save_for_backward(h_NI, *weights_OI)  # references: no stacked copy stays alive
        return grouped_mm(h_NI, _stacked(weights_OI).transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, g_NO: torch.Tensor):
        h_NI, *weights_OI = ctx.saved_tensors
        g_NO = g_NO.contiguous()
        grad_h = grouped_mm(g_NO, _stacked(weights_OI), ctx.counts) if ctx.needs_input_grad[0] else None
        grad_w = grouped_weight_grad(g_NO, h_NI, ctx.counts)
        return grad_h, None, *grad_w.unbind(0)


def grouped_linear(h_NI: torch.Tensor, counts: list[int], weights_OI: list[torch.Tensor]) -> torch.Tensor:
    """Rows of `h_NI` grouped by `counts`, group g times weights_OI[g]^T (as `F.linear`) -> [N, O]."""
    assert len(counts) == len(weights_OI) and sum(counts) == h_NI.shape[0], (counts, h_NI.shape)
    return _GroupedLinear.apply(h_NI, counts, *weights_OI)
