"""RMSNorm with and without a weight, computed in at least float32 (DSv4 keeps norms in fp32)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, in float32 (or float64 for float64 inputs)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


def weighted_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x), back in x's dtype."""
    return (weight * rms_norm(x, eps)).to(x.dtype)


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
