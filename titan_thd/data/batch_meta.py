"""BatchMeta: everything a model reads about one packed microbatch besides its token ids.

docs/design.md §3.4: `model(tokens_T, meta)`. The metadata object is built once per microbatch on
the host, shared by every layer, and carries the context-parallel context. Layers never guess
document boundaries from token values; they derive what they need (window plans, compression
plans, zigzag offsets) from the global `cu_seqlens*` and cache it in `meta.cache` so that the work
is done once per microbatch, not once per layer.

Legend:
    T        rows of the full microbatch (before the CP split)
    T_local  rows held by this rank (T / cp)
    N        documents (including a trailing padding document)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from titan_thd.data.packed_batch import PackedBatch
from titan_thd.parallel.context_parallel import CP_MODES, CPMode


@dataclass(frozen=True)
class CPContext:
    """Context-parallel context of this rank. size == 1 means no context parallelism."""

    size: int = 1
    rank: int = 0
    group: dist.ProcessGroup | None = None
    mode: CPMode = "contiguous"
    hybrid_threshold: int = 0
    """hybrid mode: documents with a padded length below this stay whole on one rank."""

    def __post_init__(self):
        assert self.mode in CP_MODES, self.mode
        assert 0 <= self.rank < self.size, (self.rank, self.size)
        assert self.size == 1 or self.group is not None, "CP > 1 needs a process group"

    @property
    def enabled(self) -> bool:
        return self.size > 1


@dataclass
class BatchMeta:
    cu_seqlens: torch.Tensor
    """[N+1] int32, CPU, global compact real boundaries."""
    cu_seqlens_padded: torch.Tensor
    """[N+1] int32, CPU, global physical boundaries."""
    max_seqlen: int
    num_docs: int
    position_ids: torch.Tensor
    """[T_local] int64 on the compute device: this rank's rows' positions inside their documents."""
    row_index: torch.Tensor | None
    """[T_local] int64, CPU: rows of the full microbatch held by this rank (None without CP)."""
    cp: CPContext = field(default_factory=CPContext)
    labels_full: torch.Tensor | None = None
    """[T] int64 labels of the full microbatch (for heads that look beyond this rank's rows)."""
    loss_mask_full: torch.Tensor | None = None
    """[T] bool loss mask of the full microbatch."""
    tokens: torch.Tensor | None = None
    """[T_local] int64 token ids of this rank's rows on the compute device (hash-routed layers on
    any pipeline stage read them here: a stage after the first gets hidden states, not ids)."""
    cache: dict[str, Any] = field(default_factory=dict)
    """Derived plans keyed by name, built lazily by `cached`."""

    @property
    def total_tokens(self) -> int:
        return int(self.cu_seqlens_padded[-1])

    @property
    def local_tokens(self) -> int:
        return int(self.position_ids.numel())

    @property
    def seqlens(self) -> list[int]:
        return self.cached("seqlens", lambda: (self.cu_seqlens[1:] - self.cu_seqlens[:-1]).tolist())

    @property
    def seqlens_padded(self) -> list[int]:
        return self.cached(
            "seqlens_padded", lambda: (self.cu_seqlens_padded[1:] - self.cu_seqlens_padded[:-1]).tolist()
        )

    @property
    def device(self) -> torch.device:
        return self.position_ids.device

    def cached(self, key: str, build: Callable[[], Any]) -> Any:
        """Return `cache[key]`, building it on first use (plans shared by all layers)."""
        if key not in self.cache:
            self.cache[key] = build()
        return self.cache[key]

    @classmethod
    def from_batch(
        cls,
        batch: PackedBatch,
        cp: CPContext | None = None,
        full: PackedBatch | None = None,
        device: torch.device | str | None = None,
    ) -> BatchMeta:
        """Build the metadata for `batch` (this rank's rows; `full` is the un-split microbatch)."""
        cp = cp or CPContext()
        assert batch.position_ids is not None, "BatchMeta needs position_ids"
        device = device if device is not None else batch.position_ids.device
        src = full if full is not None else batch
        return cls(
            cu_seqlens=batch.cu_seqlens.cpu(),
            cu_seqlens_padded=batch.cu_seqlens_padded.cpu(),
            max_seqlen=batch.max_seqlen,
            num_docs=batch.num_docs,
            position_ids=batch.position_ids.to(device),
            row_index=None if batch.row_index is None else batch.row_index.cpu(),
            cp=cp,
            labels_full=None if src.labels is None else src.labels.to(device),
            loss_mask_full=None if src.loss_mask is None else src.loss_mask.to(device),
            tokens=None if batch.tokens is None else batch.tokens.to(device),
        )
