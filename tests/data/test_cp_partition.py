"""CP split tests: worked vectors of docs/thd_reference.md §3.1 / §3.2 and a per-document
reference loop for zigzag."""

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch

from titan_thd.data.cp_partition import partition, zigzag_indices
from titan_thd.data.packer import pack_microbatch
from titan_thd.data.token_store import Sample


def batch_of(lengths, T, mult, seed=0):
    rng = np.random.default_rng(seed)
    samples = []
    for n in lengths:
        mask = rng.random(n) < 0.5
        mask[0] = False
        samples.append(Sample(rng.integers(0, 100, n).astype(np.int32), mask))
    return pack_microbatch(samples, T, mult, pad_id=0)


def naive_zigzag(cup, cp, rank):
    rows = []
    for a, b in itertools.pairwise(cup):
        c = (b - a) // (2 * cp)
        rows += list(range(a + rank * c, a + (rank + 1) * c))
        rows += list(range(a + (2 * cp - 1 - rank) * c, a + (2 * cp - rank) * c))
    return rows


def test_zigzag_vectors_cp2():
    cup = torch.tensor([0, 8, 20, 24], dtype=torch.int32)
    assert zigzag_indices(cup, 2, 0).tolist() == [0, 1, 6, 7, 8, 9, 10, 17, 18, 19, 20, 23]
    assert zigzag_indices(cup, 2, 1).tolist() == [2, 3, 4, 5, 11, 12, 13, 14, 15, 16, 21, 22]


def test_zigzag_vectors_cp4():
    cup = torch.tensor([0, 8, 24, 32], dtype=torch.int32)
    expected = [
        [0, 7, 8, 9, 22, 23, 24, 31],
        [1, 6, 10, 11, 20, 21, 25, 30],
        [2, 5, 12, 13, 18, 19, 26, 29],
        [3, 4, 14, 15, 16, 17, 27, 28],
    ]
    assert [zigzag_indices(cup, 4, r).tolist() for r in range(4)] == expected


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_matches_reference_and_covers_every_row_once(cp):
    rng = np.random.default_rng(cp)
    cup = np.concatenate([[0], np.cumsum(rng.integers(0, 6, 9) * 2 * cp)])
    rows = [zigzag_indices(torch.tensor(cup, dtype=torch.int32), cp, r) for r in range(cp)]
    for r in range(cp):
        assert rows[r].dtype == torch.int64
        assert rows[r].tolist() == naive_zigzag(cup.tolist(), cp, r)
    assert sorted(torch.cat(rows).tolist()) == list(range(int(cup[-1])))


def test_zigzag_partition_of_section_2_5_layout():
    b = batch_of([5, 9, 3], T=24, mult=4)
    parts = [partition(b, 2, r, "zigzag") for r in range(2)]
    assert parts[0].position_ids.tolist() == [0, 1, 6, 7, 0, 1, 2, 9, 10, 11, 0, 3]
    assert parts[1].position_ids.tolist() == [2, 3, 4, 5, 3, 4, 5, 6, 7, 8, 1, 2]
    for r, p in enumerate(parts):
        assert p.row_index.tolist() == zigzag_indices(b.cu_seqlens_padded, 2, r).tolist()
        for f in ("tokens", "labels", "loss_mask", "position_ids"):
            assert torch.equal(getattr(p, f), getattr(b, f)[p.row_index])
        # Metadata stays global.
        assert torch.equal(p.cu_seqlens, b.cu_seqlens) and torch.equal(
            p.cu_seqlens_padded, b.cu_seqlens_padded
        )
        assert (p.max_seqlen, p.num_docs) == (b.max_seqlen, b.num_docs)
        p.validate()
    # Real tokens per rank differ (6 vs 11): tail padding lands in the last chunk, on rank 0.
    assert [int(b.real_token_mask()[p.row_index].sum()) for p in parts] == [6, 11]


def test_contiguous_partition():
    b = batch_of([5, 9, 3], T=24, mult=4)
    parts = [partition(b, 2, r, "contiguous") for r in range(2)]
    assert parts[0].row_index.tolist() == list(range(12)) and parts[1].row_index.tolist() == list(
        range(12, 24)
    )
    assert torch.equal(torch.cat([p.tokens for p in parts]), b.tokens)
    assert all(p.cu_seqlens_padded.tolist() == [0, 8, 20, 24] for p in parts)


def test_contiguous_does_not_need_per_document_padding():
    b = batch_of([5, 9, 3], T=18, mult=1)
    parts = [partition(b, 3, r, "contiguous") for r in range(3)]
    assert torch.equal(torch.cat([p.labels for p in parts]), b.labels)


def test_pass_through():
    b = batch_of([5, 3], T=8, mult=1)
    assert partition(b, 1, 0, "zigzag") is b
    meta_only = replace(b, tokens=None, labels=None, loss_mask=None, position_ids=None)
    assert partition(meta_only, 4, 2, "contiguous") is meta_only
    assert partition(meta_only, 4, 2, "zigzag") is meta_only


def test_errors():
    b17 = batch_of([5, 9, 3], T=17, mult=1)
    with pytest.raises(ValueError, match=r"divisible by 2, got T = 17 .*smallest valid T >= 17: 18"):
        partition(b17, 2, 0, "contiguous")
    b = batch_of([5, 9, 3], T=24, mult=2)  # padded 6, 10, 4, tail 4: document 0 is not a multiple of 4
    with pytest.raises(ValueError, match=r"document 0 has padded length 6 \(not a multiple of 4"):
        partition(b, 2, 0, "zigzag")
    good = batch_of([5, 9, 3], T=24, mult=4)
    with pytest.raises(ValueError, match="already split"):
        partition(partition(good, 2, 0, "zigzag"), 2, 0, "zigzag")
    with pytest.raises(ValueError, match="cp_rank 2 is outside 0..1"):
        partition(good, 2, 2, "zigzag")
    with pytest.raises(ValueError, match="context_parallel_mode"):
        partition(good, 2, 0, "ring")
