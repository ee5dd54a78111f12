"""dsv4 whole-model properties (float64, micro flavor): THD packing, MTP, indexer isolation, mHC,
MoE routing and balancing, argument / metadata validation, FLOPs, spec."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.models.dsv4._util import build, doc_slices, meta, micro, packed, sub_batch
from titan_thd.data.batch_meta import CPContext
from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.models.dsv4 import DSv4Args, DSv4Model, flavors, spec
from titan_thd.models.dsv4.flops import _capped_visible, _floor_sum, _window_keys
from titan_thd.models.dsv4.mhc import HyperConnection, hc_post
from titan_thd.models.dsv4.moe import Gate
from titan_thd.models.dsv4.mtp import mtp_inputs_targets
from titan_thd.models.spec import count_params

DOCS = {"lengths": [3, 37, 70, 16], "pad_to": 8, "tail": 13}


def losses(model, tokens, batch):
    """(total loss, logits, aux) with the trainer's convention: CE sum over trained labels + aux sums."""
    out = model(tokens, meta(batch))
    ce = F.cross_entropy(
        out.logits, batch.labels.masked_fill(~batch.loss_mask, IGNORE_INDEX), reduction="sum"
    )
    return ce + sum(out.aux_losses.values()), out.logits, out.aux_losses


def test_packed_forward_backward_equals_documents_alone():
    """Logits, MTP and indexer losses and every parameter gradient of a packed batch equal the sums
    over its documents run alone (train mode: MTP and the indexer KL are on)."""
    args = micro()
    model = build(args).train()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size, trained=0.7)
    total, logits, aux = losses(model, tokens, batch)
    assert set(aux) == {"mtp", "indexer"} and aux["mtp"] > 0 and aux["indexer"] > 0
    total.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    aux_sum = {"mtp": 0.0, "indexer": 0.0}
    for rows in doc_slices(batch):
        t1, b1 = sub_batch(tokens, batch, rows)
        total1, logits1, aux1 = losses(model, t1, b1)
        total1.backward()
        torch.testing.assert_close(logits[rows], logits1, rtol=0, atol=1e-12)
        aux_sum = {k: total + aux1[k].detach() for k, total in aux_sum.items()}
    for k, total in aux_sum.items():
        torch.testing.assert_close(aux[k].detach(), total, rtol=1e-12, atol=0)
    alone_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert sorted(alone_grads) == sorted(packed_grads)
    for n, g in packed_grads.items():
        torch.testing.assert_close(g, alone_grads[n], rtol=1e-9, atol=1e-12, msg=n)


def test_cross_document_gradient_is_exactly_zero():
    args = micro()
    model = build(args).train()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    emb = {}

    def keep(module, inputs, output):
        if "out" not in emb:  # the main embedding (the MTP block embeds the next tokens afterwards)
            output.retain_grad()
            emb["out"] = output

    model.embed.register_forward_hook(keep)
    out = model(tokens, meta(batch))
    target = doc_slices(batch)[2]
    (out.logits[target].square().sum() + out.aux_losses["indexer"]).backward()
    grad = emb["out"].grad
    outside = torch.ones(grad.shape[0], dtype=torch.bool)
    outside[target] = False
    assert torch.count_nonzero(grad[outside]) == 0
    assert torch.count_nonzero(grad[target]) > 0


def test_mtp_shift_stays_inside_documents():
    #            doc 0: a b c | doc 1: d e f g | pad
    labels = torch.tensor([11, 12, IGNORE_INDEX, 21, 22, 23, IGNORE_INDEX, IGNORE_INDEX])
    mask = labels != IGNORE_INDEX
    mask[4] = False  # row 3's MTP target (row 4's label) is not trained
    # Row 2's next row is trained but starts document 1: no MTP target across the boundary.
    doc = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2])
    nxt, target, trained = mtp_inputs_targets(labels, mask, doc)
    assert nxt.tolist() == [11, 12, 0, 21, 22, 23, 0, 0]
    assert trained.tolist() == [True, False, False, False, True, False, False, False]
    assert target[trained].tolist() == [12, 23]


def test_indexer_learns_only_from_its_kl_and_kl_touches_nothing_else():
    args = micro()
    model = build(args).train()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    out = model(tokens, meta(batch))
    ce = F.cross_entropy(out.logits, batch.labels, reduction="sum")
    names, params = zip(*model.named_parameters())
    is_indexer = [".attn.indexer." in n for n in names]
    main = torch.autograd.grad(ce + out.aux_losses["mtp"], params, retain_graph=True, allow_unused=True)
    kl = torch.autograd.grad(out.aux_losses["indexer"], params, allow_unused=True)
    for n, ind, g_main, g_kl in zip(names, is_indexer, main, kl):
        if ind:
            assert g_main is None or torch.count_nonzero(g_main) == 0, n
        else:
            assert g_kl is None or torch.count_nonzero(g_kl) == 0, n
    assert all(g is not None and torch.count_nonzero(g) > 0 for ind, g in zip(is_indexer, kl) if ind)
    assert sum(1 for ind, g in zip(is_indexer, main) if not ind and g is not None and g.abs().sum() > 0) > 50


