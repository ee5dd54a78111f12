"""Manifold-constrained hyper-connections (mHC, docs/dsv4.md §5, pitfall 1).

Legend:  T rows   N streams (hc_mult)   d model width

The residual is N streams per token, h [T, N, d]. Before each sub-layer a small projection of the
RMS-normalised flattened streams gives
    pre  [T, N]     = sigmoid(.) + eps            collapses the streams into the sub-layer input,
    post [T, N]     = 2 sigmoid(.)                spreads the sub-layer output over the streams,
    comb [T, N, N]  = Sinkhorn(softmax_row(.))    mixes the streams (approximately doubly stochastic),
and the update is  h'_k = post_k * f(x) + sum_j comb[j, k] * h_j  — comb applied TRANSPOSED.
The final `HyperHead` collapses the streams with its own sigmoid weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def sinkhorn(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (the first row normalisation), then alternate column / row normalisations.

    `iters` counts column normalisations; the result's columns sum to ~1 exactly after the last
    step and its rows to ~1 after convergence.
    """
    comb = torch.softmax(logits_TNN, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


class HyperConnection(nn.Module):
    def __init__(self, n: int, dim: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * dim))
        """Dynamic projection of the flattened streams to the pre / post / comb logits."""
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, h_TND: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(x_TD sub-layer input, post_TN, comb_TNN)."""
        n = self.n
        pre_TN, post_TN, comb_TM = _mix(h_TND, self.fn, self.norm_eps).split([n, n, n * n], dim=-1)
        b_pre, b_post, b_comb = self.base.split([n, n, n * n])
        pre_TN = torch.sigmoid(pre_TN * self.scale[0] + b_pre) + self.hc_eps
        post_TN = 2 * torch.sigmoid(post_TN * self.scale[1] + b_post)
        comb_TNN = sinkhorn((comb_TM * self.scale[2] + b_comb).view(-1, n, n), self.iters, self.hc_eps)
        return _collapse(pre_TN, h_TND), post_TN.to(h_TND.dtype), comb_TNN.to(h_TND.dtype)


def _mix(h_TND: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(flatten(h)) @ fn^T, as (flatten(h) @ fn^T) * rsqrt(mean(h^2) + eps): the same
    value without materialising the normalised [T, N*d] copy."""
    flat = h_TND.flatten(1).to(torch.promote_types(h_TND.dtype, torch.float32))
    return F.linear(flat, fn.to(flat.dtype)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


def _collapse(pre_TN: torch.Tensor, h_TND: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j h_j -> [T, d]."""
    return torch.bmm(pre_TN.to(h_TND.dtype)[:, None, :], h_TND)[:, 0]


def hc_post(
    y_TD: torch.Tensor, h_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor
) -> torch.Tensor:
    """New streams: post_k * y + sum_j comb[j, k] h_j."""
    return post_TN[..., None] * y_TD[:, None, :] + torch.einsum("tjk,tjd->tkd", comb_TNN, h_TND)


class HyperHead(nn.Module):
    def __init__(self, n: int, dim: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * dim))
        self.base = nn.Parameter(torch.zeros(n))
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, h_TND: torch.Tensor) -> torch.Tensor:
        pre_TN = torch.sigmoid(_mix(h_TND, self.fn, self.norm_eps) * self.scale + self.base) + self.hc_eps
        return _collapse(pre_TN, h_TND)
