"""Grouped experts against the per-expert loop, and expert-parallel dispatch against one process
(float64: the same products in another grouping agree to rounding, rel 1e-12)."""

import copy

import pytest
import torch
import torch.distributed as dist

from tests._dist import spawn
from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.moe import Expert, MoE, grouped_experts, looped_experts
from titan_thd.parallel.expert_parallel import apply_ep, local_expert_ids

ARGS = flavors["micro"]  # d 128, 4 experts of width 64, k = 2
D = ARGS.dim


def _experts(n: int, dtype=torch.float64) -> list[Expert]:
    torch.manual_seed(0)
    return [Expert(D, ARGS.moe_inter_dim, ARGS.swiglu_limit).to(dtype) for _ in range(n)]


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 7], [0, 0, 0, 0]])
def test_grouped_experts_match_the_loop(counts):
    """Forward and backward (input and every expert weight), empty groups and no rows included."""
    loop_experts = _experts(len(counts))
    grouped = copy.deepcopy(loop_experts)
    g = torch.Generator().manual_seed(1)
    # Large inputs so that the +-limit clamps are active on some entries (their gradient is 0).
    x = (30 * torch.randn(sum(counts), D, generator=g, dtype=torch.float64)).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)  # a real grad, not stride 0

    ref = looped_experts(x, counts, loop_experts)
    got = grouped_experts(x2, counts, grouped, ARGS.swiglu_limit)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    if sum(counts):
        ref.backward(grad_out)
        got.backward(grad_out)
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    for e, (a, b) in enumerate(zip(loop_experts, grouped)):
        for name in ("w1", "w2", "w3"):
            ga, gb = getattr(a, name).weight.grad, getattr(b, name).weight.grad
            if counts[e] == 0:  # an expert without rows gets no (or a zero) gradient
                assert ga is None and (gb is None or not gb.any()), (e, name)
            else:
                torch.testing.assert_close(gb, ga, rtol=1e-12, atol=1e-12)


def test_grouped_experts_float32_kernel_matches_the_loop():
    """float32 takes `F.grouped_mm` (float64 the padded batched matmul above). Both sides are
    float32 and differ only in summation order: each of the 3 chained products sums <= 128
    terms, so an entry is off by <= 128·u·(sum of |terms|) with u = 2^-24 (7.6e-6 relative in
    the worst case, ~sqrt(128)·u = 7e-7 typically); normwise 1e-5 bounds it."""
    counts = [4, 0, 9, 2]
    experts = [e.float() for e in _experts(4)]
    x = torch.randn(sum(counts), D).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref = looped_experts(x, counts, experts)
    got = grouped_experts(x2, counts, experts, ARGS.swiglu_limit)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    grad = torch.randn_like(ref)
    ref.backward(grad)
    used = [e for e, n in enumerate(counts) if n]
    ref_w = {e: experts[e].w2.weight.grad.clone() for e in used}
    for e in experts:
        e.zero_grad()
    got.backward(grad)
    assert ((x2.grad - x.grad).norm() / x.grad.norm()).item() < 1e-5
    for e in used:
        w = ref_w[e]
        assert ((experts[e].w2.weight.grad - w).norm() / w.norm()).item() < 1e-5


def test_grouped_experts_bfloat16_close_to_float64():
    """bf16 weights take the same path (16-byte strides: widths are multiples of 8)."""
    counts = [2, 6, 0, 3]
    experts = _experts(4)
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    ref = looped_experts(x, counts, experts)
    got = grouped_experts(x.bfloat16(), counts, [copy.deepcopy(e).bfloat16() for e in experts], 10.0)
    # bf16 has 8 mantissa bits: relative rounding 2^-8 per operand, three chained products.
    assert (got.double() - ref).norm() / ref.norm() < 3e-2