def test_indexer_kl_is_zero_when_student_equals_teacher():
    """A sanity anchor of the KL: non-negative, and 0 iff the indexer's softmax equals the teacher."""
    from titan_thd.models.dsv4.indexer import indexer_kl

    g = torch.Generator().manual_seed(0)
    T, H, D, C = 6, 2, 4, 5
    q, kv, comp = (torch.randn(*s, generator=g, dtype=torch.float64) for s in ((T, H, D), (T, D), (C, D)))
    sink = torch.zeros(H, dtype=torch.float64)
    window = torch.arange(T)[:, None] - torch.arange(2)
    window[window < 0] = -1
    cand = torch.tensor([[0, 1, 2], [0, -1, 3], [-1, -1, -1], [4, 2, 1], [3, 1, -1], [0, 2, 4]])
    real = torch.tensor([True] * 5 + [False])
    lc = torch.einsum("thd,tkd->thk", q, comp[cand.clamp(min=0)]) * 0.5
    lw = (
        torch.einsum("thd,tkd->thk", q, kv[window.clamp(min=0)]).masked_fill(
            (window < 0)[:, None], -torch.inf
        )
        * 0.5
    )
    lc = lc.masked_fill((cand < 0)[:, None], -torch.inf)
    lse = torch.cat([lw, lc, sink[None, :, None].expand(T, H, 1)], -1).logsumexp(-1, keepdim=True)
    teacher = (lc - lse).exp().sum(1)
    exact = teacher.log().masked_fill(cand < 0, -torch.inf)
    common = {"q_THD": q, "kv_RD": kv, "comp_CD": comp, "sink_H": sink, "window_TW": window, "cand_TK": cand}
    common |= {"row_ok_T": real, "scale": 0.5, "chunk": 4}
    kl0 = indexer_kl(student_TK=exact, **common)
    random_TK = torch.randn(T, 3, generator=g, dtype=torch.float64).masked_fill(cand < 0, -torch.inf)
    kl1 = indexer_kl(student_TK=random_TK, **common)
    assert abs(kl0.item()) < 1e-12 and kl1.item() > 1e-3


def test_dense_and_sparse_indexer_loss():
    """Dense KL runs over every visible entry, sparse over the top-k: equal when k covers all
    entries, different otherwise; both are additive over packed documents."""
    tokens, batch = packed(**DOCS, vocab=micro().vocab_size)
    kl = {}
    for topk in (4, 64):
        for mode in ("dense", "sparse"):
            model = build(micro(index_topk=topk, indexer_loss_mode=mode)).train()
            kl[topk, mode] = model(tokens, meta(batch)).aux_losses["indexer"].detach()
            if topk == 4 and mode == "dense":
                alone = 0.0
                for rows in doc_slices(batch):
                    t1, b1 = sub_batch(tokens, batch, rows)
                    alone = alone + model(t1, meta(b1)).aux_losses["indexer"].detach()
                torch.testing.assert_close(kl[topk, mode], alone, rtol=1e-12, atol=0)
    torch.testing.assert_close(kl[64, "dense"], kl[64, "sparse"], rtol=1e-12, atol=0)
    assert (kl[4, "dense"] - kl[4, "sparse"]).abs() > 1e-6


def test_mhc_comb_is_doubly_stochastic_and_applied_transposed():
    torch.manual_seed(0)
    hc = HyperConnection(4, 16, sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-6).double()
    with torch.no_grad():
        hc.fn.normal_(std=0.1)
        hc.base.normal_()
    h = torch.randn(9, 4, 16, dtype=torch.float64)
    _x, post, comb = hc(h)
    torch.testing.assert_close(comb.sum(-2), torch.ones(9, 4, dtype=torch.float64), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(9, 4, dtype=torch.float64), rtol=0, atol=1e-3)
    assert (comb - comb.transpose(1, 2)).abs().max() > 1e-3  # not symmetric: the orientation matters
    assert (post > 0).all() and (post < 2).all()
    mixed = hc_post(torch.zeros(9, 16, dtype=torch.float64), h, post, comb)
    expected = torch.einsum("tjk,tjd->tkd", comb, h)  # h'_k = sum_j comb[j, k] h_j
    torch.testing.assert_close(mixed, expected, rtol=0, atol=1e-14)


