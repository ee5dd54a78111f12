"""Sparse single-head-KV attention core with a sink: the kernel of all three DSv4 layer types.

Legend:  T queries   H query heads   D head dim   S rows of the key buffer   K keys per query

Every query attends an explicit list of rows `idx_TK` of one shared K=V buffer `kv_SD` (its window
keys and its selected / visible compressed entries; -1 marks an unused slot) in ONE softmax whose
denominator also holds a per-head sink logit that carries no value (docs/dsv4.md §2):

    p_k = exp(s_k) / (sum_j exp(s_j) + exp(sink_h)),   out = sum_k p_k kv_k,   s_k = scale * q . kv_k

Cost and memory are O(T * K * D), never O(T * S). The autograd function saves only q, kv, idx, the
output and the log-sum-exp, and recomputes the gathered keys chunk by chunk in backward (the flash-
attention trick), so a 16k-token microbatch does not keep [T, K, D] tensors alive.
`dense_reference` computes the same thing through an explicit [T, S] mask, for tests only.
"""

from __future__ import annotations

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _probs(q_nHD, kv_SD, idx_nK, sink_H, scale, lse_nH=None):
    """Gathered keys [n, K, D], probabilities [n, H, K] and lse [n, H] of one query chunk."""
    acc = _acc_dtype(q_nHD.dtype)
    kv_nKD = kv_SD[idx_nK.clamp(min=0)].to(acc)
    logits_nHK = torch.bmm(q_nHD.to(acc), kv_nKD.transpose(1, 2)) * scale
    logits_nHK.masked_fill_((idx_nK < 0)[:, None, :], float("-inf"))
    if lse_nH is None:
        sink_1H = sink_H.to(acc)[None, :]
        max_nH = torch.maximum(logits_nHK.amax(-1), sink_1H)
        denom_nH = torch.exp(logits_nHK - max_nH[..., None]).sum(-1) + torch.exp(sink_1H - max_nH)
        lse_nH = max_nH + denom_nH.log()
    return kv_nKD, torch.exp(logits_nHK - lse_nH[..., None]), lse_nH


class _SparseMQA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, kv_SD, idx_TK, sink_H, scale, chunk):
        T, H, _ = q_THD.shape
        out_THD = torch.empty_like(q_THD)
        lse_TH = torch.empty(T, H, dtype=_acc_dtype(q_THD.dtype), device=q_THD.device)
        for a in range(0, T, chunk):
            kv_nKD, p_nHK, lse_TH[a : a + chunk] = _probs(
                q_THD[a : a + chunk], kv_SD, idx_TK[a : a + chunk], sink_H, scale
            )
            out_THD[a : a + chunk] = torch.bmm(p_nHK, kv_nKD).to(q_THD.dtype)
        ctx.save_for_backward(q_THD, kv_SD, idx_TK, sink_H, out_THD, lse_TH)
        ctx.scale, ctx.chunk = scale, chunk
        ctx.mark_non_differentiable(lse_TH)
        return out_THD, lse_TH

    @staticmethod
    def backward(ctx, dout_THD, _dlse):
        q_THD, kv_SD, idx_TK, sink_H, out_THD, lse_TH = ctx.saved_tensors
        scale, chunk = ctx.scale, ctx.chunk
        acc = lse_TH.dtype
        dq_THD = torch.empty_like(q_THD)
        dkv_SD = torch.zeros(kv_SD.shape, dtype=acc, device=kv_SD.device)
        dsink_H = torch.zeros(sink_H.shape, dtype=acc, device=sink_H.device)
        for a in range(0, q_THD.shape[0], chunk):
            q_nHD, idx_nK, lse_nH = q_THD[a : a + chunk].to(acc), idx_TK[a : a + chunk], lse_TH[a : a + chunk]
            kv_nKD, p_nHK, _ = _probs(q_nHD, kv_SD, idx_nK, sink_H, scale, lse_nH)
            do_nHD = dout_THD[a : a + chunk].to(acc)
            delta_nH = (do_nHD * out_THD[a : a + chunk].to(acc)).sum(-1)
            dlogit_nHK = p_nHK * (torch.bmm(do_nHD, kv_nKD.transpose(1, 2)) - delta_nH[..., None])
            dq_THD[a : a + chunk] = (torch.bmm(dlogit_nHK, kv_nKD) * scale).to(q_THD.dtype)
            # K = V: each gathered row gets its key gradient and its value gradient.
            dkv_nKD = torch.bmm(dlogit_nHK.transpose(1, 2), q_nHD) * scale + torch.bmm(
                p_nHK.transpose(1, 2), do_nHD
            )
            dkv_SD.index_add_(0, idx_nK.clamp(min=0).flatten(), dkv_nKD.flatten(0, 1))
            dsink_H -= (torch.exp(sink_H.to(acc)[None, :] - lse_nH) * delta_nH).sum(0)
        return dq_THD, dkv_SD.to(kv_SD.dtype), None, dsink_H.to(sink_H.dtype), None, None


def sparse_mqa(
    q_THD: torch.Tensor,
    kv_SD: torch.Tensor,
    idx_TK: torch.Tensor,
    sink_H: torch.Tensor,
    scale: float,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_THD, lse_TH): attention of each query over kv rows idx_TK (-1 = unused slot) plus the sink."""
    assert idx_TK.shape[0] == q_THD.shape[0] and idx_TK.shape[1] >= 1, (idx_TK.shape, q_THD.shape)
    return _SparseMQA.apply(q_THD, kv_SD, idx_TK, sink_H, scale, chunk)


def dense_reference(
    q_THD: torch.Tensor, kv_SD: torch.Tensor, allowed_TS: torch.Tensor, sink_H: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same attention through an explicit [T, S] boolean mask (test reference; quadratic)."""
    logits_THS = torch.einsum("thd,sd->ths", q_THD, kv_SD) * scale
    logits_THS = logits_THS.masked_fill(~allowed_TS[:, None, :], float("-inf"))
    sink_TH1 = sink_H.to(logits_THS.dtype)[None, :, None].expand(q_THD.shape[0], -1, 1)
    p_THS = torch.softmax(torch.cat([logits_THS, sink_TH1], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", p_THS, kv_SD)
