"""The token cross-entropy sum from the hidden states and the LM head's weight, chunk by chunk
(`loss.chunked`): the [T, V] logits never exist, only one chunk's [C, V] at a time.

    ce = cross_entropy_sum(HeadInput(x_TD, head, chunk), labels_T, loss_mask_T)   # components/loss.py

Forward: for each chunk of C trained rows, logits_CV = x_CD @ w_VD^T (in the head's dtype, as the
head computes them), upcast to float32 at least, their log-sum-exp and the target's logit; the loss
is the sum of (lse - target). Only x_TD (the head's input, which the head's matmul would save too),
the weight, the trained rows and their lse_R are kept. Backward: each chunk's logits are made again,
softmax - one-hot times the incoming gradient is the chunk's logit gradient (cast to the head's dtype,
as the upcast's backward does), and from it the chunk's rows of dX and its share of dW (accumulated
in float32 at least). So the loss and the gradients are today's (components/loss.py `F.cross_entropy`
on the full logits) up to the order of the sums; the price is one more head matmul per step.

Vocabulary-parallel head (tensor parallelism, the head's weight a `Shard(0)` DTensor over tp): each tp
rank holds V/tp columns of every chunk's logits; the row maximum, the sum of exponentials and the
target logit are all-reduced over tp (forward only: the backward needs no collective, its lse is
the global one). The head's input rows are gathered over tp as the head's ColwiseParallel would
(sequence-parallel rows), and dX, a partial sum over the tp ranks' vocabulary slices, is
reduce-scattered back by DTensor's backward.

Legend:  T rows   R trained rows   C rows of a chunk   D model width   V vocabulary (this rank's V/tp)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from titan_thd.config import Loss
from titan_thd.data.packed_batch import IGNORE_INDEX


def loss_chunk(loss: Loss) -> int:
    """The [loss] section's rows per chunk (0: the loss from the full [T, V] logits)."""
    return loss.chunk_tokens if loss.chunked else 0


class HeadInput(NamedTuple):
    """What a model returns in place of its logits under `loss.chunked` (`model(..., loss_chunk=C)`):
    the LM head's input and weight, whose logits the loss makes chunk by chunk."""

    x_TD: torch.Tensor
    """The head's input rows (under tensor parallelism this rank's sequence-parallel rows)."""
    weight_VD: torch.Tensor
    """The LM head's weight (it has no bias) as the model's forward reads it: inside the forward, so
    FSDP's gathered copy (the root unit's, kept until the backward); a `Shard(0)` DTensor over tp
    when vocabulary-parallel."""
    chunk: int
    """Trained rows per chunk."""

    @classmethod
    def of(cls, x_TD: torch.Tensor, head: nn.Linear, chunk: int) -> HeadInput:
        assert head.bias is None, "the LM head has no bias"
        return cls(x_TD, head.weight, chunk)


