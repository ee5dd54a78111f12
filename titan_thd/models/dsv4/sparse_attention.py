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

from dataclasses import dataclass

import torch


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@dataclass
class Band:
    """Keys shared by a block of `block` consecutive queries: block b reads the rows `rows_NL[b]`
    of the key buffer (a contiguous run: its queries' windows, and for HCA the visible entries of
    its documents), each query only those its `ok_TL` row allows. One [block*H, D] x [D, L] matmul
    per block replaces per-query gathers of [K, D] key copies (docs/dsv4.md §16)."""

    block: int
    rows_NL: torch.Tensor
    """[N, L] key-buffer row of every key slot of each query block (clamped into the buffer)."""
    ok_TL: torch.Tensor
    """[N * block, L] bool: the query may use the slot (rows past T: padding queries, all False)."""

    def as_index(self, T: int) -> torch.Tensor:
        """[T, L] the same keys as an explicit per-query row list (-1 = unused slot); tests only."""
        rows_TL = self.rows_NL.repeat_interleave(self.block, dim=0)[:T]
        return torch.where(self.ok_TL[:T], rows_TL, -1)


def _probs(q_nHD, kv_SD, band, rows_bL, ok_nL, idx_nK, sink_H, scale, lse_nH=None):
    """Keys, probabilities and lse [n, H] of one query chunk: the band part ([b, L, D] keys,
    [n, H, L] probabilities) and the gathered part ([n, K, D], [n, H, K]), each None if absent."""
    acc = _acc_dtype(q_nHD.dtype)
    n, H, D = q_nHD.shape
    q_nHD = q_nHD.to(acc)
    parts = []
    if band:
        kv_bLD = kv_SD[rows_bL].to(acc)
        logits = torch.bmm(q_nHD.reshape(-1, band * H, D), kv_bLD.transpose(1, 2)).view(n, H, -1)
        parts.append((kv_bLD, logits.mul_(scale).masked_fill_(~ok_nL[:, None, :], float("-inf"))))
    if idx_nK is not None:
        kv_nKD = kv_SD[idx_nK.clamp(min=0)].to(acc)
        logits = torch.bmm(q_nHD, kv_nKD.transpose(1, 2))
        parts.append((kv_nKD, logits.mul_(scale).masked_fill_((idx_nK < 0)[:, None, :], float("-inf"))))
    if lse_nH is None:
        sink_1H = sink_H.to(acc)[None, :]
        max_nH = sink_1H.expand(n, H)
        for _, logits in parts:
            max_nH = torch.maximum(max_nH, logits.amax(-1))
        denom_nH = torch.exp(sink_1H - max_nH)
        for _, logits in parts:
            denom_nH = denom_nH + torch.exp(logits - max_nH[..., None]).sum(-1)
        lse_nH = max_nH + denom_nH.log()
    probs = [(kv, logits.sub_(lse_nH[..., None]).exp_()) for kv, logits in parts]
    if not band:
        probs.insert(0, (None, None))
    elif idx_nK is None:
        probs.append((None, None))
    return probs, lse_nH


