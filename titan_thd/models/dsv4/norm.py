"""RMSNorm with and without a weight, computed in at least float32 (DSv4 keeps norms in fp32)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Weightless RMSNorm over the last dim, in float32 (or float64 for float64 inputs)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.weight * rms_norm(x, self.eps)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
