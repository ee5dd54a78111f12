"""The fast forms of the dsv4 kernels against their naive forms (float64; docs/dsv4.md §16).

- banded attention (window keys, HCA entry ranges) = per-query gathered keys = dense mask reference,
  forward and backward, with a CP-like halo, several documents, a partial last block;
- Sinkhorn with the written-out backward = the plain autograd iteration;
- the RMSNorms and the mHC mixing projection with written-out backwards = their formulas in plain
  autograd ops (and finite differences);
- the indexer KL from the attention kernel's lse = the KL that recomputes the window logits.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.indexer import Indexer, indexer_kl
from titan_thd.models.dsv4.mhc import (
    _mix,
    hc_post,
    hc_post_formula,
    mix_formula,
    sinkhorn,
    sinkhorn_reference,
)
from titan_thd.models.dsv4.norm import (
    rms_norm,
    rms_norm_formula,
    weighted_rms_norm,
    weighted_rms_norm_formula,
)
from titan_thd.models.dsv4.sparse_attention import dense_reference, sparse_mqa, window_band, with_entry_range

T, H, D, W, HALO, C = 45, 3, 8, 6, 2, 7
R = HALO + T


def _problem():
    g = torch.Generator().manual_seed(0)
    starts = torch.tensor([0, 10, 30])  # three documents
    doc = torch.bucketize(torch.arange(T), starts, right=True) - 1
    # BatchPlan.window_TW's form: query t's slot w is key row t + halo - W + 1 + w, or -1 before
    # the document start (the halo rows before query 0 belong to no document here).
    row_TW = torch.arange(T)[:, None] + HALO - W + 1 + torch.arange(W)
    window = torch.where(row_TW - HALO >= starts[doc][:, None], row_TW, -1)
    start_T = torch.tensor([0, 2, 4])[doc]
    n_vis_T = torch.randint(0, 3, (T,), generator=g)
    entries = torch.where(torch.arange(3) < n_vis_T[:, None], start_T[:, None] + torch.arange(3) + R, -1)
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(R + C, D, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    return window, start_T, n_vis_T, entries, q, kv, sink


@pytest.mark.parametrize("block", [4, 6, 16])
def test_banded_attention_equals_gathered_and_dense(block):
    window, start_T, n_vis_T, entries, q, kv, sink = _problem()
    band = window_band(window, HALO, block, R)
    listed = band.as_index(T)
    assert torch.equal(listed[listed >= 0].sort().values, window[window >= 0].sort().values)
    cases = {
        "sliding": (window, None, band),
        "csa": (torch.cat([window, entries], 1), entries, band),
        "hca": (torch.cat([window, entries], 1), None, with_entry_range(band, start_T, n_vis_T, R, R + C)),
    }
    w = torch.randn(T, H, D, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for kind, (idx_all, idx, b) in cases.items():
        allowed = torch.zeros(T, R + C, dtype=torch.bool)
        for t in range(T):
            allowed[t, idx_all[t][idx_all[t] >= 0]] = True
        fast, lse_fast = sparse_mqa(q, kv, idx, sink, 0.3, chunk=8, band=b)
        gathered, lse_gathered = sparse_mqa(q, kv, idx_all, sink, 0.3, chunk=8)
        dense = dense_reference(q, kv, allowed, sink, 0.3)
        torch.testing.assert_close(fast, dense, rtol=0, atol=1e-13, msg=kind)
        torch.testing.assert_close(fast, gathered, rtol=0, atol=1e-13, msg=kind)
        torch.testing.assert_close(lse_fast, lse_gathered, rtol=0, atol=1e-13, msg=kind)
        grads = torch.autograd.grad((fast * w).sum(), (q, kv, sink))
        for ref in (gathered, dense):
            for a, r in zip(grads, torch.autograd.grad((ref * w).sum(), (q, kv, sink))):
                torch.testing.assert_close(a, r, rtol=0, atol=1e-12, msg=kind)


def test_sinkhorn_backward_equals_autograd():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    fast, ref = sinkhorn(x, 20, 1e-6), sinkhorn_reference(x, 20, 1e-6)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-14)
    torch.testing.assert_close(fast.sum(-2), torch.ones(50, 4, dtype=torch.float64), rtol=0, atol=1e-5)
    w = torch.randn(50, 4, 4, generator=g, dtype=torch.float64)
    (a,) = torch.autograd.grad((fast * w).sum(), x)
    (b,) = torch.autograd.grad((ref * w).sum(), x)
    assert a.abs().max() > 1e-3
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


@pytest.mark.parametrize("shape", [(37, 16), (11, 3, 8)])
def test_rms_norms_backward_equals_autograd(shape):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(shape[-1], generator=g, dtype=torch.float64, requires_grad=True)
    out_g = torch.randn(*shape, generator=g, dtype=torch.float64)
    for fast, ref, args in (
        (weighted_rms_norm, weighted_rms_norm_formula, (x, w)),
        (rms_norm, rms_norm_formula, (x,)),
    ):
        a, b = fast(*args, 1e-6), ref(*args, 1e-6)
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
        ga = torch.autograd.grad((a * out_g).sum(), args)
        gb = torch.autograd.grad((b * out_g).sum(), args)
        for u, v in zip(ga, gb, strict=True):
            assert u.abs().max() > 1e-2
            torch.testing.assert_close(u, v, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(lambda a, b: weighted_rms_norm(a, b, 1e-6), (x[:4], w))
    # bfloat16 activations and weights: computed in float32 like the formula, the output back in bf16.
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    a, b = weighted_rms_norm(xb, wb, 1e-6), weighted_rms_norm_formula(xb, wb, 1e-6)
    assert a.dtype == torch.bfloat16 and torch.equal(a, b)
    ga, gb = torch.autograd.grad(a.float().sum(), (xb, wb)), torch.autograd.grad(b.float().sum(), (xb, wb))
    for u, v in zip(ga, gb, strict=True):
        assert u.dtype == torch.bfloat16
        torch.testing.assert_close(u.float(), v.float(), rtol=1e-2, atol=1e-2)


def test_mhc_mix_backward_equals_autograd():
    g = torch.Generator().manual_seed(4)
    h = torch.randn(29, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    fn = torch.randn(24, 32, generator=g, dtype=torch.float64, requires_grad=True)
    a, b = _mix(h, fn, 1e-6), mix_formula(h, fn, 1e-6)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
    out_g = torch.randn(29, 24, generator=g, dtype=torch.float64)
    ga, gb = torch.autograd.grad((a * out_g).sum(), (h, fn)), torch.autograd.grad((b * out_g).sum(), (h, fn))
    for u, v in zip(ga, gb, strict=True):
        assert u.abs().max() > 1e-2
        torch.testing.assert_close(u, v, rtol=0, atol=1e-12)
    assert torch.autograd.gradcheck(lambda x, f: _mix(x, f, 1e-6), (h[:3], fn))


def test_hc_post_backward_equals_autograd():
    g = torch.Generator().manual_seed(5)
    y = torch.randn(23, 8, generator=g, dtype=torch.float64, requires_grad=True)
    h = torch.randn(23, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    post = torch.rand(23, 4, generator=g, dtype=torch.float64, requires_grad=True)
    comb = torch.rand(23, 4, 4, generator=g, dtype=torch.float64, requires_grad=True)
    inputs = (y, h, post, comb)
    a, b = hc_post(*inputs), hc_post_formula(*inputs)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    out_g = torch.randn(23, 4, 8, generator=g, dtype=torch.float64)
    ga, gb = torch.autograd.grad((a * out_g).sum(), inputs), torch.autograd.grad((b * out_g).sum(), inputs)
    for u, v in zip(ga, gb, strict=True):
        assert u.abs().max() > 1e-2
        torch.testing.assert_close(u, v, rtol=0, atol=1e-13)
    assert torch.autograd.gradcheck(hc_post, tuple(x[:3].detach().requires_grad_() for x in inputs))
    # a bf16 sub-layer output on float32 streams (mixed precision): the gradient comes back in bf16
    yb = y.detach().bfloat16().requires_grad_()
    hf, pf, cf = (x.detach().float() for x in (h, post, comb))
    a, b = hc_post(yb, hf, pf, cf), hc_post_formula(yb, hf, pf, cf)
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    (gy,) = torch.autograd.grad(a.sum(), yb)
    assert gy.dtype == torch.bfloat16


def test_indexer_kl_from_kernel_lse_equals_recomputed():
    window, _start, _n_vis, entries, q, kv, sink = _problem()
    _, lse = sparse_mqa(q, kv, entries, sink, 0.3, chunk=8, band=window_band(window, HALO, 4, R))
    cand = torch.where(entries >= 0, entries - R, -1)
    student = torch.randn(T, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    common = {
        "q_THD": q,
        "kv_RD": kv[:R],
        "comp_CD": kv[R:],
        "sink_H": sink,
        "window_TW": window,
        "cand_TK": cand,
        "student_TK": student.masked_fill(cand < 0, -torch.inf),
        "row_ok_T": torch.ones(T, dtype=torch.bool),
        "scale": 0.3,
        "chunk": 8,
    }
    ref = indexer_kl(**common)
    assert ref > 1e-3
    torch.testing.assert_close(indexer_kl(**common, lse_TH=lse), ref, rtol=1e-13, atol=0)


def test_blocked_topk_selection_equals_per_query_reference():
    """Indexer.select (scores per query block over a shared entry run) picks, for every query, the
    k best of its own visible entries, ties to the lower entry index, like a per-query loop."""
    g = torch.Generator().manual_seed(3)
    lengths, m, HI, Di, k = [37, 130, 3, 90], 4, 2, 8, 5
    start_T = torch.cat([torch.full((L,), sum(x // m for x in lengths[:i])) for i, L in enumerate(lengths)])
    pos_T = torch.cat([torch.arange(L) for L in lengths])
    n_c_T = torch.cat([torch.full((L,), L // m) for L in lengths])
    plan = SimpleNamespace(start_T=start_T, n_vis_T=torch.minimum((pos_T + 1) // m, n_c_T))
    q = torch.randn(len(pos_T), HI, Di, generator=g, dtype=torch.float64)
    q[::7] = 0.0  # all-zero scores: exact ties among every visible entry
    w = torch.randn(len(pos_T), HI, generator=g, dtype=torch.float64)
    keys = torch.randn(int(sum(L // m for L in lengths)), Di, generator=g, dtype=torch.float64)
    indexer = Indexer(
        dataclasses.replace(
            flavors["micro"], index_topk=k, index_n_heads=HI, index_head_dim=Di, attn_chunk=64
        )
    )
    got = indexer.select(q, w, keys, plan)
    for t in range(len(pos_T)):
        cand = torch.arange(int(start_T[t]), int(start_T[t] + plan.n_vis_T[t]))
        score = (w[t, :, None] * torch.relu(q[t] @ keys[cand].T)).sum(0) * Di**-0.5
        order = torch.sort(-score, stable=True).indices[:k]
        want = sorted(cand[order].tolist())
        assert sorted(x for x in got[t].tolist() if x >= 0) == want, t