class _SparseMQA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_THD, kv_SD, idx_TK, sink_H, scale, chunk, band_rows_NL, band_ok_TL, block):
        T, H, D = q_THD.shape
        # Chunks hold whole query blocks; queries past T (up to a whole block) are padding.
        chunk = -(-chunk // block) * block if block else chunk
        Tp = band_ok_TL.shape[0] if block else T
        q_pHD = torch.cat([q_THD, q_THD.new_zeros(Tp - T, H, D)]) if Tp > T else q_THD
        if idx_TK is not None and Tp > T:
            idx_TK = torch.cat([idx_TK, idx_TK.new_full((Tp - T, idx_TK.shape[1]), -1)])
        out_pHD = torch.empty_like(q_pHD)
        lse_pH = torch.empty(Tp, H, dtype=_acc_dtype(q_THD.dtype), device=q_THD.device)
        for a in range(0, Tp, chunk):
            rows = slice(a, a + chunk)
            ((band_kv, band_p), (g_kv, g_p)), lse_pH[rows] = _probs(
                q_pHD[rows],
                kv_SD,
                block,
                band_rows_NL[a // block : (a + chunk) // block] if block else None,
                band_ok_TL[rows] if block else None,
                None if idx_TK is None else idx_TK[rows],
                sink_H,
                scale,
            )
            n = out_pHD[rows].shape[0]
            o = None
            if band_p is not None:
                o = torch.bmm(band_p.view(-1, block * H, band_p.shape[-1]), band_kv).view(n, H, D)
            if g_p is not None:
                o = torch.bmm(g_p, g_kv) if o is None else o.baddbmm_(g_p, g_kv)
            out_pHD[rows] = o
        ctx.save_for_backward(q_pHD, kv_SD, idx_TK, sink_H, out_pHD, lse_pH, band_rows_NL, band_ok_TL)
        ctx.scale, ctx.chunk, ctx.block, ctx.T = scale, chunk, block, T
        out_THD, lse_TH = out_pHD[:T], lse_pH[:T]
        ctx.mark_non_differentiable(lse_TH)
        return out_THD, lse_TH

    @staticmethod
    def backward(ctx, dout_THD, _dlse):
        q_pHD, kv_SD, idx_TK, sink_H, out_pHD, lse_pH, band_rows_NL, band_ok_TL = ctx.saved_tensors
        scale, chunk, block, T = ctx.scale, ctx.chunk, ctx.block, ctx.T
        acc = lse_pH.dtype
        Tp, H, D = q_pHD.shape
        if Tp > T:
            dout_THD = torch.cat([dout_THD, dout_THD.new_zeros(Tp - T, H, D)])
        dq_pHD = torch.empty_like(q_pHD)
        dkv_SD = torch.zeros(kv_SD.shape, dtype=acc, device=kv_SD.device)
        dsink_H = torch.zeros(sink_H.shape, dtype=acc, device=sink_H.device)
        for a in range(0, Tp, chunk):
            rows = slice(a, a + chunk)
            q_nHD, lse_nH = q_pHD[rows].to(acc), lse_pH[rows]
            rows_bL = band_rows_NL[a // block : (a + chunk) // block] if block else None
            idx_nK = None if idx_TK is None else idx_TK[rows]
            ((band_kv, band_p), (g_kv, g_p)), _ = _probs(
                q_nHD,
                kv_SD,
                block,
                rows_bL,
                band_ok_TL[rows] if block else None,
                idx_nK,
                sink_H,
                scale,
                lse_nH,
            )
            n = q_nHD.shape[0]
            do_nHD = dout_THD[rows].to(acc).contiguous()
            delta_nH = (do_nHD * out_pHD[rows].to(acc)).sum(-1)
            dq = None
            if band_p is not None:
                L = band_p.shape[-1]
                do_bMD, q_bMD = do_nHD.view(-1, block * H, D), q_nHD.view(-1, block * H, D)
                dp_bML = torch.bmm(do_bMD, band_kv.transpose(1, 2))
                p_bML = band_p.view(-1, block * H, L)
                dlogit_bML = p_bML * (dp_bML - delta_nH.view(-1, block * H, 1))
                dq = torch.bmm(dlogit_bML, band_kv).view(n, H, D)
                # K = V: each key slot gets its key gradient and its value gradient.
                dkv_bLD = torch.baddbmm(
                    torch.bmm(p_bML.transpose(1, 2), do_bMD), dlogit_bML.transpose(1, 2), q_bMD, alpha=scale
                )
                dkv_SD.index_add_(0, rows_bL.flatten(), dkv_bLD.flatten(0, 1))
            if g_p is not None:
                dlogit_nHK = g_p * (torch.bmm(do_nHD, g_kv.transpose(1, 2)) - delta_nH[..., None])
                dq = torch.bmm(dlogit_nHK, g_kv) if dq is None else dq.baddbmm_(dlogit_nHK, g_kv)
                dkv_nKD = torch.baddbmm(
                    torch.bmm(g_p.transpose(1, 2), do_nHD), dlogit_nHK.transpose(1, 2), q_nHD, alpha=scale
                )
                dkv_SD.index_add_(0, idx_nK.clamp(min=0).flatten(), dkv_nKD.flatten(0, 1))
            dq_pHD[rows] = dq.mul_(scale)
            dsink_H -= (torch.exp(sink_H.to(acc)[None, :] - lse_nH) * delta_nH).sum(0)
        return (
            dq_pHD[:T],
            dkv_SD.to(kv_SD.dtype),
            None,
            dsink_H.to(sink_H.dtype),
            None,
            None,
            None,
            None,
            None,
        )


def sparse_mqa(
    q_THD: torch.Tensor,
    kv_SD: torch.Tensor,
    idx_TK: torch.Tensor | None,
    sink_H: torch.Tensor,
    scale: float,
    chunk: int,
    band: Band | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out_THD, lse_TH): attention of each query over its band keys (if any) and the kv rows
    idx_TK (-1 = unused slot; None = none), plus the sink, in one softmax."""
    T = q_THD.shape[0]
    assert band is not None or idx_TK is not None
    if idx_TK is not None:
        assert idx_TK.shape[0] == T and idx_TK.shape[1] >= 1, (idx_TK.shape, q_THD.shape)
    if band is None:
        return _SparseMQA.apply(q_THD, kv_SD, idx_TK, sink_H, scale, chunk, None, None, 0)
    assert band.ok_TL.shape[0] == band.rows_NL.shape[0] * band.block >= T, (band.ok_TL.shape, T)
    return _SparseMQA.apply(q_THD, kv_SD, idx_TK, sink_H, scale, chunk, band.rows_NL, band.ok_TL, band.block)


def window_band(window_TW: torch.Tensor, halo: int, block: int, R: int) -> Band:
    """Band of the sliding-window keys: query t's window slot w is key row t + halo - W + 1 + w
    (or -1 before its document start, as in `BatchPlan.window_TW`); a block of `block` queries
    reads the block + W - 1 consecutive rows ending at its last query's row (R key rows)."""
    T, W = window_TW.shape
    N, L = -(-T // block), block + W - 1
    first_N = torch.arange(N, device=window_TW.device) * block + halo - W + 1
    rows_NL = (first_N[:, None] + torch.arange(L, device=window_TW.device)).clamp(0, R - 1)
    cols_TW = (torch.arange(T, device=window_TW.device) % block)[:, None] + torch.arange(
        W, device=window_TW.device
    )
    ok_TL = torch.zeros(N * block, L, dtype=torch.bool, device=window_TW.device)
    ok_TL[:T].scatter_(1, cols_TW, window_TW >= 0)
    return Band(block, rows_NL, ok_TL)


def entry_blocks(
    start_T: torch.Tensor, n_vis_T: torch.Tensor, block: int
) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Per block of `block` queries the contiguous entry run holding every query's visible entries
    [start, start + n_vis): (first entry lo_N, run length K (>= 1, the longest run; one host sync),
    ok_PK [N * block, K] bool: slot j of the query's block, entry lo + j, is visible to it)."""
    T = start_T.shape[0]
    N = -(-T // block)
    pad = N * block - T
    end_T = start_T + n_vis_T
    start_P = torch.cat([start_T, start_T[-1:].expand(pad)]) if pad else start_T
    end_P = torch.cat([end_T, start_T[-1:].expand(pad)]) if pad else end_T
    lo_N = start_P.view(N, block).amin(1)
    K = max(1, int((end_P.view(N, block).amax(1) - lo_N).max()))
    ent_PK = lo_N.repeat_interleave(block)[:, None] + torch.arange(K, device=start_T.device)
    return lo_N, K, (ent_PK >= start_P[:, None]) & (ent_PK < end_P[:, None])


def with_entry_range(
    band: Band, start_T: torch.Tensor, n_vis_T: torch.Tensor, first_row: int, S: int
) -> Band:
    """`band` plus, for every query, its visible entries [start, start + n_vis) (key rows
    first_row + entry), as one contiguous run per block (`entry_blocks`; S buffer rows)."""
    lo_N, K, ok_PK = entry_blocks(start_T, n_vis_T, band.block)
    rows_NK = (first_row + lo_N[:, None] + torch.arange(K, device=start_T.device)).clamp(max=S - 1)
    return Band(band.block, torch.cat([band.rows_NL, rows_NK], 1), torch.cat([band.ok_TL, ok_PK], 1))


def dense_reference(
    q_THD: torch.Tensor, kv_SD: torch.Tensor, allowed_TS: torch.Tensor, sink_H: torch.Tensor, scale: float
) -> torch.Tensor:
    """Same attention through an explicit [T, S] boolean mask (test reference; quadratic)."""
    logits_THS = torch.einsum("thd,sd->ths", q_THD, kv_SD) * scale
    logits_THS = logits_THS.masked_fill(~allowed_TS[:, None, :], float("-inf"))
    sink_TH1 = sink_H.to(logits_THS.dtype)[None, :, None].expand(q_THD.shape[0], -1, 1)
    p_THS = torch.softmax(torch.cat([logits_THS, sink_TH1], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("ths,sd->thd", p_THS, kv_SD)
