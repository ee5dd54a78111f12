"""zigzag_attention's per-microbatch plan on the worked layout of docs/thd_reference.md §2.5 / §3.1
(no process group needed: the plan is built before any collective), and its refusals.
The numerical parity on 2 and 4 gloo processes lives in tests/models/test_llama_cp.py."""

from __future__ import annotations

import pytest
import torch

from tests.ops.test_varlen_attention import packed_positions, qkv
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition
from titan_thd.ops.cp_attention import zigzag_attention, zigzag_plan
from titan_thd.ops.varlen_attention import varlen_attention

# docs/thd_reference.md §2.5 / §3.1: lengths 5, 9, 3 padded to 8, 12, 4 (cp = 2), T = 24; each rank's rows.
RANK_ROWS = [[0, 1, 6, 7, 8, 9, 10, 17, 18, 19, 20, 23], [2, 3, 4, 5, 11, 12, 13, 14, 15, 16, 21, 22]]
# (q_rows, k_rows) of the (early, late) chunk of every document: rank 0 holds chunks 0 and 3, rank 1
# chunks 1 and 2. E.g. document 0 (S = 2): chunk 2 is positions 4, 5 of which only 4 is real, and it
# reads keys 0..4; chunk 3 (positions 6, 7) is padding. 6 real queries on rank 0, 11 on rank 1.
CHUNKS = [
    [((2, 2), (0, 6)), ((3, 3), (0, 9)), ((1, 1), (0, 3))],
    [((2, 4), (1, 5)), ((3, 6), (3, 9)), ((1, 2), (1, 3))],
]


def zigzag_meta(lens: list[int], pad_to: int, T: int | None, cp: int, rank: int, mode: str = "zigzag"):
    full = packed_positions(lens, pad_to, T)
    local = partition(full, cp, rank, "zigzag")
    return BatchMeta.from_batch(local, cp=CPContext(cp, rank, group=object(), mode=mode), full=full)


@pytest.mark.parametrize("rank", [0, 1])
def test_plan_of_the_worked_example(rank):
    meta = zigzag_meta([5, 9, 3], pad_to=4, T=None, cp=2, rank=rank)
    assert meta.row_index.tolist() == RANK_ROWS[rank]
    plan = zigzag_plan(meta)
    gathered_T = torch.tensor(RANK_ROWS[0] + RANK_ROWS[1])
    assert torch.equal(gathered_T[plan.gather_order_T], torch.arange(24))
    assert [r.count for r in plan.runs] == [1, 1, 1]
    got = [tuple((c.q_rows, c.k_rows) for c in run.chunks) for run in plan.runs]
    assert got == CHUNKS[rank]
    for run in plan.runs:
        for c in run.chunks:
            c_global = rank if c.index == 0 else 3 - rank
            if c_global == 0 or c.q_rows == 0:
                assert c.mask is None  # top-left `is_causal` is exact for the square first chunk
                continue
            # Query i sits at document position c*S + i and sees keys 0..c*S + i.
            pos_q = c_global * run.chunk + torch.arange(c.q_rows)
            assert torch.equal(c.mask, torch.arange(c.k_rows)[None, :] <= pos_q[:, None])


def test_equal_documents_share_one_call_and_masks_are_shared():
    meta = zigzag_meta([7, 7, 7, 3, 6], pad_to=4, T=40, cp=2, rank=1)
    plan = zigzag_plan(meta)
    assert [(r.count, r.real, r.padded) for r in plan.runs] == [(3, 7, 8), (1, 3, 4), (1, 6, 8), (1, 0, 4)]
    assert all(c.q_rows == 0 for c in plan.runs[-1].chunks)  # the tail padding document: zeros
    # Documents of 7 and 6 tokens (S = 2): chunk 1 reads (2, 4), chunk 2 (2, 6): one mask per shape.
    for seven, six in zip(plan.runs[0].chunks, plan.runs[2].chunks):
        assert (seven.q_rows, seven.k_rows) == (six.q_rows, six.k_rows) and seven.mask is six.mask


def test_refuses_a_contiguous_split():
    meta = zigzag_meta([4, 4], pad_to=4, T=None, cp=2, rank=0, mode="contiguous")
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match=r"context parallel mode 'contiguous' is not supported"):
        varlen_attention(q, k, v, meta)
    meta = zigzag_meta([4, 4], pad_to=4, T=None, cp=2, rank=0)
    meta.row_index = torch.arange(4)  # what a contiguous split of rank 0 holds
    with pytest.raises(ValueError, match=r"must hold chunks 0 and 3 of every document"):
        zigzag_attention(q, k, v, meta)


def test_document_not_a_multiple_of_2cp_names_the_numbers():
    meta = zigzag_meta([4, 4], pad_to=4, T=None, cp=2, rank=0)
    meta.cu_seqlens_padded = torch.tensor([0, 2, 8], dtype=torch.int32)  # hand-built, misaligned
    q, k, v = qkv(4)
    with pytest.raises(ValueError, match=r"document 0 has padded length 2 \(not a multiple of 4.*T >= 8: 8"):
        zigzag_attention(q, k, v, meta)


def test_a_rank_of_padding_only_still_joins_the_all_gather_backward(monkeypatch):
    """Documents of 2 tokens padded to 8 under cp = 4: rank 3 holds chunks 3 and 4, all padding, so no
    query of it reads K/V. The all-gather's backward is a reduce-scatter every CP rank must call; its
    output must stay in rank 3's graph, or the other ranks hang in it (seen under zigzag CP 4)."""
    cp, backwards = 4, []

    class Gather(torch.autograd.Function):  # all_gather_rows with every rank holding these rows
        @staticmethod
        def forward(ctx, x):
            return x.repeat(cp, 1, 1)

        @staticmethod
        def backward(ctx, g):
            backwards.append(g.shape)
            return g.unflatten(0, (cp, -1)).sum(0)

    monkeypatch.setattr("titan_thd.ops.cp_attention.all_gather_rows", lambda x, group: Gather.apply(x))
    for rank, real_queries in ((3, False), (0, True)):
        meta = zigzag_meta([2, 2], pad_to=8, T=None, cp=cp, rank=rank)
        plan = zigzag_plan(meta)
        assert any(c.q_rows for run in plan.runs for c in run.chunks) == real_queries
        q, k, v = qkv(4, grad=True)
        zigzag_attention(q, k, v, meta).sum().backward()
        assert len(backwards) == 1, rank
        backwards.clear()
