"""Multi-token prediction, depth 1 (docs/dsv4.md §7).

Legend:  T rows   N mHC streams   d model width   V vocabulary

Row t combines the main model's final streams at t with the embedding of token t+1 and predicts
token t+2, through one sliding-window block with its own mHC head and final norm; the embedding and
the LM head are the main model's. In a packed microbatch both shifts stay inside the row's
document: the input token is `labels[t]` (the next token of the same document, padding id 0 where
there is none) and the target is `labels[t+1]` only if row t+1 belongs to the same document and its
label is trained.
"""

from __future__ import annotations

import torch

from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.block import Block
from titan_thd.models.dsv4.mhc import HyperHead
from titan_thd.models.dsv4.norm import RMSNorm
from titan_thd.models.dsv4.plans import BatchPlan
from titan_thd.models.projection import Linear


class MTPBlock(Block):
    def __init__(self, args: DSv4Args):
        super().__init__(args, "sliding", hash_routed=False)
        self.enorm = RMSNorm(args.dim, args.norm_eps)
        self.hnorm = RMSNorm(args.dim, args.norm_eps)
        self.e_proj = Linear(args.dim, args.dim, bias=False)
        self.h_proj = Linear(args.dim, args.dim, bias=False)
        self.hc_head = HyperHead(args.hc_mult, args.dim, args.hc_eps, args.norm_eps)
        self.norm = RMSNorm(args.dim, args.norm_eps)

    def forward(
        self, h_TND: torch.Tensor, next_emb_TD: torch.Tensor, next_T: torch.Tensor, plan: BatchPlan
    ) -> torch.Tensor:
        """[T, d] normed hidden state for the LM head."""
        s_TND = self.e_proj(self.enorm(next_emb_TD))[:, None, :] + self.h_proj(self.hnorm(h_TND))
        s_TND, _ = super().forward(s_TND, next_T, plan, with_kl=False)
        return self.norm(self.hc_head(s_TND))


def mtp_inputs_targets(
    labels_T: torch.Tensor, loss_mask_T: torch.Tensor, doc_T: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids [T], target ids [T], trained [T] bool) of depth-1 MTP over a whole microbatch."""
    next_T = torch.where(labels_T == IGNORE_INDEX, 0, labels_T)
    target_T = torch.full_like(labels_T, IGNORE_INDEX)
    target_T[:-1] = labels_T[1:]
    trained_T = torch.zeros_like(loss_mask_T, dtype=torch.bool)
    trained_T[:-1] = loss_mask_T[1:].bool() & (doc_T[1:] == doc_T[:-1])
    return next_T, target_T, trained_T
