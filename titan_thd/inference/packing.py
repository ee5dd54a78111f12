"""Sequences packed back to back into one THD microbatch, for the decoders' forward passes."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from titan_thd.data.batch_meta import BatchMeta


def packed_meta(lengths: Sequence[int], tokens_T: torch.Tensor) -> BatchMeta:
    """BatchMeta of sequences of these lengths packed back to back (no padding)."""
    cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0).to(torch.int32)
    positions = torch.cat([torch.arange(n, device=tokens_T.device) for n in lengths])
    return BatchMeta(cu, cu, max(lengths), len(lengths), positions, None, tokens=tokens_T)


def last_rows(lengths: Sequence[int]) -> torch.Tensor:
    """Row of every sequence's last token in the packed microbatch."""
    return torch.tensor(lengths, dtype=torch.int64).cumsum(0) - 1
