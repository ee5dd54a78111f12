"""Causal attention of a packed THD microbatch split by zigzag context parallelism.

Legend:
    T  rows of the full microbatch     t  rows held by this rank (T / cp)
    H  query heads                     K  key/value heads          D  head dim
    B  documents in one SDPA call      P  padded length of a document
    S  rows of one chunk (P / 2cp)     q  real query rows of a chunk   k  keys a chunk reads
    C  2K: K and V side by side, so that one collective moves both

Rank r holds chunks r and 2cp-1-r of every document (`titan_thd.data.cp_partition`). A query of
chunk c sits at document position c*S + i and must see the document's whole causal prefix, most of
which lives on other ranks. So every layer all-gathers K and V once (one [t, 2K, D] collective;
its backward reduce-scatters the K/V gradients back to the rows' owners), puts the gathered rows
in global order with a permutation every rank computes from the GLOBAL `cu_seqlens_padded` (no
extra communication), and lets each chunk attend keys [0, c*S + q). The causal mask of a chunk is
then aligned to the bottom right (query i sees keys j <= i + c*S); SDPA's `is_causal` is aligned
to the top left, so chunks with c > 0 pass a small [q, k] boolean mask (one per shape, built once
per microbatch) and chunk 0 uses `is_causal`. Padding rows and padding documents produce zeros,
exactly as `varlen_attention` does without CP, so both give the same result row for row.

All-gathering K/V moves (cp - 1) * t * 2K * D elements per rank per layer forward (and the same
in the backward's reduce-scatter). A P2P ring moves the same K/V in forward and more in backward
(K/V again plus their gradients; benchmarks/bench_cp.py) and pays off only by overlapping transfers
with compute, which gloo over loopback does not give; so there is no ring variant.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.cp_partition import zigzag_indices
from titan_thd.parallel.cp_comm import all_gather_rows


class _Chunk(NamedTuple):
    """One of the two local chunks of a run of equal documents."""

    index: int
    """0 for the rank's early chunk (chunk r), 1 for its late one (chunk 2cp-1-r)."""
    q_rows: int
    """Real query rows of the chunk (fewer than S where the document's real tokens end)."""
    k_rows: int
    """Keys the chunk reads: document positions [0, k_rows)."""
    mask: torch.Tensor | None
    """[q_rows, k_rows] bool bottom-right causal mask; None when the chunk is the first (square)."""


class _Run(NamedTuple):
    """`count` adjacent documents with equal real and padded lengths: one SDPA call per chunk."""

    count: int
    real: int
    padded: int
    chunk: int
    chunks: tuple[_Chunk, _Chunk]


class ZigzagPlan(NamedTuple):
    gather_order_T: torch.Tensor
    """[T] int64: row of the all-gathered (rank-major) buffer that holds global row i."""
    runs: list[_Run]


def _runs(meta: BatchMeta, device: torch.device) -> list[_Run]:
    cp = meta.cp
    masks: dict[tuple[int, int], torch.Tensor] = {}  # shared by chunks of equal shape

    def chunk(index: int, c: int, real: int, size: int) -> _Chunk:
        q_rows = max(0, min(size, real - c * size))
        k_rows = c * size + q_rows
        if c == 0 or q_rows == 0:
            return _Chunk(index, q_rows, k_rows, None)
        if (q_rows, k_rows) not in masks:
            masks[q_rows, k_rows] = torch.ones(q_rows, k_rows, dtype=torch.bool, device=device).tril(c * size)
        return _Chunk(index, q_rows, k_rows, masks[q_rows, k_rows])

    runs: list[_Run] = []
    for real, padded in zip(meta.seqlens, meta.seqlens_padded):
        if runs and runs[-1].real == real and runs[-1].padded == padded:
            runs[-1] = runs[-1]._replace(count=runs[-1].count + 1)
            continue
        size = padded // (2 * cp.size)
        early, late = chunk(0, cp.rank, real, size), chunk(1, 2 * cp.size - 1 - cp.rank, real, size)
        runs.append(_Run(1, real, padded, size, (early, late)))
    return runs


