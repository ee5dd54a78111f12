"""Packer: the samples of one microbatch -> a PackedBatch of at most T rows (docs/design.md §3.1).

Layout (see packed_batch.py for the full contract): documents in the given order, each padded to
a multiple of `pad_to_multiple`, then one padding document (real length 0) that fills the rest of
the rows: T of them, or with a `RowRule` (data/rows.py) only as many as the layout needs after the
last document (no compute is spent on tail padding). Everything is built with whole-array numpy
operations; there is no per-token Python loop.

Legend: T rows of the microbatch, R real tokens, N documents (including the padding document).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import numpy as np
import torch

from titan_thd.data.packed_batch import IGNORE_INDEX, PackedBatch
from titan_thd.data.rows import RowRule


class SampleLike(Protocol):
    input_ids: np.ndarray  # int [L]
    target_mask: np.ndarray  # bool [L]; True where token i is a trained target (index 0 never is)


def padded_lengths(lengths: np.ndarray, pad_to_multiple: int) -> np.ndarray:
    """Each length rounded up to a multiple of `pad_to_multiple`."""
    lengths = np.asarray(lengths, dtype=np.int64)
    return -(-lengths // pad_to_multiple) * pad_to_multiple


def pack_microbatch(
    samples: Sequence[SampleLike], T: int, pad_to_multiple: int, pad_id: int, rule: RowRule | None = None
) -> PackedBatch:
    """Concatenate `samples` into one THD microbatch of T rows (with `rule`: of `rule.rows(used)` rows);
    ValueError if they do not fit in T."""
    if pad_to_multiple < 1 or T % pad_to_multiple:
        raise ValueError(f"T = {T} must be a positive multiple of data.pad_to_multiple = {pad_to_multiple}")
    # The rule's rows hold whole padded documents, so they come in the documents' multiple.
    assert rule is None or (rule.T == T and (rule.fixed or rule.multiple % pad_to_multiple == 0)), (rule, T)
    seqlen_D = np.array([len(s.input_ids) for s in samples], dtype=np.int64)
    padded_D = padded_lengths(seqlen_D, pad_to_multiple)
    used = int(padded_D.sum())
    if used > T:
        raise ValueError(
            f"{len(samples)} samples of lengths {seqlen_D.tolist()} take {used} tokens after padding to a "
            f"multiple of {pad_to_multiple}, more than T = {T} tokens per microbatch"
        )
    T = T if rule is None else rule.rows(used)
    if used < T:  # the tail is one padding document of real length 0
        seqlen_N = np.append(seqlen_D, 0)
        padded_N = np.append(padded_D, T - used)
    else:
        seqlen_N, padded_N = seqlen_D, padded_D
    cu_N1 = np.concatenate([[0], np.cumsum(seqlen_N)])
    cup_N1 = np.concatenate([[0], np.cumsum(padded_N)])
    R = int(cu_N1[-1])

    ids_R = np.concatenate([np.asarray(s.input_ids) for s in samples]) if samples else np.zeros(0, np.int64)
    target_R = (
        np.concatenate([np.asarray(s.target_mask, dtype=bool) for s in samples])
        if samples
        else np.zeros(0, bool)
    )
    if target_R.shape != ids_R.shape:
        raise ValueError(f"target_mask has {target_R.size} entries for {ids_R.size} input ids")

    # Row of every real token: its document's physical start plus its offset inside the document.
    doc_R = np.repeat(np.arange(seqlen_N.size), seqlen_N)
    row_R = cup_N1[:-1][doc_R] + (np.arange(R) - cu_N1[:-1][doc_R])
    # A real token has a next token in its document unless it is the document's last one.
    has_next_R = np.ones(R, dtype=bool)
    has_next_R[cu_N1[1:][seqlen_N > 0] - 1] = False
    src = np.nonzero(has_next_R)[0]

    tokens_T = np.full(T, pad_id, dtype=np.int64)
    tokens_T[row_R] = ids_R
    labels_T = np.full(T, IGNORE_INDEX, dtype=np.int64)
    labels_T[row_R[src]] = ids_R[src + 1]
    loss_mask_T = np.zeros(T, dtype=bool)
    loss_mask_T[row_R[src]] = target_R[src + 1]
    position_T = np.arange(T, dtype=np.int64) - np.repeat(cup_N1[:-1], padded_N)

    return PackedBatch(
        tokens=torch.from_numpy(tokens_T),
        labels=torch.from_numpy(labels_T),
        loss_mask=torch.from_numpy(loss_mask_T),
        position_ids=torch.from_numpy(position_T),
        cu_seqlens=torch.from_numpy(cu_N1.astype(np.int32)),
        cu_seqlens_padded=torch.from_numpy(cup_N1.astype(np.int32)),
        max_seqlen=int(padded_N.max()),
        num_docs=int(seqlen_N.size),
    ).validate(pad_to_multiple)


def packer_throughput(
    num_tokens: int = 4_000_000, T: int = 4096, pad_to_multiple: int = 8, seed: int = 0
) -> float:
    """Tokens per second of `pack_microbatch` on one core, lognormal documents (median 300)."""

    class _Sample:
        def __init__(self, ids: np.ndarray, mask: np.ndarray):
            self.input_ids, self.target_mask = ids, mask

    rng = np.random.default_rng(seed)
    microbatches, total = [], 0
    while total < num_tokens:
        samples, used = [], 0
        while True:
            length = int(np.clip(rng.lognormal(np.log(300), 1.0), 2, T))
            if used + int(padded_lengths(np.array([length]), pad_to_multiple)[0]) > T:
                break
            mask = rng.random(length) < 0.7
            mask[0] = False
            samples.append(_Sample(rng.integers(0, 32000, length, dtype=np.int32), mask))
            used += int(padded_lengths(np.array([length]), pad_to_multiple)[0])
        microbatches.append(samples)
        total += T
    start = time.perf_counter()
    for samples in microbatches:
        pack_microbatch(samples, T, pad_to_multiple, pad_id=0)
    return total / (time.perf_counter() - start)
