"""Causal attention of a packed THD microbatch under hybrid context parallelism (docs/data.md §4).

The rank's rows (`titan_thd.data.cp_partition.hybrid_layout`) are three parts: its zigzag chunks of
the long documents, the short documents it holds whole, its share of padding rows. The long part
is `zigzag_attention` of a microbatch made of the long documents only, so the per-layer all-gather
moves only their K/V (the whole-document rows never leave the rank); the whole part is plain
`varlen_attention` on the rank's own rows. When no document is long, no rank communicates at all
(every rank computes the same layout, so all agree on that). Row for row equal to `varlen_attention`
of the full microbatch restricted to `meta.row_index`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import hybrid_indices, hybrid_layout, zigzag_indices
from titan_thd.ops.block_causal import block_causal_attention
from titan_thd.ops.cp_attention import zigzag_attention


class HybridPlan(NamedTuple):
    split_rows: int
    """Local rows of the zigzagged documents (the first rows of the rank)."""
    split_meta: BatchMeta | None
    """The long documents as a zigzag microbatch (None when there are none)."""
    whole_meta: BatchMeta | None
    """The rank's whole documents and padding rows as a microbatch without CP (None when empty)."""


def _cu(lengths: list[int]) -> torch.Tensor:
    # host metadata, like every BatchMeta's cu_seqlens
    return torch.tensor([0, *lengths], dtype=torch.int64, device="cpu").cumsum(0).to(torch.int32)


def hybrid_plan(meta: BatchMeta) -> HybridPlan:
    cp = meta.cp
    real, padded = meta.seqlens, meta.seqlens_padded
    layout = hybrid_layout(real, padded, cp.size, cp.hybrid_threshold)
    rows = hybrid_indices(meta.cu_seqlens_padded, layout, cp.rank)
    if meta.row_index is None or not torch.equal(meta.row_index.cpu(), rows):
        raise ValueError(
            f"hybrid_attention: CP rank {cp.rank} of {cp.size} must hold the rows of hybrid_layout (threshold "
            f"{cp.hybrid_threshold}; titan_thd.data.cp_partition.partition(..., 'hybrid')); meta.row_index says "
            "otherwise"
        )
    n = sum(padded[i] for i in layout.split) // cp.size
    split_meta = whole_meta = None
    if layout.split:
        sub_cup = _cu([padded[i] for i in layout.split])
        split_meta = BatchMeta(
            cu_seqlens=_cu([real[i] for i in layout.split]),
            cu_seqlens_padded=sub_cup,
            max_seqlen=max(padded[i] for i in layout.split),
            num_docs=len(layout.split),
            position_ids=meta.position_ids[:n],
            row_index=zigzag_indices(sub_cup, cp.size, cp.rank),
            cp=replace(cp, mode="zigzag"),
        )
    mine = layout.whole[cp.rank]
    fill = [layout.filler[cp.rank]] if layout.filler[cp.rank] else []
    if mine or fill:
        whole_meta = BatchMeta(
            cu_seqlens=_cu([real[i] for i in mine] + [0] * len(fill)),
            cu_seqlens_padded=_cu([padded[i] for i in mine] + fill),
            max_seqlen=max([padded[i] for i in mine] + fill),
            num_docs=len(mine) + len(fill),
            position_ids=meta.position_ids[n:],
            row_index=None,
            cp=CPContext(),
        )
    return HybridPlan(n, split_meta, whole_meta)


def hybrid_attention(
    q_tHD: torch.Tensor,
    k_tKD: torch.Tensor,
    v_tKD: torch.Tensor,
    meta: BatchMeta,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's hybrid rows over their documents; returns out_tHD.

    Every rank of `meta.cp.group` must call it (it all-gathers the long documents' K and V).
    """
    assert q_tHD.shape[0] * meta.cp.size == meta.total_tokens, (q_tHD.shape, meta.cp.size, meta.total_tokens)
    plan = meta.cached("hybrid_attention_plan", lambda: hybrid_plan(meta))
    n = plan.split_rows
    outs = []
    if plan.split_meta is not None:
        outs.append(zigzag_attention(q_tHD[:n], k_tKD[:n], v_tKD[:n], plan.split_meta, scale))
    if plan.whole_meta is not None:
        outs.append(block_causal_attention(q_tHD[n:], k_tKD[n:], v_tKD[n:], plan.whole_meta, scale))
    return torch.cat(outs)
