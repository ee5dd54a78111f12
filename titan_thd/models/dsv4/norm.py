"""RMSNorm with and without a weight, computed in at least float32 (DSv4 keeps norms in fp32).

Legend:  x [..., C]: the normalised axis is the last one   r [..., 1] = rsqrt(mean(x^2) + eps)

The eager norms run through one autograd function with the backward written out,
    dx = r (g' - x r^2 mean(g' x)),   g' = g w,   dw = sum over rows of g x r,
saving only x and r: autograd through the formula keeps x^2, the mean and the product as well and
runs ~8 memory-bound passes in the backward (2-3x slower at tiny widths, measured with
benchmarks/bench_dsv4_vs_hf.py; docs/dsv4.md §16). The `*_formula` versions are the same values in plain ops: the test reference, and
what training.compile compiles (inductor fuses the formula itself).
"""

from __future__ import annotations

import torch
from torch import nn


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.promote_types(x.dtype, torch.float32))


def rms_norm_formula(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in plain autograd ops."""
    xf = _acc(x)
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def weighted_rms_norm_formula(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weighted_rms_norm` in plain autograd ops."""
    return (weight * rms_norm_formula(x, eps)).to(x.dtype)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """r = rsqrt(mean(x^2) + eps) over the last dim, [..., 1] (a norm kernel: one pass, no x^2 copy)."""
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    return n.square_().div_(x.shape[-1]).add_(eps).rsqrt_()


def rms_backward(g: torch.Tensor, x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Gradient at x of y = x r (r = inverse_rms(x)) for the output gradient g."""
    m = (g * x).sum(-1, keepdim=True).mul_(r.square()).div_(-x.shape[-1])
    return torch.addcmul(g, x, m).mul_(r)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        r = inverse_rms(x, eps)
        ctx.save_for_backward(x, weight, r)
        y = x * r
        return y if weight is None else y * weight

    @staticmethod
    def backward(ctx, g):
        x, weight, r = ctx.saved_tensors
        grad_w = None
        if weight is not None:
            if ctx.needs_input_grad[1]:
                grad_w = (g * x * r).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
            g = g * weight
        return rms_backward(g, x, r) if ctx.needs_input_grad[0] else None, grad_w, None


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, in float32 (or float64 for float64 inputs)."""
    return _RMSNorm.apply(_acc(x), None, eps)


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x), back in x's dtype."""
    return _RMSNorm.apply(_acc(x), weight, eps).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.fn = weighted_rms_norm
        """`apply_compile` swaps in its compiled form (titan_thd/models/compile.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A view, not the Parameter: torch.compile keeps parameter shapes static, which would
        # compile one graph per norm width (dim, q_lora_rank, head_dim, ...) instead of one.
        return self.fn(x, self.weight.view(-1), self.eps)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
