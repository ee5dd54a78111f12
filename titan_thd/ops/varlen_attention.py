"""Causal attention over a packed THD microbatch, in native PyTorch.

Legend:
    T  rows of the microbatch          H  query heads        K  key/value heads (K divides H)
    D  head dim                        B  documents in one SDPA call
    L  real length of a document       P  physical (padded) length of a document

Each document attends causally to itself only. On CPU the fastest exact way is a Python loop of
`scaled_dot_product_attention(is_causal=True)` over the documents (docs/cpu.md §5:
5x faster than a dense block-diagonal mask or padding); `varlen_attn` is CUDA-only and
flex_attention has no CPU backward. Two details keep the loop cheap:
- inputs are cut with one `split` (its backward is one `cat`), not one slice per document (each
  slice's backward would allocate a full [T, H, D] gradient);
- a run of adjacent documents with equal real and padded lengths is one batched SDPA call on a
  free [B, P, H, D] view (many short documents of one length are common in synthetic and SFT data).
Padding rows (per-document alignment and the tail padding document) produce zeros.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.data.batch_meta import BatchMeta
from titan_thd.ops.block_causal import block_causal_attention
from titan_thd.ops.cp_attention import zigzag_attention
from titan_thd.ops.hybrid_cp_attention import hybrid_attention


def varlen_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    meta: BatchMeta,
    scale: float | None = None,
) -> torch.Tensor:
    """Block-diagonal causal attention of the documents in `meta`; returns out_THD (zeros on padding).

    Under context parallelism (`meta.cp.size > 1`) the rows are this rank's zigzag share and the
    work goes to `zigzag_attention` (hybrid mode: `hybrid_attention`).

    K < H is grouped-query attention: query head h reads key/value head h // (H // K).
    """
    if meta.cp.enabled and meta.cp.mode == "hybrid":  # zigzag chunks of long documents, short ones whole
        return hybrid_attention(q_THD, k_TKD, v_TKD, meta, scale)
    if meta.cp.enabled:  # this rank holds zigzag chunks: its queries need other ranks' keys
        return zigzag_attention(q_THD, k_TKD, v_TKD, meta, scale)
    return block_causal_attention(q_THD, k_TKD, v_TKD, meta, scale)


class VarlenAttention(nn.Module):
    """`varlen_attention` as a module: the `inner_attention` of a model, swappable per backend."""

    def forward(
        self, q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor, meta: BatchMeta
    ) -> torch.Tensor:
        return varlen_attention(q_THD, k_TKD, v_TKD, meta)


def dense_reference_attention(
    q_THD: torch.Tensor,
    k_TKD: torch.Tensor,
    v_TKD: torch.Tensor,
    meta: BatchMeta,
    scale: float | None = None,
) -> torch.Tensor:
    """Test oracle: explicit softmax under a dense [T, T] block-diagonal causal mask (O(T^2) memory)."""
    T, H, D = q_THD.shape
    K = k_TKD.shape[1]
    lens = torch.tensor(meta.seqlens)
    plens = torch.tensor(meta.seqlens_padded)
    doc_T = torch.repeat_interleave(torch.arange(len(plens)), plens)
    offset_T = torch.arange(T) - (torch.cumsum(plens, 0) - plens)[doc_T]
    real_T = offset_T < lens[doc_T]
    allowed_TT = (doc_T[:, None] == doc_T[None, :]) & (offset_T[:, None] >= offset_T[None, :])
    allowed_TT &= real_T[:, None] & real_T[None, :]
    k_THD = k_TKD.repeat_interleave(H // K, dim=1)
    v_THD = v_TKD.repeat_interleave(H // K, dim=1)
    scores_HTT = torch.einsum("qhd,khd->hqk", q_THD, k_THD) * (D**-0.5 if scale is None else scale)
    scores_HTT = scores_HTT.masked_fill(~allowed_TT.to(q_THD.device), float("-inf"))
    # Padding rows see no key at all (softmax of all -inf is NaN): their output is defined as zero.
    probs_HTT = torch.where(real_T.to(q_THD.device)[:, None], torch.softmax(scores_HTT, dim=-1), 0.0)
    return torch.einsum("hqk,khd->qhd", probs_HTT, v_THD)
