"""varlen_attention against independent references, in float64 (max abs error <= 1e-10)."""

from __future__ import annotations

import math

import pytest
import torch

from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.ops.varlen_attention import dense_reference_attention, varlen_attention

TOL = 1e-10


def packed_meta(lens: list[int], pad_to: int = 1, T: int | None = None) -> BatchMeta:
    """BatchMeta of documents of real lengths `lens`, each padded to a multiple of `pad_to`,
    followed by a tail padding document up to `T` (tests build batches by hand, not via the packer)."""
    return BatchMeta.from_batch(packed_positions(lens, pad_to, T))


def packed_positions(lens: list[int], pad_to: int = 1, T: int | None = None) -> PackedBatch:
    """The PackedBatch behind `packed_meta`: metadata and position ids only."""
    plens = [math.ceil(n / pad_to) * pad_to for n in lens]
    if T is not None and T > sum(plens):
        lens, plens = lens + [0], plens + [T - sum(plens)]
    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cup = torch.tensor([0] + plens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = torch.cat([torch.arange(p) for p in plens])
    return PackedBatch(None, None, None, positions, cu, cup, max(plens), len(lens)).validate()


def doc_rows(meta: BatchMeta) -> list[slice]:
    """Physical rows of the real tokens of every document."""
    starts = meta.cu_seqlens_padded.tolist()
    return [slice(s, s + n) for s, n in zip(starts, meta.seqlens)]


def naive_causal(q_LHD: torch.Tensor, k_LKD: torch.Tensor, v_LKD: torch.Tensor) -> torch.Tensor:
    """One document alone: explicit softmax(q k^T / sqrt(D) + causal) v, KV heads repeated."""
    L, H, D = q_LHD.shape
    rep = H // k_LKD.shape[1]
    k_LHD, v_LHD = k_LKD.repeat_interleave(rep, 1), v_LKD.repeat_interleave(rep, 1)
    s_HLL = torch.einsum("qhd,khd->hqk", q_LHD, k_LHD) / math.sqrt(D)
    s_HLL = s_HLL.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("hqk,khd->qhd", s_HLL.softmax(-1), v_LHD)


def qkv(T: int, H: int = 4, K: int = 2, D: int = 8, seed: int = 0, grad: bool = False):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, D, generator=g, dtype=torch.float64, requires_grad=grad) for h in (H, K, K)]


CASES = [
    # (real lengths, pad_to, T)
    ([5, 17, 1, 32, 9], 1, None),
    ([5, 17, 1, 32, 9], 4, 96),  # per-document padding and a tail padding document
    ([8, 8, 8, 3, 3, 8], 1, 48),  # runs of equal lengths are batched into one SDPA call
    ([6, 6, 6, 7, 6], 4, 40),  # equal real and padded lengths, padding inside a batched run
]


@pytest.mark.parametrize("lens,pad_to,T", CASES)
def test_packed_equals_each_document_alone(lens, pad_to, T):
    meta = packed_meta(lens, pad_to, T)
    q, k, v = qkv(meta.total_tokens)
    out = varlen_attention(q, k, v, meta)
    real = torch.zeros(meta.total_tokens, dtype=torch.bool)
    for rows in doc_rows(meta):
        real[rows] = True
        if rows.stop > rows.start:
            torch.testing.assert_close(out[rows], naive_causal(q[rows], k[rows], v[rows]), rtol=0, atol=TOL)
    assert torch.equal(out[~real], torch.zeros_like(out[~real])), "padding rows must be zero"


@pytest.mark.parametrize("lens,pad_to,T", CASES)
def test_matches_dense_mask_reference_forward_and_backward(lens, pad_to, T):
    meta = packed_meta(lens, pad_to, T)
    inputs = qkv(meta.total_tokens, grad=True)
    grad_out = torch.randn(inputs[0].shape, dtype=torch.float64)
    results = []
    for attention in (varlen_attention, dense_reference_attention):
        out = attention(*inputs, meta, scale=0.3)
        results.append((out, *torch.autograd.grad(out, inputs, grad_out)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=TOL)


def test_padding_does_not_change_real_outputs():
    lens = [7, 12, 3, 20]
    compact, padded = packed_meta(lens), packed_meta(lens, pad_to=8, T=80)
    q, k, v = qkv(compact.total_tokens, seed=1)
    # Padding rows get unrelated values: they must not leak into real rows.
    qp, kp, vp = qkv(padded.total_tokens, seed=2)
    for src, dst in zip(doc_rows(compact), doc_rows(padded)):
        for big, small in ((qp, q), (kp, k), (vp, v)):
            big[dst] = small[src]
    out_c, out_p = varlen_attention(q, k, v, compact), varlen_attention(qp, kp, vp, padded)
    for src, dst in zip(doc_rows(compact), doc_rows(padded)):
        torch.testing.assert_close(out_p[dst], out_c[src], rtol=0, atol=TOL)


def test_no_gradient_crosses_documents():
    meta = packed_meta([6, 9, 4, 11], pad_to=4, T=48)
    inputs = qkv(meta.total_tokens, grad=True)
    out = varlen_attention(*inputs, meta)
    for i, rows_i in enumerate(r for r in doc_rows(meta) if r.stop > r.start):
        weight = torch.randn(out[rows_i].shape, dtype=torch.float64)
        grads = torch.autograd.grad((out[rows_i] * weight).sum(), inputs, retain_graph=True)
        for g in grads:
            own = torch.zeros(meta.total_tokens, dtype=torch.bool)
            own[rows_i] = True
            assert torch.equal(g[~own], torch.zeros_like(g[~own])), f"document {i} leaks gradient"
            assert g[own].abs().sum() > 0  # the check above is not vacuous


def test_gqa_equals_mha_with_repeated_kv():
    meta = packed_meta([10, 5, 13], pad_to=2, T=32)
    q, k, v = qkv(meta.total_tokens, H=6, K=2)
    mha = varlen_attention(q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), meta)
    torch.testing.assert_close(varlen_attention(q, k, v, meta), mha, rtol=0, atol=TOL)


def test_float32_close_to_float64():
    meta = packed_meta([30, 50, 20], pad_to=8, T=128)
    q, k, v = qkv(meta.total_tokens)
    out32 = varlen_attention(q.float(), k.float(), v.float(), meta)
    torch.testing.assert_close(out32.double(), varlen_attention(q, k, v, meta), rtol=0, atol=1e-5)


def test_runs_of_equal_documents_share_one_call():
    meta = packed_meta([8, 8, 8, 3, 3, 8], pad_to=4, T=48)
    q, k, v = qkv(meta.total_tokens)
    varlen_attention(q, k, v, meta)
    # (count, real, padded) per SDPA call; the tail padding document is one zero block.
    assert [tuple(s) for s in meta.cache["varlen_attention_segments"]] == [
        (3, 8, 8),
        (2, 3, 4),
        (1, 8, 8),
        (1, 0, 8),
    ]
