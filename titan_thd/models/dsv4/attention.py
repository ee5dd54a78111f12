"""DeepSeek-V4 hybrid attention: sliding window, CSA and HCA (docs/dsv4.md §2-§4).

Legend:  T query rows   R key rows   d model width   Q q_lora rank   H heads   D head dim   W window keys
         C compressed entries   k indexer top-k   E visible-entry slots   G output groups

All three types share: a low-rank query (weighted RMSNorm on the latent c_q, then a weightless
RMSNorm per head), one K=V head (weighted RMSNorm), partial RoPE on the trailing dims, a per-head
sink, ONE softmax over {window keys} ∪ {compressed entries}, inverse RoPE on the output's rope slice
and a grouped low-rank output projection. The types differ only in the compressed entries a query
sees: none (sliding), the indexer's top-k of its document's visible entries (CSA, m = 4, overlapping
windows) or all of its document's visible entries (HCA, m' = 128, no overlap).

Under contiguous context parallelism (docs/dsv4.md §9.2) queries stay local; the key rows are the
attention input `x_TD` (normed, mHC-collapsed) preceded by rank r-1's last `halo` rows (R = halo +
T rows, re-projected here), and the compressed entries are all-gathered (context_parallel.py).
Without CP, R = T.

Under tensor parallelism (docs/design.md §5.1) x_TD holds all T rows on every tp rank and the
query heads, sinks and output groups are this rank's share (whole groups): H and G are read from
the local shapes, and the output is a partial sum over tp that the caller reduce-scatters.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.compressor import Compressor
from titan_thd.models.dsv4.context_parallel import gather_entries, with_left_halo
from titan_thd.models.dsv4.indexer import Indexer, indexer_kl
from titan_thd.models.dsv4.norm import RMSNorm, rms_norm
from titan_thd.models.dsv4.plans import BatchPlan, CosSin
from titan_thd.models.dsv4.rope import apply_rope
from titan_thd.models.dsv4.sparse_attention import Band, sparse_mqa, window_band, with_entry_range
from titan_thd.models.projection import Linear, grouped_local, linear_local, local_weight
from titan_thd.parallel.recompute import decided_once
from titan_thd.parallel.tensor_parallel import local


class Attention(nn.Module):
    def __init__(self, args: DSv4Args, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.head_dim, self.o_lora_rank = args.head_dim, args.o_lora_rank
        self.tp_group: torch.distributed.ProcessGroup | None = None
        """The tp group when the heads are split over tp (set by parallelize.apply_tp)."""
        self.eps, self.chunk, self.kl_mode = args.norm_eps, args.attn_chunk, args.indexer_loss_mode
        # Queries per band block: L = block + W - 1 key slots per block, W of them used per query.
        self.block = args.window
        H, D = args.n_heads, args.head_dim
        self.wq_a = Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = Linear(args.q_lora_rank, H * D, bias=False)
        self.wkv = Linear(args.dim, D, bias=False)
        self.kv_norm = RMSNorm(D, args.norm_eps)
        # Block-diagonal: only the weight is used, viewed as [G, o_lora, H*D/G] (one matrix per group).
        self.wo_a = Linear(H * D // args.o_groups, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.head_norm = rms_norm
        """Weightless per-head query norm; `apply_compile` swaps in its compiled form."""
        self.compressor = None
        self.indexer = None
        if layer_type != "sliding":
            ratio = args.ratios[layer_type]
            self.compressor = Compressor(args.dim, D, ratio, overlap=layer_type == "csa", eps=args.norm_eps)
        if layer_type == "csa":
            self.indexer = Indexer(args)

    def forward(
        self, x_TD: torch.Tensor, plan: BatchPlan, with_kl: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(output [T, d], indexer KL summed over valid rows, or None when not asked / not CSA)."""
        T, D = x_TD.shape[0], self.head_dim
        rope_k, rope_q = plan.rope(self.layer_type)
        x_RD = with_left_halo(x_TD, plan)
        cq_TQ = self.q_norm(self.wq_a(x_TD))
        q_THD, kv_RD = self.up_proj(cq_TQ, x_RD, rope_q, rope_k)
        # The window keys as a band: blocks of queries read contiguous key rows (docs/dsv4.md §16).
        band = window_band(plan.window_TW, plan.halo, min(self.block, T), kv_RD.shape[0])
        if self.compressor is None:  # sliding: the window keys only
            return self.attend(q_THD, kv_RD, None, band, rope_q)[0], None

        cplan = plan.compress[self.layer_type]
        comp_CD = gather_entries(self.compressor(x_RD, cplan), cplan, plan.group)
        kv_SD = torch.cat([kv_RD, comp_CD])
        if self.indexer is None:  # HCA: every visible entry of the query's document, banded too
            if comp_CD.shape[0]:
                band = with_entry_range(band, cplan.start_T, cplan.n_vis_T, kv_RD.shape[0], kv_SD.shape[0])
            return self.attend(q_THD, kv_SD, None, band, rope_q)[0], None

        # CSA: the indexer's top-k entries; its KL loss teaches it the main attention's choice.
        q_I, w_I, k_I = self.indexer(x_RD.detach(), cq_TQ.detach(), plan, rope_q)
        # Decided once: a recomputation (activation_checkpoint) reuses the forward's entries.
        entries_TE = decided_once(lambda: self.indexer.select(q_I, w_I, k_I, cplan))
        idx_TK = torch.where(entries_TE >= 0, entries_TE + kv_RD.shape[0], -1)
        out_TD, lse_TH = self.attend(q_THD, kv_SD, idx_TK, band, rope_q)
        if not with_kl or comp_CD.shape[0] == 0:
            return out_TD, None
        sparse = self.kl_mode == "sparse"
        cand_TK = entries_TE if sparse else cplan.visible()
        kl = indexer_kl(
            q_THD=q_THD,
            kv_RD=kv_RD,
            comp_CD=comp_CD,
            sink_H=local(self.attn_sink),
            window_TW=plan.window_TW,
            cand_TK=cand_TK,
            student_TK=self.indexer.scores(q_I, w_I, k_I, cand_TK),
            row_ok_T=plan.real_T,
            scale=D**-0.5,
            chunk=self.chunk,
            tp_group=self.tp_group,
            # Sparse: the candidates are the attended entries, so the kernel's lse is the full mass.
            lse_TH=lse_TH.detach() if sparse else None,
        )
        return out_TD, kl

    def up_proj(
        self, cq_TQ: torch.Tensor, x_RD: torch.Tensor, rope_q: CosSin, rope_k: CosSin
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H, D], K=V rows [R, D]): the query up-projection (this rank's heads), head norm
        and RoPE; the K=V projection, norm and RoPE of the key rows. The `attn_up_proj` recompute
        region (parallelize.apply_ac): its inputs are the query latent and the key rows, so the CP
        halo exchange that made them is not repeated."""
        T, D = cq_TQ.shape[0], self.head_dim
        q_THD = linear_local(cq_TQ, self.wq_b).view(T, -1, D)
        q_THD = apply_rope(self.head_norm(q_THD, self.eps).to(cq_TQ.dtype), *rope_q)
        kv_RD = apply_rope(self.kv_norm(self.wkv(x_RD)), *rope_k)
        return q_THD, kv_RD

    def attend(
        self,
        q_THD: torch.Tensor,
        kv_SD: torch.Tensor,
        idx_TK: torch.Tensor | None,
        band: Band,
        rope_q: CosSin,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One softmax of every query over its band and listed key rows and its sink, then the
        output projection; (output [T, d], lse [T, H]). The cached decoder (decode.py) attends its
        one-row steps through it too (band None, every key row listed)."""
        (T, _, D) = q_THD.shape
        # this rank's groups under TP: its H heads, whole groups
        G = local_weight(self.wo_a.weight).shape[0] // self.o_lora_rank
        o_THD, lse_TH = sparse_mqa(
            q_THD, kv_SD, idx_TK, local(self.attn_sink), D**-0.5, self.chunk, band=band
        )
        o_THD = apply_rope(o_THD, *rope_q, inverse=True)
        o_TGI = o_THD.reshape(T, G, -1)
        o_TGO = grouped_local(o_TGI, self.wo_a)  # with its LoRA adapter, when one is attached
        return linear_local(o_TGO.flatten(1), self.wo_b), lse_TH
