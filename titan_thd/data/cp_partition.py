"""Context-parallel split of one packed microbatch (docs/design.md §3.3).

- zigzag: every document (physical length a multiple of 2*cp) is cut into 2*cp equal chunks; rank
  r takes chunks r and 2*cp-1-r of every document, document by document (Transformer Engine's
  `thd_get_partitioned_indices` order). Balances causal-attention work across ranks.
- contiguous: rank r takes rows [r*T/cp, (r+1)*T/cp); documents may straddle ranks. Needed by
  layers that read a contiguous left context (DSv4 sliding window and compressors).
- hybrid (Megatron's hybrid / dynamic CP, docs/data.md §4): documents whose padded length is below
  a threshold stay whole on one rank, so their attention needs no K/V from other ranks; only the
  longer ones are zigzagged. `hybrid_layout` decides, from the global lengths alone (every rank
  computes the same): the short documents go, longest first, to the rank with the least attention
  work (sum of len^2) that still has room; a document that fits nowhere is zigzagged instead (then
  the placement starts again), which always succeeds since zigzag gives every rank the same share.
  Each rank's rows: its zigzag chunks of the split documents (in zigzag order), then its whole
  documents, then its share of the padding documents' rows, so that every rank holds T / cp rows.

Token tensors become local; `row_index` records the rows of the full microbatch this rank holds;
metadata (cu_seqlens*, max_seqlen, num_docs) stays global.

Legend: T rows of the full microbatch, N documents, C = 2*N chunks of one rank, t = T / cp.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import torch

from titan_thd.data.packed_batch import TOKEN_FIELDS, PackedBatch
from titan_thd.parallel.context_parallel import CP_MODES, CPMode, check_layout


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
    t, t_dev = int(size_C.sum()), size_C.device  # row indices stay with cu_seqlens (the host)
    return torch.repeat_interleave(start_C - local_start_C, size_C, output_size=t) + torch.arange(
        t, device=t_dev
    )


class HybridLayout(NamedTuple):
    split: list[int]
    """Documents zigzagged over the CP group, in order."""
    whole: list[list[int]]
    """[rank] documents kept whole on that rank, in order."""
    filler: list[int]
    """[rank] rows of the padding documents (real length 0) that the rank holds."""


def hybrid_layout(seqlens: list[int], seqlens_padded: list[int], cp: int, threshold: int) -> HybridLayout:
    """Which documents hybrid CP splits and where the others go (module docstring); deterministic."""
    T = sum(seqlens_padded)
    assert T % cp == 0, (T, cp)
    real = [i for i, n in enumerate(seqlens) if n > 0]
    split = {i for i in real if seqlens_padded[i] >= threshold}
    short = sorted((i for i in real if i not in split), key=lambda i: (-seqlens_padded[i], i))
    while True:
        share = sum(seqlens_padded[i] for i in split) // cp
        room, work = [T // cp - share] * cp, [0] * cp
        whole: list[list[int]] = [[] for _ in range(cp)]
        for i in short:
            if i in split:
                continue
            p = seqlens_padded[i]
            fits = [r for r in range(cp) if room[r] >= p]
            if not fits:
                split.add(i)  # zigzag it: every rank's room shrinks by p / cp, so place again
                break
            r = min(fits, key=lambda r: (work[r], r))
            whole[r].append(i)
            room[r] -= p
            work[r] += seqlens[i] ** 2
        else:
            return HybridLayout(sorted(split), [sorted(w) for w in whole], room)


def hybrid_indices(cu_seqlens_padded: torch.Tensor, layout: HybridLayout, cp_rank: int) -> torch.Tensor:
    """[T / cp] int64 rows of the full microbatch that hybrid rank `cp_rank` holds, in order."""
    cup = cu_seqlens_padded.long()
    cp, host = len(layout.whole), cup.device  # row indices stay with cu_seqlens (the host)

    def rows(docs: list[int]) -> torch.Tensor:
        if not docs:
            return torch.zeros(0, dtype=torch.int64, device=host)
        return torch.cat([torch.arange(int(cup[i]), int(cup[i + 1]), device=host) for i in docs])

    split_rows = rows(layout.split)
    sizes = (
        (cup[1:] - cup[:-1])[layout.split] if layout.split else torch.zeros(0, dtype=torch.int64, device=host)
    )
    zz = zigzag_indices(
        torch.cat([torch.zeros(1, dtype=torch.int64, device=host), sizes.cumsum(0)]), cp, cp_rank
    )
    placed = set(layout.split).union(*layout.whole)
    padding = [i for i in range(cup.numel() - 1) if i not in placed]
    start = sum(layout.filler[:cp_rank])
    filler = rows(padding)[start : start + layout.filler[cp_rank]]
    return torch.cat([split_rows[zz], rows(layout.whole[cp_rank]), filler])


def partition(
    batch: PackedBatch, cp_size: int, cp_rank: int, mode: CPMode, hybrid_threshold: int = 0
) -> PackedBatch:
    """This CP rank's share of `batch`; the batch itself when cp_size == 1 or it holds no tokens.
    `hybrid_threshold`: the padded length from which hybrid mode splits a document."""
    if mode not in CP_MODES:
        raise ValueError(f"context parallel mode: got {mode!r}, expected one of {', '.join(CP_MODES)}")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is outside 0..{cp_size - 1}")
    if cp_size == 1 or all(getattr(batch, f) is None for f in TOKEN_FIELDS):
        return batch  # nothing to split; a middle pipeline stage carries metadata only
    if batch.row_index is not None:
        raise ValueError("this microbatch was already split for context parallelism (row_index is set)")
    T = batch.total_tokens
    if mode == "zigzag":
        rows_t = zigzag_indices(batch.cu_seqlens_padded, cp_size, cp_rank)
    elif mode == "hybrid":
        check_layout(cp=cp_size, mode=mode, T=T, where="T (training.tokens_per_microbatch)")
        layout = hybrid_layout(
            batch.seqlens.tolist(), batch.seqlens_padded.tolist(), cp_size, hybrid_threshold
        )
        rows_t = hybrid_indices(batch.cu_seqlens_padded, layout, cp_rank)
    else:
        check_layout(cp=cp_size, mode=mode, T=T, where="T (training.tokens_per_microbatch)")
        local = T // cp_size
        # on the batch's device, like the other modes' rows (indices into its token fields)
        rows_t = torch.arange(cp_rank * local, (cp_rank + 1) * local, device=batch.cu_seqlens_padded.device)
    local_tensors = {
        f: (getattr(batch, f)[rows_t] if getattr(batch, f) is not None else None) for f in TOKEN_FIELDS
    }
    return replace(batch, **local_tensors, row_index=rows_t)
