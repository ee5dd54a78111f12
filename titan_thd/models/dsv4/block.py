"""One DeepSeek-V4 decoder block: mHC around attention and around the MoE (docs/dsv4.md §1.2).

Legend:  T rows   N mHC streams   d model width
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.mhc import HyperConnection, hc_post
from titan_thd.models.dsv4.moe import MoE
from titan_thd.models.dsv4.norm import RMSNorm
from titan_thd.models.dsv4.plans import BatchPlan


class Block(nn.Module):
    def __init__(self, args: DSv4Args, layer_type: str, hash_routed: bool):
        super().__init__()
        self.attn_norm = RMSNorm(args.dim, args.norm_eps)
        self.attn = Attention(args, layer_type)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn = MoE(args, hash_routed)
        hc = (args.hc_mult, args.dim, args.hc_sinkhorn_iters, args.hc_eps, args.norm_eps)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)
        self.hc_post = hc_post
        """The mHC update; `apply_compile` swaps in its compiled form (titan_thd/models/compile.py)."""

    def forward(
        self, h_TND: torch.Tensor, tokens_T: torch.Tensor, plan: BatchPlan, with_kl: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(new streams, indexer KL of this layer or None)."""
        x_TD, post_TN, comb_TNN = self.hc_attn(h_TND)
        y_TD, kl = self.attn(self.attn_norm(x_TD), plan, with_kl)
        h_TND = self.hc_post(y_TD, h_TND, post_TN, comb_TNN)
        x_TD, post_TN, comb_TNN = self.hc_ffn(h_TND)
        y_TD = self.ffn(self.ffn_norm(x_TD), tokens_T, plan.real_T)
        return self.hc_post(y_TD, h_TND, post_TN, comb_TNN), kl
