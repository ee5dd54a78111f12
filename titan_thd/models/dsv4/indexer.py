"""Lightning indexer of CSA layers and its KL training loss (docs/dsv4.md §3.3, §10).

Legend:  T queries   HI indexer heads   I indexer head dim   C compressed entries   k top-k
         H attention heads   D attention head dim   W window keys   K candidates per query
         R key rows (a CP left halo, then the T query rows)

Score of entry s for query t (entries of the query's own document only, causal):

    I[t, s] = sum_h w[t, h] * ReLU(q_I[t, h] . k_I[s]) * I^-0.5,   w = (x W_w) * HI^-0.5

The indexer reads detached inputs (x and the query latent c_q), so it learns only from the KL loss
against the detached main attention, and the selection (an integer index) sends no gradient to the
main model either (docs/dsv4.md pitfall 10).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.compressor import Compressor
from titan_thd.models.dsv4.context_parallel import gather_entries
from titan_thd.models.dsv4.plans import BatchPlan, CompressPlan
from titan_thd.models.dsv4.rope import apply_rope
from titan_thd.models.dsv4.sparse_attention import entry_blocks
from titan_thd.models.projection import Linear

SELECT_BLOCK = 64
"""Queries per block of the top-k scoring (they share one contiguous range of candidate entries)."""


class Indexer(nn.Module):
    def __init__(self, args: DSv4Args):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = args.index_n_heads, args.index_head_dim, args.index_topk
        self.wq_b = Linear(args.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = Linear(args.dim, self.n_heads, bias=False)
        self.compressor = Compressor(args.dim, self.head_dim, args.csa_ratio, overlap=True, eps=args.norm_eps)
        self.chunk = args.attn_chunk

    def forward(
        self,
        x_RD: torch.Tensor,
        cq_TQ: torch.Tensor,
        plan: BatchPlan,
        rope_q: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_THI, w_TH, k_CI) from the (already detached) key-row attention input and query latent.

        k_CI holds every entry of the microbatch (all-gathered under CP)."""
        T, cplan = cq_TQ.shape[0], plan.compress["csa"]
        k_CI = gather_entries(self.compressor(x_RD, cplan), cplan, plan.group)
        q_THI = apply_rope(self.wq_b(cq_TQ).view(T, self.n_heads, self.head_dim), *rope_q)
        w_TH = self.weights_proj(x_RD[x_RD.shape[0] - T :]) * self.n_heads**-0.5
        return q_THI, w_TH, k_CI

    @torch.no_grad()
    def select(
        self, q_THI: torch.Tensor, w_TH: torch.Tensor, k_CI: torch.Tensor, plan: CompressPlan
    ) -> torch.Tensor:
        """[T, k] entries with the highest scores among each query's visible ones (-1 = none).

        Scores of a block of SELECT_BLOCK queries are computed densely against the contiguous entry
        range its documents' visible entries span (one matmul per block, cost per query ~ (block +
        doc length) / m), then masked. Ties are broken towards the lower entry index, so the choice
        does not depend on what else is packed into the microbatch (torch.topk alone gives no such
        guarantee, and ReLU makes exact ties common).
        """
        T, HI, Di = q_THI.shape
        out_Tk = torch.full((T, self.topk), -1, dtype=torch.long, device=q_THI.device)
        if k_CI.shape[0] == 0:
            return out_Tk
        B = min(SELECT_BLOCK, T)
        lo_N, K, ok_PK = entry_blocks(plan.start_T, plan.n_vis_T, B)
        N, k = lo_N.shape[0], min(self.topk, K)
        pad = N * B - T
        q_PHI = torch.cat([q_THI, q_THI.new_zeros(pad, HI, Di)]) if pad else q_THI
        w_PH = torch.cat([w_TH, w_TH.new_zeros(pad, HI)]) if pad else w_TH
        ent_NK = lo_N[:, None] + torch.arange(K, device=q_THI.device)
        k_NKI = k_CI[ent_NK.clamp(max=k_CI.shape[0] - 1)]
        step = max(1, self.chunk // B)  # blocks per chunk: bounds the [rows, HI, K] temporaries
        for n0 in range(0, N, step):
            blocks, rows = slice(n0, n0 + step), slice(n0 * B, (n0 + step) * B)
            relu = torch.bmm(q_PHI[rows].reshape(-1, B * HI, Di), k_NKI[blocks].transpose(1, 2))
            relu_RHK = relu.view(-1, HI, K).relu_().mul_(self.head_dim**-0.5)
            score_RK = torch.bmm(w_PH[rows][:, None, :], relu_RHK)[:, 0]
            # NaN scores (diverged weights) would break the k-per-row count below; as -inf the
            # forward goes on and the trainer's non-finite-loss check stops the run with its message.
            score_RK.nan_to_num_(nan=float("-inf"))
            score_RK.masked_fill_(~ok_PK[rows], float("-inf"))
            cols_Rk = _topk_mask_low_index_first(score_RK, k).nonzero()[:, 1].view(-1, k)  # ascending
            ent_Rk = ent_NK[blocks].repeat_interleave(B, dim=0).gather(1, cols_Rk)
            picked = torch.where(ok_PK[rows].gather(1, cols_Rk), ent_Rk, -1)
            out_Tk[rows.start : min(rows.stop, T), :k] = picked[: T - rows.start]
        return out_Tk

    def scores(
        self, q_THI: torch.Tensor, w_TH: torch.Tensor, k_CI: torch.Tensor, cand_TK: torch.Tensor
    ) -> torch.Tensor:
        """[T, K] differentiable scores of the listed candidates (-inf where cand = -1)."""
        k_TKI = k_CI[cand_TK.clamp(min=0)]
        relu_THK = F.relu(torch.bmm(q_THI, k_TKI.transpose(1, 2))) * self.head_dim**-0.5
        score_TK = torch.bmm(w_TH[:, None, :], relu_THK)[:, 0]
        return score_TK.masked_fill(cand_TK < 0, float("-inf"))


def _topk_mask_low_index_first(score_nC: torch.Tensor, k: int) -> torch.Tensor:
    """Bool mask of exactly k columns per row: values above the k-th largest, then ties by column."""
    kth_n1 = score_nC.topk(k, dim=1).values[:, -1:]
    above_nC = score_nC > kth_n1
    tie_nC = score_nC == kth_n1
    room_n1 = k - above_nC.sum(1, keepdim=True)
    return above_nC | (tie_nC & (tie_nC.cumsum(1) <= room_n1))


def indexer_kl(
    *,
    q_THD: torch.Tensor,
    kv_RD: torch.Tensor,
    comp_CD: torch.Tensor,
    sink_H: torch.Tensor,
    window_TW: torch.Tensor,
    cand_TK: torch.Tensor,
    student_TK: torch.Tensor,
    row_ok_T: torch.Tensor,
    scale: float,
    chunk: int,
    tp_group: dist.ProcessGroup | None = None,
    lse_TH: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sum over valid rows of KL(teacher || student) over each row's candidate entries.

    Teacher: the main attention's probabilities on the candidates, normalised by the full softmax
    mass (window + candidates + sink), summed over heads, then L1-normalised over the candidates;
    computed from detached tensors. Student: softmax of the indexer scores over the same candidates.
    Rows without candidates and padding rows (`row_ok_T` False) do not count. Under tensor
    parallelism q_THD / sink_H are this rank's heads: the head sum of the mass is all-reduced over
    `tp_group` (no gradient), so every tp rank gets the single-process teacher and the same KL.
    `lse_TH`: the log of that full mass when the caller has it (the attention kernel's, when the
    candidates are the attended entries), which saves recomputing the window logits.
    """
    acc = torch.promote_types(q_THD.dtype, torch.float32)
    teacher_TK = torch.empty(cand_TK.shape, dtype=acc, device=q_THD.device)
    with torch.no_grad():
        for a in range(0, q_THD.shape[0], chunk):
            rows = slice(a, a + chunk)
            lc_nHK = _logits(q_THD[rows], comp_CD, cand_TK[rows], scale, acc)
            if lse_TH is None:
                lw_nHW = _logits(q_THD[rows], kv_RD, window_TW[rows], scale, acc)
                sink_nH1 = sink_H.to(acc)[None, :, None].expand(lc_nHK.shape[0], -1, 1)
                lse_nH1 = torch.cat([lw_nHW, lc_nHK, sink_nH1], dim=-1).logsumexp(-1, keepdim=True)
            else:
                lse_nH1 = lse_TH[rows].to(acc)[..., None]
            teacher_TK[rows] = torch.exp(lc_nHK - lse_nH1).sum(1)  # mass over (this rank's) heads
        if tp_group is not None:
            dist.all_reduce(teacher_TK, group=tp_group)
        teacher_TK /= teacher_TK.sum(-1, keepdim=True).clamp_min(torch.finfo(acc).tiny)
        ok_T = row_ok_T & (cand_TK >= 0).any(-1)
    teacher_rK = teacher_TK[ok_T]
    log_student_rK = torch.log_softmax(student_TK[ok_T].to(acc), dim=-1).masked_fill(teacher_rK == 0, 0.0)
    return (torch.xlogy(teacher_rK, teacher_rK) - teacher_rK * log_student_rK).sum()


def _logits(q_nHD, buf_SD, idx_nK, scale, acc):
    """Detached attention logits of queries against listed buffer rows (-inf where idx = -1)."""
    logits_nHK = torch.bmm(
        q_nHD.detach().to(acc), buf_SD.detach()[idx_nK.clamp(min=0)].to(acc).transpose(1, 2)
    )
    return (logits_nHK * scale).masked_fill((idx_nK < 0)[:, None, :], float("-inf"))
