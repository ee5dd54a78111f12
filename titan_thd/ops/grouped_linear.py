"""Grouped linear: rows grouped by expert, each group times its own expert's weight (docs/dsv4.md §6).

Legend:  N rows (sorted by group)   G groups   I in-features   O out-features   counts[g] rows of group g

`grouped_linear(h_NI, counts, w_GOI)` = rows [sum(counts[:g]), sum(counts[:g+1])) of `h_NI` times
`w_GOI[g]^T` (as `F.linear`), as one grouped matrix product on the stacked weight itself: the
grouped kernel reads `w_GOI` through a transposed view, so no weight is copied (the experts are
stored stacked, `models/dsv4/moe.py`).

Why an autograd function of its own: the forward saves the rows and a reference to the weight
(nothing of the weight's size), the backward computes the input gradient with the same kernel and
the weight gradient as one grouped product [G, O, I]; and float64 (the parity runs), which
`F.grouped_mm` does not take, runs the same per-row dot products as one batched matmul over the
groups padded to the largest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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


def _kernel_takes(*widths_and_dtype) -> bool:
    """Whether F.grouped_mm takes these operands: its dtypes, and rows of a multiple of 16 bytes (a
    LoRA adapter of rank 2 in float32 is 8 bytes wide: the padded batched product runs it instead)."""
    *widths, dtype = widths_and_dtype
    return dtype in _GROUPED_DTYPES and all(w * dtype.itemsize % 16 == 0 for w in widths)


def grouped_mm(h_NI: torch.Tensor, w_GIO: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """[N, I] rows grouped by `counts` times their group's [I, O] matrix -> [N, O]."""
    if _kernel_takes(h_NI.shape[1], w_GIO.shape[2], h_NI.dtype):
        return F.grouped_mm(h_NI, w_GIO, offs=_offsets(counts, h_NI.device))
    slot, width = _padded_slots(counts, h_NI.device)
    out = torch.bmm(_padded(h_NI, slot, len(counts), width), w_GIO)
    return out.view(len(counts) * width, -1)[slot]


def grouped_weight_grad(g_NO: torch.Tensor, h_NI: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Per group g: g_g^T h_g, the [O, I] gradient of its weight -> [G, O, I]."""
    if _kernel_takes(h_NI.shape[1], g_NO.shape[1], h_NI.dtype):
        return F.grouped_mm(g_NO.t(), h_NI, offs=_offsets(counts, h_NI.device))
    slot, width = _padded_slots(counts, h_NI.device)
    g, h = _padded(g_NO, slot, len(counts), width), _padded(h_NI, slot, len(counts), width)
    return torch.bmm(g.transpose(1, 2), h)


class _GroupedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NI: torch.Tensor, counts: list[int], w_GOI: torch.Tensor) -> torch.Tensor:
        ctx.counts = counts
        ctx.save_for_backward(h_NI, w_GOI)
        return grouped_mm(h_NI, w_GOI.transpose(1, 2), counts)

    @staticmethod
    def backward(ctx, g_NO: torch.Tensor):
        h_NI, w_GOI = ctx.saved_tensors
        g_NO = g_NO.contiguous()
        grad_h = grouped_mm(g_NO, w_GOI, ctx.counts) if ctx.needs_input_grad[0] else None
        grad_w = grouped_weight_grad(g_NO, h_NI, ctx.counts) if ctx.needs_input_grad[2] else None
        return grad_h, None, grad_w


def grouped_linear(h_NI: torch.Tensor, counts: list[int], w_GOI: torch.Tensor) -> torch.Tensor:
    """Rows of `h_NI` grouped by `counts`, group g times w_GOI[g]^T (as `F.linear`) -> [N, O]."""
    assert w_GOI.dim() == 3 and len(counts) == w_GOI.shape[0], (counts, w_GOI.shape)
    assert sum(counts) == h_NI.shape[0], (counts, h_NI.shape)
    return _GroupedLinear.apply(h_NI, counts, w_GOI)
