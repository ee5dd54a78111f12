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
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.compressor import Compressor
from titan_thd.models.dsv4.context_parallel import gather_entries, with_left_halo
from titan_thd.models.dsv4.indexer import Indexer, indexer_kl
from titan_thd.models.dsv4.norm import RMSNorm, rms_norm
from titan_thd.models.dsv4.plans import BatchPlan
from titan_thd.models.dsv4.rope import apply_rope
from titan_thd.models.dsv4.sparse_attention import sparse_mqa


class Attention(nn.Module):
    def __init__(self, args: DSv4Args, layer_type: str):
        super().__init__()
        self.layer_type = layer_type
        self.n_heads, self.head_dim, self.o_groups = args.n_heads, args.head_dim, args.o_groups
        self.eps, self.chunk, self.kl_mode = args.norm_eps, args.attn_chunk, args.indexer_loss_mode
        H, D = args.n_heads, args.head_dim
        self.wq_a = nn.Linear(args.dim, args.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(args.q_lora_rank, args.norm_eps)
        self.wq_b = nn.Linear(args.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(args.dim, D, bias=False)
        self.kv_norm = RMSNorm(D, args.norm_eps)
        # Block-diagonal: only the weight is used, viewed as [G, o_lora, H*D/G] (one matrix per group).
        self.wo_a = nn.Linear(H * D // args.o_groups, args.o_groups * args.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(args.o_groups * args.o_lora_rank, args.dim, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
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
        T, H, D = x_TD.shape[0], self.n_heads, self.head_dim
        rope_k, rope_q = plan.rope(self.layer_type)
        x_RD = with_left_halo(x_TD, plan)
        R = x_RD.shape[0]
        cq_TQ = self.q_norm(self.wq_a(x_TD))
        q_THD = apply_rope(rms_norm(self.wq_b(cq_TQ).view(T, H, D), self.eps).to(x_TD.dtype), *rope_q)
        kv_RD = apply_rope(self.kv_norm(self.wkv(x_RD)), *rope_k)

        idx_TK, kv_SD = plan.window_TW, kv_RD
        if self.compressor is not None:
            cplan = plan.compress[self.layer_type]
            comp_CD = gather_entries(self.compressor(x_RD, cplan), cplan, plan.group)
            kv_SD = torch.cat([kv_RD, comp_CD])
            if self.indexer is None:
                entries_TE = cplan.visible_all()
            else:
                q_I, w_I, k_I = self.indexer(x_RD.detach(), cq_TQ.detach(), plan, rope_q)
                entries_TE = self.indexer.select(q_I, w_I, k_I, cplan)
            # Compressed entries sit after the R key rows in the key buffer.
            idx_TK = torch.cat([idx_TK, torch.where(entries_TE >= 0, entries_TE + R, -1)], dim=1)

        o_THD, _ = sparse_mqa(q_THD, kv_SD, idx_TK, self.attn_sink, D**-0.5, self.chunk)
        o_THD = apply_rope(o_THD, *rope_q, inverse=True)
        G = self.o_groups
        wo_a_GOI = self.wo_a.weight.view(G, -1, H * D // G)
        o_TGO = torch.einsum("tgi,goi->tgo", o_THD.reshape(T, G, -1), wo_a_GOI)
        out_TD = self.wo_b(o_TGO.flatten(1))

        if self.indexer is None or not with_kl or comp_CD.shape[0] == 0:
            return out_TD, None
        cand_TK = entries_TE if self.kl_mode == "sparse" else cplan.visible()
        student_TK = self.indexer.scores(q_I, w_I, k_I, cand_TK)
        kl = indexer_kl(
            q_THD,
            kv_RD,
            comp_CD,
            self.attn_sink,
            plan.window_TW,
            cand_TK,
            student_TK,
            plan.real_T,
            D**-0.5,
            self.chunk,
        )
        return out_TD, kl
