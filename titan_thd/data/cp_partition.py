"""Context-parallel split of one packed microbatch (docs/design.md §3.3).

- zigzag: every document (physical length a multiple of 2*cp) is cut into 2*cp equal chunks; rank
  r takes chunks r and 2*cp-1-r of every document, document by document (Transformer Engine's
  `thd_get_partitioned_indices` order). Balances causal-attention work across ranks.
- contiguous: rank r takes rows [r*T/cp, (r+1)*T/cp); documents may straddle ranks. Needed by
  layers that read a contiguous left context (DSv4 sliding window and compressors).

Token tensors become local; `row_index` records the rows of the full microbatch this rank holds;
metadata (cu_seqlens*, max_seqlen, num_docs) stays global.

Legend: T rows of the full microbatch, N documents, C = 2*N chunks of one rank, t = T / cp.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from titan_thd.data.packed_batch import TOKEN_FIELDS, PackedBatch

MODES = ("zigzag", "contiguous")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def zigzag_indices(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """[T / cp] int64 rows of the full microbatch that zigzag rank `cp_rank` holds, in order."""
    cup_N1 = cu_seqlens_padded.long()
    len_N = cup_N1[1:] - cup_N1[:-1]
    if (len_N % (2 * cp_size) != 0).any():
        bad = int(torch.nonzero(len_N % (2 * cp_size) != 0)[0])
        T = int(cup_N1[-1])
        raise ValueError(
            f"zigzag CP with cp = {cp_size} cuts every document into {2 * cp_size} chunks, but document {bad} "
            f"has padded length {int(len_N[bad])} (not a multiple of {2 * cp_size}; rows "
            f"{int(cup_N1[bad])}..{int(cup_N1[bad + 1])} of T = {T}). Set data.pad_to_multiple to a multiple of "
            f"{2 * cp_size} and training.tokens_per_microbatch to a multiple of it (smallest valid T >= {T}: "
            f"{_round_up(T, 2 * cp_size)})"
        )
    chunk_N = len_N // (2 * cp_size)
    # Two chunks per document: chunk r, then chunk 2cp-1-r.
    start_C = torch.stack(
        [cup_N1[:-1] + cp_rank * chunk_N, cup_N1[:-1] + (2 * cp_size - 1 - cp_rank) * chunk_N], 1
    )
    start_C, size_C = start_C.reshape(-1), chunk_N.repeat_interleave(2)
    local_start_C = torch.cumsum(size_C, 0) - size_C
    t = int(size_C.sum())
    return torch.repeat_interleave(start_C - local_start_C, size_C, output_size=t) + torch.arange(t)


def partition(batch: PackedBatch, cp_size: int, cp_rank: int, mode: str) -> PackedBatch:
    """This CP rank's share of `batch`; the batch itself when cp_size == 1 or it holds no tokens."""
    if mode not in MODES:
        raise ValueError(
            f"parallelism.context_parallel_mode: got {mode!r}, expected one of {', '.join(MODES)}"
        )
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if cp_size == 1 or all(getattr(batch, f) is None for f in TOKEN_FIELDS):
        return batch  # nothing to split; a middle pipeline stage carries metadata only
    if batch.row_index is not None:
        raise ValueError("this microbatch was already split for context parallelism (row_index is set)")
    T = batch.total_tokens
    if mode == "zigzag":
        rows_t = zigzag_indices(batch.cu_seqlens_padded, cp_size, cp_rank)
    else:
        if T % cp_size:
            raise ValueError(
                f"contiguous CP with cp = {cp_size} needs T divisible by {cp_size}, got T = {T} "
                f"(training.tokens_per_microbatch; smallest valid T >= {T}: {_round_up(T, cp_size)})"
            )
        local = T // cp_size
        rows_t = torch.arange(cp_rank * local, (cp_rank + 1) * local)
    local_tensors = {
        f: (getattr(batch, f)[rows_t] if getattr(batch, f) is not None else None) for f in TOKEN_FIELDS
    }
    return replace(batch, **local_tensors, row_index=rows_t)
