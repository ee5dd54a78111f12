"""dsv4 attention against independent references (float64, micro flavor; docs/dsv4.md §14.5).

The dense references below are written from the THD rules of docs/dsv4.md §8 with plain Python loops
over (document, position), not from the plans the model uses.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import titan_thd.models.dsv4.attention as attention_mod
from tests.models.dsv4._util import build, doc_slices, meta, micro, packed, sub_batch
from titan_thd.models.dsv4.compressor import Compressor
from titan_thd.models.dsv4.indexer import _topk_mask_low_index_first
from titan_thd.models.dsv4.plans import get_plan
from titan_thd.models.dsv4.rope import cos_sin, inv_freq
from titan_thd.models.dsv4.sparse_attention import dense_reference, sparse_mqa

LAYER = {"sliding": "0", "csa": "1", "hca": "2"}  # micro layer types: sliding, csa, hca, csa
DOCS = {"lengths": [3, 37, 70, 16], "pad_to": 8, "tail": 13}  # < window, not /4, several HCA entries, == m'


def allowed_mask(batch, args, kind: str) -> torch.Tensor:
    """[T, T + C] keys each row may attend, from the rules: same document, window of n_win tokens,
    entry w of a document (floor(L/m) entries) visible from its last token (w+1)m-1 on."""
    T = batch.total_tokens
    rows = []  # (doc, pos, real length) per row
    for d, (start, end) in enumerate(
        zip(batch.cu_seqlens_padded[:-1].tolist(), batch.cu_seqlens_padded[1:].tolist())
    ):
        rows += [(d, t - start, int(batch.seqlens[d])) for t in range(start, end)]
    entries = []  # (doc, w)
    m = args.ratios.get(kind, 0)
    if m:
        for d, L in enumerate(batch.seqlens.tolist()):
            entries += [(d, w) for w in range(L // m)]
    mask = torch.zeros(T, T + len(entries), dtype=torch.bool)
    for t, (d, pos, _) in enumerate(rows):
        for s, (d2, pos2, _) in enumerate(rows):
            mask[t, s] = d2 == d and pos - args.window < pos2 <= pos
        for c, (d2, w) in enumerate(entries):
            mask[t, T + c] = d2 == d and (w + 1) * m - 1 <= pos
    return mask


def _compact(idx_TK: torch.Tensor, width: int) -> torch.Tensor:
    """The valid rows of each query first, -1 after, in `width` columns (no valid row dropped)."""
    out = idx_TK.sort(dim=1, descending=True).values
    assert width >= out.shape[1] or bool((out[:, width:] < 0).all())
    if out.shape[1] < width:
        out = torch.cat([out, out.new_full((out.shape[0], width - out.shape[1]), -1)], 1)
    return out[:, :width]


def capture_core(monkeypatch, window: int) -> list:
    """Calls of the attention kernel, each key set as an explicit [T, window + entries] row list
    (window keys in the first `window` columns), whatever form (band or list) the layer passed."""
    calls = []

    def spy(q, kv, idx, sink, scale, chunk, band=None):
        T, parts = q.shape[0], []
        if band is not None:
            L = band.block + window - 1
            full = band.as_index(T)
            parts = [_compact(full[:, :L], window), full[:, L:]]
        parts.append(idx if idx is not None else torch.full((T, 0), -1))
        entries = torch.cat(parts[1:], 1)
        calls.append((q, kv, torch.cat([parts[0], _compact(entries, entries.shape[1])], 1), sink, scale))
        return sparse_mqa(q, kv, idx, sink, scale, chunk, band=band)

    monkeypatch.setattr(attention_mod, "sparse_mqa", spy)
    return calls


def test_sparse_kernel_matches_dense_reference_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    T, H, D, S, K = 23, 3, 8, 31, 6
    allowed = torch.rand(T, S, generator=g) < 0.2
    allowed[0] = False  # a row with no key at all: only the sink
    idx = torch.full((T, K), -1)
    for t in range(T):
        keys = allowed[t].nonzero().flatten()[:K]
        allowed[t] = False
        allowed[t, keys] = True
        idx[t, torch.randperm(K, generator=g)[: len(keys)]] = keys
    q = torch.randn(T, H, D, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(S, D, generator=g, dtype=torch.float64, requires_grad=True)
    sink = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    out, _ = sparse_mqa(q, kv, idx, sink, 0.3, chunk=5)
    ref = dense_reference(q, kv, allowed, sink, 0.3)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    assert out[0].abs().max() == 0
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out * w).sum(), (q, kv, sink))
    ref_grads = torch.autograd.grad((ref * w).sum(), (q, kv, sink))
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_keys_follow_thd_rules_and_sparse_equals_dense(kind, monkeypatch):
    """With top-k >= entries the gathered keys of every row are exactly the rule-allowed set (window
    clipped at the document start, entries of its own document from (w+1)m-1 on), and the sparse
    kernel equals the dense-mask reference on it."""
    args = micro(index_topk=64)
    model = build(args).eval()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    calls = capture_core(monkeypatch, args.window)
    with torch.no_grad():
        model.layers[LAYER[kind]](
            model.embed(tokens)[:, None].expand(-1, 4, -1),
            tokens,
            get_plan(meta(batch), args, torch.float64),
            False,
        )
    q, kv, idx, sink, scale = calls[0]
    allowed = allowed_mask(batch, args, kind)
    got = torch.zeros_like(allowed)
    for t, row in enumerate(idx):
        keys = row[row >= 0]
        assert len(set(keys.tolist())) == len(keys), (t, row)
        got[t, keys] = True
    assert torch.equal(got, allowed)
    out, _ = sparse_mqa(q, kv, idx, sink, scale, chunk=17)
    torch.testing.assert_close(out, dense_reference(q, kv, allowed, sink, scale), rtol=0, atol=1e-13)


def test_entry_first_used_at_its_last_token(monkeypatch):
    """Visibility rule: entry w of a document is first attended by the query at (w+1)m - 1."""
    args = micro(index_topk=64)
    model = build(args).eval()
    tokens, batch = packed(lengths=[70], vocab=args.vocab_size)
    calls = capture_core(monkeypatch, args.window)
    with torch.no_grad():
        model(tokens, meta(batch))
    for layer_call, m in ((calls[1], args.csa_ratio), (calls[2], args.hca_ratio)):
        idx = layer_call[2][:, args.window :]
        first_use = [int((idx == 70 + w).any(1).nonzero()[0]) for w in range(70 // m)]
        assert first_use == [(w + 1) * m - 1 for w in range(70 // m)]


def test_csa_selects_topk_of_visible_entries(monkeypatch):
    args = micro()  # index_topk = 4
    model = build(args).eval()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    calls = capture_core(monkeypatch, args.window)
    with torch.no_grad():
        model(tokens, meta(batch))
    idx = calls[1][2][:, args.window :]
    allowed = allowed_mask(batch, args, "csa")[:, batch.total_tokens :]
    n_sel = (idx >= 0).sum(1)
    assert torch.equal(n_sel, allowed.sum(1).clamp(max=args.index_topk))
    for t in range(idx.shape[0]):
        chosen = idx[t][idx[t] >= 0] - batch.total_tokens
        assert allowed[t, chosen].all() and len(set(chosen.tolist())) == len(chosen)


@pytest.mark.parametrize("kind,ratio", [("csa", 4), ("hca", 16)])
def test_compressor_receptive_fields(kind, ratio):
    """Entry w depends exactly on the rows of its window (and of window w-1 with overlap), all in
    its own document; a document's first entry has no previous-window slots."""
    args = micro()
    overlap = kind == "csa"
    torch.manual_seed(0)
    comp = Compressor(args.dim, 16, ratio, overlap, args.norm_eps).double()
    with torch.no_grad():
        comp.ape.normal_()
    _tokens, batch = packed(lengths=[13, 9, 40], pad_to=4, vocab=args.vocab_size)
    plan = get_plan(meta(batch), args, torch.float64).compress[kind]
    x = torch.randn(batch.total_tokens, args.dim, dtype=torch.float64, requires_grad=True)
    entries = comp(x, plan)
    c = 0
    for start, L in zip(batch.cu_seqlens_padded[:-1].tolist(), batch.seqlens.tolist()):
        for w in range(L // ratio):
            (grad,) = torch.autograd.grad(entries[c].sum(), x, retain_graph=True)
            lo = start + (w - 1) * ratio if overlap and w > 0 else start + w * ratio
            assert (grad.abs().sum(1) != 0).nonzero().flatten().tolist() == list(
                range(lo, start + (w + 1) * ratio)
            )
            c += 1
    assert c == entries.shape[0]


def test_causality_through_compressed_entries_and_indexer():
    """Changing token j changes no logit before j (all three layer types, indexer included)."""
    args = micro()
    model = build(args).eval()
    tokens, batch = packed(lengths=[70], vocab=args.vocab_size)
    with torch.no_grad():
        base = model(tokens, meta(batch)).logits
        for j in (2, 7, 15, 16, 31, 47, 69):
            changed = tokens.clone()
            changed[j] = (changed[j] + 1) % args.vocab_size
            out = model(changed, meta(batch)).logits
            torch.testing.assert_close(out[:j], base[:j], rtol=0, atol=1e-12)
            assert (out[j:] - base[j:]).abs().max() > 1e-6


@pytest.mark.parametrize("kind", ["sliding", "csa", "hca"])
def test_rope_shift_invariance(kind):
    """Shifting every position (tokens and entries) by a multiple of m' keeps attention outputs."""
    args = micro()
    model = build(args).eval()
    attn = model.layers[LAYER[kind]].attn
    _tokens, batch = packed(lengths=[70, 33], vocab=args.vocab_size)
    x = torch.randn(
        batch.total_tokens, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0)
    )
    plan = get_plan(meta(batch), args, torch.float64)
    shift = 3 * args.hca_ratio
    shifted = dataclasses.replace(
        plan,
        rope_main=cos_sin(plan.pos_T + shift, inv_freq(args, False, torch.float64)),
        rope_comp=cos_sin(plan.pos_T + shift, inv_freq(args, True, torch.float64)),
        compress={
            k: dataclasses.replace(
                cp,
                cos_CR=cos_sin(cp.pos_C + shift, inv_freq(args, True, torch.float64))[0],
                sin_CR=cos_sin(cp.pos_C + shift, inv_freq(args, True, torch.float64))[1],
            )
            for k, cp in plan.compress.items()
        },
    )
    with torch.no_grad():
        a, b = attn(x, plan, False)[0], attn(x, shifted, False)[0]
    torch.testing.assert_close(a, b, rtol=0, atol=1e-11)


