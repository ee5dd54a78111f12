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

from titan_thd.models.dsv4.norm import inverse_rms


def sinkhorn(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Row softmax (the first row normalisation), then alternate column / row normalisations.

    `iters` counts column normalisations; the result's columns sum to ~1 exactly after the last
    step and its rows to ~1 after convergence. Same values as `sinkhorn_reference`; the backward
    is written out (one custom autograd node instead of ~8 per iteration) and recomputes the
    iterates instead of keeping them (docs/dsv4.md §16).
    """
    # Iterate in [N, N, T] layout: the reductions over the tiny N axes become adds of contiguous
    # T-vectors (several times faster than reducing size-4 inner axes). The result is handed back
    # contiguous in [T, N, N]: hc_post's per-token bmm would otherwise clone the strided view in its
    # forward and again in its backward (fwd+bwd of hc_post 1.8x faster at d=256, T=1924, 1 thread).
    logits_NNT = logits_TNN.permute(1, 2, 0).contiguous()
    return _Sinkhorn.apply(logits_NNT, iters, eps).permute(2, 0, 1).contiguous()


def sinkhorn_reference(logits_TNN: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """`sinkhorn` in plain autograd ops (test reference)."""
    comb = torch.softmax(logits_TNN, dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


def _normalisations(z: torch.Tensor, iters: int, eps: float, record: list | None) -> torch.Tensor:
    """Column, then (row, column) x (iters - 1) normalisations of z [N, N, T]; `record` collects
    (output, denominator, dim) of every step for the backward (z is then not overwritten)."""
    for dim in [0] + [1, 0] * (iters - 1):
        den = z.sum(dim, keepdim=True).add_(eps)
        if record is None:
            z = z.div_(den)
        else:
            z = z / den
            record.append((z, den, dim))
    return z


class _Sinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_NNT, iters, eps):
        soft_NNT = torch.softmax(logits_NNT, dim=1)
        ctx.save_for_backward(soft_NNT)
        ctx.iters, ctx.eps = iters, eps
        return _normalisations(soft_NNT + eps, iters, eps, None)

    @staticmethod
    def backward(ctx, grad_NNT):
        (soft_NNT,) = ctx.saved_tensors
        steps: list = []
        _normalisations(soft_NNT + ctx.eps, ctx.iters, ctx.eps, steps)
        g = grad_NNT.contiguous()
        for y, den, dim in reversed(steps):
            # y = z / (sum_dim z + eps):  dz = (dy - sum_dim(dy * y)) / den
            g = (g - (g * y).sum(dim, keepdim=True)).div_(den)
        return soft_NNT * (g - (g * soft_NNT).sum(1, keepdim=True)), None, None


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
    value without materialising the normalised [T, N*d] copy; backward written out (`_Mix`)."""
    flat_TC = h_TND.flatten(1).to(torch.promote_types(h_TND.dtype, torch.float32))
    return _Mix.apply(flat_TC, fn.to(flat_TC.dtype), eps)


def mix_formula(h_TND: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """`_mix` in plain autograd ops (test reference)."""
    flat = h_TND.flatten(1).to(torch.promote_types(h_TND.dtype, torch.float32))
    return F.linear(flat, fn.to(flat.dtype)) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + eps)


class _Mix(torch.autograd.Function):
    """out = (x fn^T) r, r = rsqrt(mean(x^2) + eps) per row, C = N*d. Saves x, the [T, M] raw
    logits and r; the backward is two matrix products and one pass over x:
        dfn = (g r)^T x,   dx = (g r) fn - x r^3 sum(g raw) / C
    (autograd through the formula keeps x^2 too and runs the square's backward as a pow:
    2x slower per hyper-connection at tiny; docs/dsv4.md §16)."""

    @staticmethod
    def forward(ctx, x_TC, fn_MC, eps):
        raw_TM = F.linear(x_TC, fn_MC)
        r_T1 = inverse_rms(x_TC, eps)
        ctx.save_for_backward(x_TC, fn_MC, raw_TM, r_T1)
        return raw_TM * r_T1

    @staticmethod
    def backward(ctx, g_TM):
        x_TC, fn_MC, raw_TM, r_T1 = ctx.saved_tensors
        g_raw_TM = g_TM * r_T1
        grad_fn = g_raw_TM.t() @ x_TC if ctx.needs_input_grad[1] else None
        if not ctx.needs_input_grad[0]:
            return None, grad_fn, None
        c_T1 = (g_TM * raw_TM).sum(-1, keepdim=True).mul_(r_T1.pow(3)).div_(-x_TC.shape[-1])
        # mm then one in-place pass over x: addmm would first build x c and copy it into its output.
        return torch.mm(g_raw_TM, fn_MC).addcmul_(x_TC, c_T1), grad_fn, None


def _collapse(pre_TN: torch.Tensor, h_TND: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j h_j -> [T, d]."""
    return torch.bmm(pre_TN.to(h_TND.dtype)[:, None, :], h_TND)[:, 0]


def hc_post(
    y_TD: torch.Tensor, h_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor
) -> torch.Tensor:
    """New streams: post_k * y + sum_j comb[j, k] h_j (backward written out: `_Post`)."""
    return _Post.apply(y_TD, h_TND, post_TN, comb_TNN)


def hc_post_formula(
    y_TD: torch.Tensor, h_TND: torch.Tensor, post_TN: torch.Tensor, comb_TNN: torch.Tensor
) -> torch.Tensor:
    """`hc_post` in plain autograd ops (test reference, and what `training.compile` fuses)."""
    return post_TN[..., None] * y_TD[:, None, :] + torch.einsum("tjk,tjd->tkd", comb_TNN, h_TND)


class _Post(torch.autograd.Function):
    """out = comb^T h + post y per token, the product accumulated into in place. The backward is
    four per-token products of the [T, N, d] gradient g, read once each:
        dh = comb g,   dcomb = h g^T,   dpost = g y,   dy = post^T g
    Autograd through the formula materialises post * y, the product and their sum as separate
    [T, N, d] tensors and reduces the multiply's gradients in two more passes: 1.4x slower forward
    + backward at d = 1,024, T = 4,096 (docs/results.md §17.2)."""

    @staticmethod
    def forward(ctx, y_TD, h_TND, post_TN, comb_TNN):
        ctx.save_for_backward(y_TD, h_TND, post_TN, comb_TNN)
        out_TND = torch.bmm(comb_TNN.transpose(1, 2), h_TND)
        return out_TND.addcmul_(post_TN[..., None], y_TD[:, None, :])

    @staticmethod
    def backward(ctx, g_TND):
        y_TD, h_TND, post_TN, comb_TNN = ctx.saved_tensors
        g_TND = g_TND.contiguous()
        y_TD, post_TN = y_TD.to(g_TND.dtype), post_TN.to(g_TND.dtype)  # y may be the sub-layer's bf16
        need_y, need_h, need_post, need_comb = ctx.needs_input_grad
        return (
            torch.bmm(post_TN[:, None, :], g_TND)[:, 0] if need_y else None,
            torch.bmm(comb_TNN, g_TND) if need_h else None,
            torch.bmm(g_TND, y_TD[:, :, None])[..., 0] if need_post else None,
            torch.bmm(h_TND, g_TND.transpose(1, 2)) if need_comb else None,
        )


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