def test_hash_routing_is_a_frozen_function_of_the_token_id():
    args = micro()
    model = build(args).eval()
    gate = model.layers["0"].ffn.gate
    assert gate.hash_routed
    assert "layers.0.ffn.gate.tid2eid" in model.state_dict()
    assert "layers.0.ffn.gate.tid2eid" not in dict(model.named_parameters())
    table = gate.tid2eid
    assert table.shape == (args.vocab_size, args.n_activated_experts)
    assert all(len(set(row.tolist())) == args.n_activated_experts for row in table)
    tokens = torch.tensor([5, 9, 5, 5, 9])
    x = torch.randn(5, args.dim, dtype=torch.float64)  # different hidden states, same ids
    experts, weights = gate(x, tokens, torch.ones(5, dtype=torch.bool))
    assert torch.equal(experts, table[tokens])
    assert not torch.allclose(weights[0], weights[2])  # weights still come from the learned scores


def test_router_bias_changes_selection_only():
    args = micro()
    torch.manual_seed(0)
    gate = Gate(args, hash_routed=False).double()
    torch.nn.init.normal_(gate.weight)
    x = torch.randn(50, args.dim, dtype=torch.float64)
    real = torch.ones(50, dtype=torch.bool)
    scores = F.softplus(x @ gate.weight.T).sqrt()
    experts0, weights0 = gate.eval()(x, None, real)
    gate.bias[0] = 100.0  # every token now takes expert 0
    experts1, weights1 = gate(x, None, real)
    assert (experts1 == 0).any(1).all() and not (experts0 == 0).any(1).all()
    for experts, weights in ((experts0, weights0), (experts1, weights1)):
        chosen = scores.gather(1, experts)
        torch.testing.assert_close(weights, chosen / chosen.sum(1, keepdim=True) * args.route_scale)


def test_bias_update_counts_real_tokens_only_and_moves_towards_balance():
    args = micro()
    model = build(args).train()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    model(tokens, meta(batch))
    real = int(batch.seqlens.sum())
    gates = model.router_gates()
    assert len(gates) == len(args.layer_types) - args.n_hash_layers + args.mtp_layers
    for gate in gates:
        assert gate.load.sum() == real * args.n_activated_experts  # padding rows not counted
    gate = gates[0]
    gate.load.copy_(torch.tensor([5.0, 1.0, 3.0, 3.0]))
    before = gate.bias.clone()
    spec.after_optimizer_step(model, None)
    rate = args.router_bias_update_rate
    torch.testing.assert_close(gate.bias - before, torch.tensor([-rate, rate, 0.0, 0.0], dtype=before.dtype))
    assert all(g.load.sum() == 0 for g in gates)


def test_args_validation_names_the_problem():
    with pytest.raises(ValueError, match=r"layer_types\[1\] = 'mla' is not a layer type"):
        DSv4Args(layer_types=("sliding", "mla"))
    with pytest.raises(ValueError, match="hca_ratio = 1 must be >= 2"):
        DSv4Args(hca_ratio=1)
    with pytest.raises(ValueError, match="rope_dim = 10 must be even and <= head_dim"):
        DSv4Args(rope_dim=10, index_head_dim=8)
    with pytest.raises(ValueError, match="o_groups = 3 must divide n_heads = 8"):
        DSv4Args(o_groups=3)


def test_metadata_errors():
    args = micro()
    model = build(args).eval()
    tokens, batch = packed(lengths=[20, 12], vocab=args.vocab_size)
    bad = meta(batch)
    bad.position_ids = torch.arange(32)
    with pytest.raises(ValueError, match="position_ids do not restart"):
        model(tokens, bad)
    small = meta(batch)
    small.cp = CPContext(size=4, rank=0, group=object(), mode="contiguous")
    with pytest.raises(
        ValueError, match=r"T = 32 / context_parallel_degree = 4 leaves 8 tokens .* at least 16"
    ):
        model(tokens, small)
    odd = meta(batch)
    odd.cp = CPContext(size=3, rank=0, group=object(), mode="contiguous")
    with pytest.raises(
        ValueError, match=r"T = 32 is not divisible by 3 .*smallest valid value above it is 33"
    ):
        model(tokens, odd)
    zigzag = meta(batch)
    zigzag.cp = CPContext(size=2, rank=0, group=object(), mode="zigzag")
    with pytest.raises(
        ValueError, match="context_parallel_mode = zigzag: model dsv4 computes only contiguous"
    ):
        model(tokens, zigzag)
    unsplit = meta(batch)  # a CP context but the whole microbatch's rows
    unsplit.cp = CPContext(size=2, rank=1, group=object(), mode="contiguous")
    with pytest.raises(ValueError, match=r"rank 1 of 2 must hold rows 16\.\.32"):
        model(tokens, unsplit)