def test_indexer_tie_break_prefers_lower_entries():
    inf = float("-inf")
    score = torch.tensor([[0.0, 2.0, 0.0, 0.0, 1.0, inf], [inf, inf, 0.5, inf, inf, inf]])
    pick = _topk_mask_low_index_first(score, 3)
    assert pick.tolist() == [[True, True, False, False, True, False], [True, True, True, False, False, False]]


def test_chunked_attention_equals_unchunked():
    """Query chunking (attention core, indexer selection, KL teacher) bounds memory only."""
    args = micro()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    outs = []
    for chunk in (2048, 7):
        model = build(dataclasses.replace(args, attn_chunk=chunk)).train()
        out = model(tokens, meta(batch))
        outs.append((out.logits, out.aux_losses["indexer"]))
    torch.testing.assert_close(outs[0][0], outs[1][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(outs[0][1], outs[1][1], rtol=0, atol=1e-12)


def test_packed_documents_equal_alone_per_layer_type():
    """Each real document of a packed batch gets the logits it gets alone (padding is garbage)."""
    args = micro()
    model = build(args).eval()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    with torch.no_grad():
        logits = model(tokens, meta(batch)).logits
        for rows in doc_slices(batch):
            t1, b1 = sub_batch(tokens, batch, rows)
            torch.testing.assert_close(logits[rows], model(t1, meta(b1)).logits, rtol=0, atol=1e-12)


def test_bench_dsv4_attention_json(tmp_path):
    """The benchmark's --json contract: per-token microseconds per layer type and T, each positive."""
    path = Path(__file__).resolve().parents[3] / "benchmarks" / "bench_dsv4_attention.py"
    spec = importlib.util.spec_from_file_location("bench_dsv4_attention", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "attn.json"
    bench.main(
        [
            "--flavor",
            "micro",
            "--tokens",
            "256,512,256",
            "--doc-len",
            "96",
            "--repeats",
            "1",
            "--json",
            str(out),
        ]
    )
    per_token = json.loads(out.read_text())["per_token_us"]
    assert set(per_token) == {"sliding", "csa", "hca"}
    for kind in per_token.values():
        assert set(kind) == {"256", "512"}  # a repeated T is measured once
        assert all(us > 0 for us in kind.values())