def test_grouped_experts_keep_no_stacked_weights_for_the_backward():
    """What the forward saves for the backward is rows, not experts: besides references to the
    weights themselves, the saved bytes do not grow with the number of experts (the stacked
    [E, in, out] copy the grouped kernel reads is transient)."""

    def saved_bytes(n_experts: int) -> int:
        experts = [e.float() for e in _experts(n_experts)]
        weights = {p.untyped_storage().data_ptr() for e in experts for p in e.parameters()}
        counts = [5, 0, 3] + [0] * (n_experts - 3)
        x = torch.randn(sum(counts), D, requires_grad=True)
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            if storage.data_ptr() not in weights:
                seen[storage.data_ptr()] = storage.nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            grouped_experts(x, counts, experts, ARGS.swiglu_limit).sum().backward()
        return sum(seen.values())

    few, many = saved_bytes(4), saved_bytes(32)
    one_expert = 3 * D * ARGS.moe_inter_dim * 4
    assert few == many and few < one_expert, (few, many, one_expert)


# ------------------------------------------------------------------ expert-parallel dispatch (gloo)
EP = 2
T = 6  # tokens per rank (rank 1 of the hash case has none)


def _moe(hash_routed: bool) -> MoE:
    torch.manual_seed(3)
    moe = MoE(ARGS, hash_routed).double()
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    if hash_routed:
        # Token t goes to experts (0, 1) or (0, 2): expert 3 (on ep rank 1) never gets a token.
        table = torch.tensor([[0, 1], [2, 0]]).repeat(ARGS.vocab_size // 2, 1)
        moe.gate.tid2eid.copy_(table)
    return moe


def _inputs(rank: int, hash_routed: bool):
    g = torch.Generator().manual_seed(10 + rank)
    rows = 0 if hash_routed and rank == 1 else T  # hash case: rank 1 sends (and routes) nothing
    x = torch.randn(rows, D, generator=g, dtype=torch.float64)
    tokens = torch.randint(0, ARGS.vocab_size, (rows,), generator=g)
    real = torch.ones(rows, dtype=torch.bool)
    real[-1:] = False  # padding rows are routed but not counted in the load
    grad = torch.randn(rows, D, generator=g, dtype=torch.float64)
    return x, tokens, real, grad


def _run(moe: MoE, x, tokens, real, grad):
    x = x.clone().requires_grad_(True)
    y = moe(x, tokens, real)
    y.backward(grad)
    return y.detach(), x.grad


def _ep_body(rank: int, world: int):
    out = {}
    for hash_routed in (True, False):
        moe = _moe(hash_routed).train()
        apply_ep([moe], dist.group.WORLD)
        y, gx = _run(moe, *_inputs(rank, hash_routed))
        grads = {n: p.grad.clone() for n, p in moe.named_parameters() if p.grad is not None}
        load = None if hash_routed else moe.gate.load.clone()
        if not hash_routed:
            moe.gate.update_bias(dist.group.WORLD)
        out[hash_routed] = (y, gx, grads, sorted(moe.experts), load, moe.state_dict().get("gate.bias"))
    return out


def test_expert_parallel_matches_one_process():
    results = spawn(_ep_body, EP)
    for hash_routed in (True, False):
        ref = _moe(hash_routed).train()
        loads = []
        for rank in range(EP):
            y, gx = _run(ref, *_inputs(rank, hash_routed))  # grads accumulate over the ranks' inputs
            got_y, got_gx, _, kept, _, _ = results[rank][hash_routed]
            torch.testing.assert_close(got_y, y, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(got_gx, gx, rtol=1e-12, atol=1e-13)
            assert kept == sorted(str(e) for e in local_expert_ids(ARGS.n_experts, EP, rank))
            loads.append(results[rank][hash_routed][4])
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        for rank in range(EP):
            grads = results[rank][hash_routed][2]
            for name, g in grads.items():
                if name.startswith("experts."):  # routed experts: the sum over every rank's tokens
                    torch.testing.assert_close(g, ref_grads[name], rtol=1e-12, atol=1e-13)
            if hash_routed and rank == 1:  # expert 3 got no token anywhere
                assert not any(n.startswith("experts.3.") and g.any() for n, g in grads.items())
        if not hash_routed:
            # Each rank counts its own real tokens; the update sums them once (= one process).
            assert int(sum(loads).sum()) == 2 * (T - 1) * ARGS.n_activated_experts
            ref.gate.update_bias(None)
            for rank in range(EP):
                torch.testing.assert_close(results[rank][False][5], ref.gate.bias, rtol=0, atol=0)
