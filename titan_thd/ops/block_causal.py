"""Block-diagonal causal attention of one rank's whole documents (no context parallelism).

The kernel behind `varlen_attention` (ops/varlen_attention.py, which dispatches CP modes to their
ops); hybrid CP calls it for the documents it keeps whole. See varlen_attention.py for the legend
and why a loop of SDPA calls over runs of equal-length documents is the fastest exact CPU form.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from titan_thd.data.batch_meta import BatchMeta


class _Segment(NamedTuple):
    """`count` adjacent documents, each with `real` real rows followed by `padded - real` pad rows."""

    count: int
    real: int
    padded: int


def _segments(meta: BatchMeta) -> list[_Segment]:
    segments: list[_Segment] = []
    for real, padded in zip(meta.seqlens, meta.seqlens_padded):
        if segments and segments[-1].real == real and segments[-1].padded == padded:
            segments[-1] = segments[-1]._replace(count=segments[-1].count + 1)
        else:
            segments.append(_Segment(1, real, padded))
    return segments


def block_causal_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    meta: BatchMeta,
    scale: float | None = None,
) -> torch.Tensor:
    """Each document of `meta` attends causally to itself; out_THD, zeros on padding rows."""
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    assert T == meta.total_tokens, (T, meta.total_tokens)
    assert k_TKD.shape == v_TKD.shape == (T, K, D) and H % K == 0, (q_THD.shape, k_TKD.shape, v_TKD.shape)
    segments = meta.cached("varlen_attention_segments", lambda: _segments(meta))
    sizes = [s.count * s.padded for s in segments]
    outs = []
    for seg, q, k, v in zip(segments, q_THD.split(sizes), k_TKD.split(sizes), v_TKD.split(sizes)):
        if seg.real == 0:
            outs.append(q.new_zeros(q.shape))
            continue
        # [B*P, H, D] -> [B, H, L, D] as a strided view; SDPA takes strided inputs.
        q_BHLD, k_BKLD, v_BKLD = (
            x.unflatten(0, (seg.count, seg.padded))[:, : seg.real].transpose(1, 2) for x in (q, k, v)
        )
        o_BLHD = F.scaled_dot_product_attention(
            q_BHLD, k_BKLD, v_BKLD, is_causal=True, scale=scale, enable_gqa=K != H
        ).transpose(1, 2)
        if seg.padded > seg.real:
            pad = o_BLHD.new_zeros(seg.count, seg.padded - seg.real, H, D)
            o_BLHD = torch.cat([o_BLHD, pad], dim=1)
        outs.append(o_BLHD.reshape(seg.count * seg.padded, H, D))
    return torch.cat(outs)
