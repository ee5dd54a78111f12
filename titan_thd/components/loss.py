"""Token cross-entropy as a SUM over trained tokens (docs/design.md §3.5).

The trainer divides the sum once by the global number of trained tokens of the optimizer step
(all microbatches, all data- and context-parallel ranks). Returning a sum rather than a mean keeps
that division in one place, so the loss and its gradients do not depend on how the step's tokens
are split into microbatches or ranks.

Under tensor parallelism the LM head is vocabulary-parallel: its logits are a `Shard(-1)` DTensor
([T, V/tp] on each tp rank) and the cross-entropy runs under `loss_parallel` (torch computes the
softmax denominator and the target logit with two small all-reduces over tp), so the full [T, V]
logits never exist on one rank. `loss_context` must cover the forward AND the backward.

Under `loss.chunked` a model returns a `HeadInput` (the head's input and weight) in place of its
logits (`model(tokens, meta, loss_chunk=C)`), and the same sum is computed chunk by chunk without the
[T, V] logits (components/chunked_loss.py), vocabulary-parallel heads included.

Legend:
    T  rows of this rank's microbatch
    V  vocabulary size
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from titan_thd.components.chunked_loss import HeadInput, head_cross_entropy_sum
from titan_thd.data.packed_batch import IGNORE_INDEX


def trained_labels(labels_T: torch.Tensor, loss_mask_T: torch.Tensor | None) -> torch.Tensor:
    """Labels with every untrained row (loss_mask False) set to IGNORE_INDEX."""
    if loss_mask_T is None:
        return labels_T
    return labels_T.masked_fill(~loss_mask_T.bool(), IGNORE_INDEX)


def cross_entropy_sum(
    logits_TV: torch.Tensor | HeadInput, labels_T: torch.Tensor, loss_mask_T: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of per-token cross-entropy over rows whose label is trained (a scalar).

    Logits below float32 (bf16) are upcast inside the loss so the softmax runs in fp32; float64
    logits stay float64 (reference computations in tests). Vocabulary-parallel logits (a DTensor,
    inside `loss_context`) give the same sum on every tp rank, returned as a plain tensor. A
    `HeadInput` (loss.chunked) gives the same sum without the logits.
    """
    labels_T = trained_labels(labels_T, loss_mask_T)
    if isinstance(logits_TV, HeadInput):
        return head_cross_entropy_sum(logits_TV, labels_T)
    logits_TV = logits_TV.to(torch.promote_types(logits_TV.dtype, torch.float32))
    ce = F.cross_entropy(logits_TV, labels_T, ignore_index=IGNORE_INDEX, reduction="sum")
    return ce.to_local() if isinstance(ce, DTensor) else ce


def loss_context(tensor_parallel: bool) -> contextlib.AbstractContextManager:
    """Wrap a microbatch's forward and backward: `loss_parallel` under tensor parallelism."""
    return loss_parallel() if tensor_parallel else contextlib.nullcontext()


def num_trained_tokens(labels_T: torch.Tensor, loss_mask_T: torch.Tensor | None = None) -> int:
    """Rows that contribute to `cross_entropy_sum`."""
    return int((trained_labels(labels_T, loss_mask_T) != IGNORE_INDEX).sum())
