"""PackedBatch: one THD microbatch for one data-parallel replica (docs/design.md §3.1).

Legend (token-major, no batch dimension):
    T   rows of the microbatch: its documents rounded up to a multiple (data.trim_padding), at most
        `training.tokens_per_microbatch`; exactly that with pipeline parallelism (fixed shapes)
    N   documents in the microbatch, including the trailing padding document if any

Conventions that every producer and consumer relies on:
- Documents sit at physical offsets `cu_seqlens_padded[i] .. cu_seqlens_padded[i+1]`. The first
  `seqlens[i] = cu_seqlens[i+1] - cu_seqlens[i]` rows of that span are real tokens, the rest is
  padding (per-document alignment to `data.pad_to_multiple`). `cu_seqlens` is the *compact*
  cumulative sum of real lengths (as in Megatron / Transformer Engine), so real tokens of document
  i start at `cu_seqlens_padded[i]`, not at `cu_seqlens[i]`.
- The tail of a microbatch that no document fills is one padding document with real length 0.
- `position_ids[t] = t - cu_seqlens_padded[doc(t)]`: positions restart at 0 per document and keep
  counting through that document's padding.
- `labels[t]` is the next token of the same document (`tokens[t + 1]`) for every real row that has
  one, and `IGNORE_INDEX` on a document's last real row and on padding. Labels never cross a
  document boundary.
- `loss_mask[t]` (bool) says whether `labels[t]` is trained (assistant tokens for chat SFT, every
  label for pre-training text). It is False wherever `labels[t] == IGNORE_INDEX`. Models that need
  next tokens beyond the trained ones (multi-token prediction) read `labels` directly.
- After a context-parallel split the token tensors hold this rank's rows only, `row_index` maps
  them to rows of the full microbatch, and all metadata (`cu_seqlens*`, `max_seqlen`) stays global.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

IGNORE_INDEX = -100

TOKEN_FIELDS = ("tokens", "labels", "loss_mask", "position_ids")


@dataclass
class PackedBatch:
    tokens: torch.Tensor | None
    """[T] int64 input token ids (None on a pipeline stage that only needs metadata)."""
    labels: torch.Tensor | None
    """[T] int64 next-token targets inside each document, IGNORE_INDEX where there is none."""
    loss_mask: torch.Tensor | None
    """[T] bool, True where `labels` is trained."""
    position_ids: torch.Tensor | None
    """[T] int64 position of each row inside its document."""
    cu_seqlens: torch.Tensor
    """[N+1] int32 compact cumulative real document lengths."""
    cu_seqlens_padded: torch.Tensor
    """[N+1] int32 physical document boundaries; the last entry is T."""
    max_seqlen: int
    """Largest padded document length."""
    num_docs: int
    """N, stated explicitly (the trailing padding document counts)."""
    row_index: torch.Tensor | None = None
    """[T_local] int64 rows of the full microbatch held by this rank after a CP split, else None."""

    # ------------------------------------------------------------------ derived views
    @property
    def total_tokens(self) -> int:
        """T of the full (un-split) microbatch."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def seqlens(self) -> torch.Tensor:
        """[N] real length of every document."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    @property
    def seqlens_padded(self) -> torch.Tensor:
        """[N] physical length of every document."""
        return self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]

    @property
    def num_real_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    def real_token_mask(self) -> torch.Tensor:
        """[T] bool over the full microbatch: True on real (non-padding) rows."""
        starts = self.cu_seqlens_padded[:-1].long()
        host = starts.device  # next to cu_seqlens
        doc = torch.repeat_interleave(torch.arange(self.num_docs, device=host), self.seqlens_padded.long())
        offset = torch.arange(self.total_tokens, device=host) - starts[doc]
        return offset < self.seqlens.long()[doc]

    # ------------------------------------------------------------------ utilities
    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """Move token tensors to `device`; metadata stays on CPU (it is read by host code)."""
        moved = {
            f: (
                getattr(self, f).to(device, non_blocking=non_blocking)
                if getattr(self, f) is not None
                else None
            )
            for f in TOKEN_FIELDS
        }
        return replace(self, **moved)

    def validate(self, divisor: int = 1) -> PackedBatch:
        """Check the contract; raise ValueError with the numbers on any violation.

        `divisor`: every physical document length must be a multiple of it (e.g. 2*cp for zigzag).
        """
        cu, cup = self.cu_seqlens, self.cu_seqlens_padded
        if cu.dtype != torch.int32 or cup.dtype != torch.int32:
            raise ValueError(f"cu_seqlens dtypes must be int32, got {cu.dtype} and {cup.dtype}")
        if cu.ndim != 1 or cup.shape != cu.shape or cu.numel() != self.num_docs + 1:
            raise ValueError(
                f"cu_seqlens shape {tuple(cu.shape)} / cu_seqlens_padded shape {tuple(cup.shape)} "
                f"do not match num_docs + 1 = {self.num_docs + 1}"
            )
        if int(cu[0]) != 0 or int(cup[0]) != 0:
            raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])} and {int(cup[0])}")
        lens, plens = self.seqlens, self.seqlens_padded
        if (lens < 0).any() or (plens < 0).any():
            raise ValueError(f"cu_seqlens must be non-decreasing: {cu.tolist()} / {cup.tolist()}")
        if (lens > plens).any():
            bad = int(torch.nonzero(lens > plens)[0])
            raise ValueError(
                f"document {bad}: real length {int(lens[bad])} exceeds padded length {int(plens[bad])}"
            )
        if divisor > 1 and (plens % divisor != 0).any():
            bad = int(torch.nonzero(plens % divisor != 0)[0])
            raise ValueError(
                f"document {bad}: padded length {int(plens[bad])} is not a multiple of {divisor}"
            )
        if self.num_docs and self.max_seqlen != int(plens.max()):
            raise ValueError(f"max_seqlen {self.max_seqlen} != largest padded length {int(plens.max())}")
        T = self.total_tokens
        expected = T if self.row_index is None else int(self.row_index.numel())
        for f in TOKEN_FIELDS:
            t = getattr(self, f)
            if t is not None and (t.ndim != 1 or t.numel() != expected):
                raise ValueError(f"{f} has shape {tuple(t.shape)}, expected [{expected}] (T={T})")
        return self

    def summary(self) -> str:
        return (
            f"PackedBatch(T={self.total_tokens}, docs={self.num_docs}, real={self.num_real_tokens}, "
            f"max_seqlen={self.max_seqlen})"
        )
