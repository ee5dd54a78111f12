"""Token compressor of CSA / HCA layers and of the lightning indexer (docs/dsv4.md §3.1, §4).

Legend:  R rows of the input (the microbatch rows, plus a left halo under CP)   d model width
         C entries   m ratio   P pooled slots (2m with overlap, m without)   Dc entry width

Entry w of a document pools the rows of its window w (and, with overlap, window w-1) with a
softmax over the slot axis taken independently per channel:

    entry = RMSNorm( sum_slots softmax_slots(Z + B) * Cv ),   then RoPE at position w*m.

With overlap ("recorded twice", CSA m=4) each token projects to 2*Dc channels: the first Dc feed the
NEXT window's entry, the last Dc its OWN window's entry; a document's first window has no previous-
window slots (gate -inf, value 0). The gather rows come from a CompressPlan, so the input may carry
extra left rows (a CP halo) without any change here.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.models.dsv4.norm import RMSNorm
from titan_thd.models.dsv4.plans import CompressPlan
from titan_thd.models.dsv4.rope import apply_rope
from titan_thd.models.projection import Linear


class Compressor(nn.Module):
    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float):
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = Linear(dim, width, bias=False)
        self.wgate = Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        """Learned position bias of each slot of a window (added to the gate logits)."""
        self.norm = RMSNorm(head_dim, eps)

    def forward(self, x_RD: torch.Tensor, plan: CompressPlan) -> torch.Tensor:
        """[C, Dc] compressed entries of the windows listed in `plan` (rows index x_RD)."""
        assert plan.ratio == self.ratio, (plan.ratio, self.ratio)
        Dc, acc = self.head_dim, torch.promote_types(x_RD.dtype, torch.float32)
        kv_RW, gate_RW = self.wkv(x_RD), self.wgate(x_RD)
        kv_CMW = _rows(kv_RW, plan.own_CM)
        gate_CMW = _rows(gate_RW, plan.own_CM).to(acc) + self.ape
        if self.overlap:
            assert plan.prev_CM is not None, "an overlapping compressor needs the previous windows"
            first_C11 = (plan.prev_CM[:, :1] < 0)[..., None]
            prev = plan.prev_CM.clamp(min=0)
            prev_kv_CMD = _rows(kv_RW[:, :Dc], prev).masked_fill(first_C11, 0.0)
            prev_gate_CMD = (_rows(gate_RW[:, :Dc], prev).to(acc) + self.ape[:, :Dc]).masked_fill(
                first_C11, float("-inf")
            )
            kv_CPD = torch.cat([prev_kv_CMD, kv_CMW[..., Dc:]], dim=1)
            gate_CPD = torch.cat([prev_gate_CMD, gate_CMW[..., Dc:]], dim=1)
        else:
            kv_CPD, gate_CPD = kv_CMW, gate_CMW
        weight_CPD = gate_CPD.softmax(dim=1)
        entries_CD = self.norm((kv_CPD * weight_CPD).sum(dim=1).to(x_RD.dtype))
        return apply_rope(entries_CD, plan.cos_CR, plan.sin_CR)


def _rows(x_RW: torch.Tensor, idx_CM: torch.Tensor) -> torch.Tensor:
    """x_RW[idx_CM] as an index_select, whose backward is an index_add_ (advanced indexing's is a
    serial accumulating index_put_, several times slower on a CPU)."""
    return x_RW.index_select(0, idx_CM.flatten()).view(*idx_CM.shape, x_RW.shape[-1])