def layer_params(args: DSv4Args) -> dict[str, int]:
    """Parameters of one block of each type (built on the meta device, so shapes only)."""
    probe = dataclasses.replace(args, layer_types=("sliding", "csa", "hca"), n_hash_layers=0, mtp_layers=0)
    with torch.device("meta"):
        model = DSv4Model(probe)
    return {t: count_params(model.layers[str(i)]) for i, t in enumerate(probe.layer_types)}


def test_flavors_and_flash_dimensions():
    assert abs(count_params(spec.build(flavors["micro"])) - 1.27e6) < 0.1e6
    flash = flavors["flash"]
    assert spec.parallel.cp_mode == "contiguous" and spec.parallel.min_tokens_per_cp_rank(flash) == 128
    per_layer = layer_params(flash)
    main = sum(per_layer[t] for t in flash.layer_types) + 2 * flash.vocab_size * flash.dim
    assert 280e9 < main < 290e9, main  # "~284B total" (docs/dsv4.md §1.1), MTP excluded


@pytest.mark.slow
def test_flash_builds_on_meta():
    flash = flavors["flash"]
    with torch.device("meta"):
        model = DSv4Model(flash)
    per_layer = layer_params(flash)
    expected = sum(per_layer[t] for t in flash.layer_types) + 2 * flash.vocab_size * flash.dim
    expected += count_params(model.hc_head) + count_params(model.norm)
    assert count_params(model) - count_params(model.mtp) == expected


def test_matrix_params_split():
    model = build(micro())
    names = set(spec.matrix_params(model))
    assert "layers.1.attn.wq_a.weight" in names and "layers.2.ffn.experts.w2" in names
    assert "layers.1.hc_attn.fn" in names and "layers.1.ffn.gate.weight" in names
    for name in (
        "embed.weight",
        "head.weight",
        "layers.1.attn.compressor.ape",
        "layers.1.attn.attn_sink",
        "layers.1.attn_norm.weight",
        "layers.1.hc_attn.base",
        "layers.1.hc_attn.scale",
    ):
        assert name not in names
    # matrices, and the routed experts as [E, out, in] stacks of them
    assert all(
        p.ndim == (3 if ".ffn.experts." in n else 2) for n, p in model.named_parameters() if n in names
    )


def test_flops_counts_match_brute_force():
    for L in (1, 3, 4, 7, 8, 37, 130):
        for m in (4, 16):
            vis = [min((t + 1) // m, L // m) for t in range(L)]
            assert _floor_sum(L, m) == sum(vis)
            assert _capped_visible(L, m, 5) == sum(min(5, v) for v in vis)
        assert _window_keys(L, 8) == sum(min(t + 1, 8) for t in range(L))
    args = flavors["tiny"]
    one = spec.flops_per_step(args, [2048])
    assert spec.flops_per_step(args, [2048, 2048, 0]) == 2 * one
    assert spec.flops_per_step(args, [4096]) > 2 * one  # attention grows with document length
    six_n = 6 * count_params(spec.build(dataclasses.replace(args, n_experts=args.n_activated_experts + 1)))
    assert 0.3 < one / 2048 / six_n < 3  # same order as 6 x (active params) per token


def test_bfloat16_step_runs_and_keeps_the_balancing_bias_in_float32():
    args = micro()
    model = build(args, dtype=torch.bfloat16).train()
    gate = model.router_gates()[0]
    assert gate.bias.dtype == torch.float32 and gate.load.dtype == torch.long
    tokens, batch = packed(**DOCS, vocab=args.vocab_size)
    total, logits, _aux = losses(model, tokens, batch)
    assert logits.dtype == torch.bfloat16 and torch.isfinite(total)
    total.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_step_runs_no_per_token_matrix_product(dtype):
    """No op of a training step loops over the tokens inside aten. A batched product with an operand
    aten cannot hand to one batched GEMM (the first layer's streams as a stride-0 expand of the
    embedding, a permuted Sinkhorn result) runs one GEMM per token: a `select` of each operand per
    token, seen here as a select or clone of a [T, ...] tensor at least T times (with the expand:
    5 such groups at T = 149; 22k selects per step at tiny, T = 1,744; docs/results.md §17.5)."""
    args = micro()
    model = build(args, dtype=dtype).train()
    tokens, batch = packed(**DOCS, vocab=args.vocab_size, trained=0.7)
    with torch.profiler.profile(record_shapes=True) as prof:
        losses(model, tokens, batch)[0].backward()
    T = tokens.numel()
    per_token = {
        (e.key, str(e.input_shapes)): e.count
        for e in prof.key_averages(group_by_input_shape=True)
        if e.key in ("aten::select", "aten::clone") and e.input_shapes[0][:1] == [T] and e.count >= T
    }
    assert not per_token, f"T = {T}: {per_token}"