def zigzag_plan(meta: BatchMeta) -> ZigzagPlan:
    """Gather permutation and per-chunk calls of this rank (built once per microbatch)."""
    cp = meta.cp
    if cp.mode != "zigzag":
        raise ValueError(
            f"zigzag_attention: context parallel mode {cp.mode!r} is not supported; causal attention of "
            "the dense model is balanced and exact only with parallelism.context_parallel_mode = 'zigzag'"
        )
    T = meta.total_tokens
    rows_per_rank = [zigzag_indices(meta.cu_seqlens_padded, cp.size, r) for r in range(cp.size)]
    if meta.row_index is None or not torch.equal(meta.row_index.cpu(), rows_per_rank[cp.rank]):
        raise ValueError(
            f"zigzag_attention: CP rank {cp.rank} of {cp.size} must hold chunks {cp.rank} and "
            f"{2 * cp.size - 1 - cp.rank} of every document (titan_thd.data.cp_partition.partition(..., "
            "'zigzag')); meta.row_index says otherwise"
        )
    gathered_T = torch.cat(rows_per_rank)
    gather_order_T = torch.empty_like(gathered_T)
    gather_order_T[gathered_T] = torch.arange(T, device=gathered_T.device)  # host, moved below
    return ZigzagPlan(gather_order_T.to(meta.device), _runs(meta, meta.device))


def zigzag_attention(
    q_tHD: torch.Tensor,
    k_tKD: torch.Tensor,
    v_tKD: torch.Tensor,
    meta: BatchMeta,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's zigzag rows over their whole documents; returns out_tHD.

    Equal, row for row, to `varlen_attention` of the full microbatch restricted to `meta.row_index`.
    Every rank of `meta.cp.group` must call it (it all-gathers K and V).
    """
    t, H, D = q_tHD.shape
    K = k_tKD.shape[1]
    assert t * meta.cp.size == meta.total_tokens, (t, meta.cp.size, meta.total_tokens)
    assert k_tKD.shape == v_tKD.shape == (t, K, D) and H % K == 0, (q_tHD.shape, k_tKD.shape, v_tKD.shape)
    plan = meta.cached("zigzag_attention_plan", lambda: zigzag_plan(meta))
    kv_TCD = all_gather_rows(torch.cat([k_tKD, v_tKD], dim=1), meta.cp.group)[plan.gather_order_T]
    k_TKD, v_TKD = kv_TCD.split(K, dim=1)
    local_sizes = [r.count * 2 * r.chunk for r in plan.runs]
    global_sizes = [r.count * r.padded for r in plan.runs]
    outs = []
    for run, q, k, v in zip(
        plan.runs, q_tHD.split(local_sizes), k_TKD.split(global_sizes), v_TKD.split(global_sizes)
    ):
        q_B2SHD = q.unflatten(0, (run.count, 2, run.chunk))
        k_BPKD, v_BPKD = k.unflatten(0, (run.count, run.padded)), v.unflatten(0, (run.count, run.padded))
        chunk_outs = []
        for c in run.chunks:
            o_BSHD = q_B2SHD.new_zeros(run.count, run.chunk, H, D)
            if c.q_rows:
                o_BqHD = F.scaled_dot_product_attention(
                    q_B2SHD[:, c.index, : c.q_rows].transpose(1, 2),
                    k_BPKD[:, : c.k_rows].transpose(1, 2),
                    v_BPKD[:, : c.k_rows].transpose(1, 2),
                    attn_mask=c.mask,
                    is_causal=c.mask is None,
                    scale=scale,
                    enable_gqa=K != H,
                ).transpose(1, 2)
                o_BSHD = torch.cat([o_BqHD, o_BSHD[:, c.q_rows :]], dim=1)
            chunk_outs.append(o_BSHD)
        outs.append(torch.stack(chunk_outs, dim=1).reshape(run.count * 2 * run.chunk, H, D))
    out_tHD = torch.cat(outs)
    if not any(c.q_rows for run in plan.runs for c in run.chunks):
        # Only padding rows here (short documents end in other ranks' chunks), so no query read the
        # gathered K/V. The all-gather's backward is a reduce-scatter that every CP rank must join:
        # keep the gathered rows in this rank's graph (a zero contribution), or the others hang.
        out_tHD = out_tHD + kv_TCD[:1].sum() * 0
    return out_tHD