def head_cross_entropy_sum(inp: HeadInput, labels_T: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over the rows whose label is not IGNORE_INDEX (`labels_T` already masked:
    components/loss.py `trained_labels`), a plain scalar in float32 at least."""
    x_TD, w_VD, group, start = inp.x_TD, inp.weight_VD, None, 0
    if isinstance(w_VD, DTensor):  # vocabulary-parallel: this rank's V/tp rows of the weight
        mesh = w_VD.device_mesh  # (FSDP's sharded weight is never seen here: read inside the forward)
        assert mesh.mesh_dim_names in (None, ("tp",)) and w_VD.placements == (Shard(0),), w_VD
        if not isinstance(x_TD, DTensor):  # this rank's sequence-parallel rows (ColwiseParallel's input)
            x_TD = DTensor.from_local(x_TD, mesh, [Shard(0)], run_check=False)
        # All rows on every tp rank; dX is a partial sum over tp, reduce-scattered in the backward.
        x_TD = x_TD.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        w_VD = w_VD.to_local()
        group, start = mesh.get_group(), mesh.get_local_rank() * w_VD.shape[0]
    assert labels_T.shape == x_TD.shape[:1], (labels_T.shape, x_TD.shape)
    return _ChunkedCrossEntropy.apply(x_TD, w_VD, labels_T, inp.chunk, start, group)


class _ChunkedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, w_VD, labels_T, chunk, start, group):
        acc = torch.promote_types(x_TD.dtype, torch.float32)  # the loss's softmax dtype (loss.py)
        rows_R = (labels_T != IGNORE_INDEX).nonzero().squeeze(1)  # untrained rows get no logits
        lse_R = torch.empty(rows_R.shape[0], dtype=acc, device=x_TD.device)
        total = torch.zeros((), dtype=acc, device=x_TD.device)
        for r0 in range(0, rows_R.shape[0], chunk):
            rows_C = rows_R[r0 : r0 + chunk]
            logits_CV = _logits(x_TD, w_VD, rows_C, acc)
            local_C, here_C = _local_targets(labels_T[rows_C], start, w_VD.shape[0])
            target_C = torch.where(here_C, logits_CV.gather(1, local_C[:, None]).squeeze(1), 0.0)
            max_C = logits_CV.amax(1)
            if group is not None:
                dist.all_reduce(max_C, op=dist.ReduceOp.MAX, group=group)
            sums_2C = torch.stack([logits_CV.sub_(max_C[:, None]).exp_().sum(1), target_C])
            if group is not None:
                dist.all_reduce(sums_2C, group=group)
            lse_C = max_C + sums_2C[0].log()
            lse_R[r0 : r0 + chunk] = lse_C
            total += (lse_C - sums_2C[1]).sum()
        ctx.save_for_backward(x_TD, w_VD, labels_T, rows_R, lse_R)
        ctx.chunk, ctx.start = chunk, start
        return total

    @staticmethod
    def backward(ctx, grad):
        x_TD, w_VD, labels_T, rows_R, lse_R = ctx.saved_tensors
        want_x, want_w = ctx.needs_input_grad[:2]
        acc = lse_R.dtype
        dx_TD = torch.zeros_like(x_TD) if want_x else None
        wide = torch.promote_types(w_VD.dtype, acc)  # dW summed over chunks in float32 at least
        dw_VD = torch.zeros(w_VD.shape, dtype=wide, device=w_VD.device) if want_w else None  # LoRA: frozen
        for r0 in range(0, rows_R.shape[0], ctx.chunk):
            rows_C = rows_R[r0 : r0 + ctx.chunk]
            # softmax - one-hot, times the incoming gradient: the chunk's logit gradient.
            g_CV = _logits(x_TD, w_VD, rows_C, acc).sub_(lse_R[r0 : r0 + ctx.chunk, None]).exp_()
            local_C, here_C = _local_targets(labels_T[rows_C], ctx.start, w_VD.shape[0])
            g_CV.scatter_add_(1, local_C[:, None], -here_C.to(acc)[:, None])
            g_CV = g_CV.mul_(grad).to(x_TD.dtype)  # the upcast's backward casts it back
            if dx_TD is not None:
                dx_TD.index_copy_(0, rows_C, g_CV @ w_VD)
            if dw_VD is not None and dw_VD.dtype == g_CV.dtype:  # in place: no [V, D] temporary
                dw_VD.addmm_(g_CV.t(), x_TD.index_select(0, rows_C))
            elif dw_VD is not None:
                dw_VD += g_CV.t() @ x_TD.index_select(0, rows_C)
        dw_VD = None if dw_VD is None else dw_VD.to(w_VD.dtype)
        return dx_TD, dw_VD, None, None, None, None


def _logits(x_TD: torch.Tensor, w_VD: torch.Tensor, rows_C: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """[C, V] logits of the rows `rows_C` in `acc`: the head's matmul in its own dtype, then the upcast."""
    return F.linear(x_TD.index_select(0, rows_C), w_VD).to(acc)


def _local_targets(labels_C: torch.Tensor, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(column of each row's target in this rank's vocabulary slice [start, start + n), clamped into
    it; whether the target is in the slice)."""
    local_C = labels_C - start
    here_C = (local_C >= 0) & (local_C < n)
    return local_C.clamp(0, n - 1), here_C
