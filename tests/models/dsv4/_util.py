"""Shared helpers of the dsv4 tests: packed microbatches with per-document and tail padding."""

from __future__ import annotations

import dataclasses

import torch

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import IGNORE_INDEX, PackedBatch
from titan_thd.models.dsv4 import DSv4Args, build_dsv4, flavors


def micro(**overrides) -> DSv4Args:
    return dataclasses.replace(flavors["micro"], **overrides)


def build(args: DSv4Args, seed: int = 0, dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """Model with every parameter and bias buffer randomised (so zero-initialised ones are tested too)."""
    torch.manual_seed(seed)
    model = build_dsv4(args).to(dtype)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("gate.bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    return model


def packed(
    lengths: list[int], vocab: int, pad_to: int = 1, tail: int = 0, seed: int = 0, trained: float = 1.0
) -> tuple[torch.Tensor, PackedBatch]:
    """(tokens, batch) of documents of these real lengths, each padded to a multiple of `pad_to`,
    plus a trailing padding document of `tail` rows. Padding rows hold random garbage tokens, so a
    test fails if they influence anything real. `trained`: fraction of labels in the loss mask."""
    g = torch.Generator().manual_seed(seed)
    plens = [-(-L // pad_to) * pad_to for L in lengths] + ([tail] if tail else [])
    reals = list(lengths) + ([0] if tail else [])
    T = sum(plens)
    tokens = torch.randint(0, vocab, (T,), generator=g)
    labels = torch.full((T,), IGNORE_INDEX)
    start = 0
    for L, P in zip(reals, plens):
        labels[start : start + L - 1] = tokens[start + 1 : start + L]
        start += P
    mask = (labels != IGNORE_INDEX) & (torch.rand(T, generator=g) < trained)
    cu = torch.tensor([0] + reals, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_pad = torch.tensor([0] + plens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    pos = torch.cat([torch.arange(P) for P in plens])
    batch = PackedBatch(tokens, labels, mask, pos, cu, cu_pad, max(plens), len(plens)).validate()
    return tokens, batch


def doc_slices(batch: PackedBatch) -> list[slice]:
    """Rows of the real tokens of every non-empty document."""
    return [
        slice(int(s), int(s) + int(L))
        for s, L in zip(batch.cu_seqlens_padded[:-1], batch.seqlens)
        if int(L) > 0
    ]


def sub_batch(tokens: torch.Tensor, batch: PackedBatch, rows: slice) -> tuple[torch.Tensor, PackedBatch]:
    """One real document of `batch` as a microbatch of its own."""
    L = rows.stop - rows.start
    labels, mask = batch.labels[rows].clone(), batch.loss_mask[rows].clone()
    cu = torch.tensor([0, L], dtype=torch.int32)
    return tokens[rows], PackedBatch(tokens[rows], labels, mask, torch.arange(L), cu, cu, L, 1).validate()


def meta(batch: PackedBatch) -> BatchMeta:
    return BatchMeta.from_batch(batch)


def assert_loaded_and_first_ce(trainer, reference: torch.nn.Module) -> torch.Tensor:
    """The trainer's model holds exactly `reference`'s weights; returns `reference`'s CE sum on the
    trainer's first step batch (what its first logged loss must equal, over the trained tokens)."""
    loaded = trainer.model.state_dict()
    assert loaded.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        assert torch.equal(loaded[name], value), name
    step_batch = trainer.dataloader.steps[0]
    with torch.no_grad():
        return sum(
            cross_entropy_sum(reference(mb.tokens, BatchMeta.from_batch(mb)).logits, mb.labels, mb.loss_mask)
            for mb in step_batch.microbatches
        )
