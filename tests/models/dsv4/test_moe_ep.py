"""Grouped experts against the per-expert loop, and expert-parallel dispatch against one process
(float64: the same products in another grouping agree to rounding, rel 1e-12)."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

from tests._dist import spawn
from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.moe import MoE, grouped_experts, looped_experts
from titan_thd.parallel.expert_parallel import apply_ep, local_expert_ids

ARGS = flavors["micro"]  # d 128, 4 experts of width 64, k = 2
D, F_ = ARGS.dim, ARGS.moe_inter_dim
NAMES = ("w1", "w2", "w3")


def _stacks(n: int, dtype=torch.float64) -> list[torch.Tensor]:
    """w1 [n, F, d], w2 [n, d, F], w3 [n, F, d] as leaves."""
    g = torch.Generator().manual_seed(0)
    shapes = ((n, F_, D), (n, D, F_), (n, F_, D))
    return [
        (0.05 * torch.randn(s, generator=g, dtype=torch.float64)).to(dtype).requires_grad_() for s in shapes
    ]


def _clone(ws: list[torch.Tensor]) -> list[torch.Tensor]:
    return [w.detach().clone().requires_grad_() for w in ws]


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 7], [0, 0, 0, 0]])
def test_grouped_experts_match_the_loop(counts):
    """Forward and backward (input and every stacked weight), empty groups and no rows included."""
    loop_w = _stacks(len(counts))
    grouped_w = _clone(loop_w)
    g = torch.Generator().manual_seed(1)
    # Large inputs so that the +-limit clamps are active on some entries (their gradient is 0).
    x = (30 * torch.randn(sum(counts), D, generator=g, dtype=torch.float64)).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    grad_out = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)  # a real grad, not stride 0

    ref = looped_experts(x, counts, *loop_w, ARGS.swiglu_limit)
    got = grouped_experts(x2, counts, *grouped_w, ARGS.swiglu_limit)
    torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
    if not sum(counts):  # nothing routed: no gradient reaches any expert
        return
    ref.backward(grad_out)
    got.backward(grad_out)
    torch.testing.assert_close(x2.grad, x.grad, rtol=1e-12, atol=1e-12)
    for name, a, b in zip(NAMES, loop_w, grouped_w):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
        for e, n in enumerate(counts):
            assert n or not b.grad[e].any(), (name, e)  # an expert without rows: a zero gradient


def test_grouped_experts_float32_kernel_matches_the_loop():
    """float32 takes `F.grouped_mm` (float64 the padded batched matmul above). Both sides are
    float32 and differ only in summation order: each of the 3 chained products sums <= 128
    terms, so an entry is off by <= 128·u·(sum of |terms|) with u = 2^-24 (7.6e-6 relative in
    the worst case, ~sqrt(128)·u = 7e-7 typically); normwise 1e-5 bounds it."""
    counts = [4, 0, 9, 2]
    loop_w = _stacks(4, torch.float32)
    grouped_w = _clone(loop_w)
    x = torch.randn(sum(counts), D).requires_grad_(True)
    x2 = x.detach().clone().requires_grad_(True)
    ref = looped_experts(x, counts, *loop_w, ARGS.swiglu_limit)
    got = grouped_experts(x2, counts, *grouped_w, ARGS.swiglu_limit)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5
    grad = torch.randn_like(ref)
    ref.backward(grad)
    got.backward(grad)
    assert ((x2.grad - x.grad).norm() / x.grad.norm()).item() < 1e-5
    for a, b in zip(loop_w, grouped_w):
        assert ((b.grad - a.grad).norm() / a.grad.norm()).item() < 1e-5


def test_grouped_experts_bfloat16_close_to_float64():
    """bf16 weights take the same path (16-byte strides: widths are multiples of 8)."""
    counts = [2, 6, 0, 3]
    ws = _stacks(4)
    x = torch.randn(sum(counts), D, dtype=torch.float64)
    ref = looped_experts(x, counts, *ws, 10.0)
    got = grouped_experts(x.bfloat16(), counts, *(w.detach().bfloat16() for w in ws), 10.0)
    # bf16 has 8 mantissa bits: relative rounding 2^-8 per operand, three chained products.
    assert (got.double() - ref).norm() / ref.norm() < 3e-2


class _Sizes(TorchDispatchMode):
    """Records the element count of every tensor an aten op writes into new memory (views and
    aliases of its inputs left out)."""

    def __init__(self):
        super().__init__()
        self.numels: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        flat = [*args, *(kwargs or {}).values()]
        inputs = {a.untyped_storage().data_ptr() for a in flat if isinstance(a, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                self.numels.append((str(func), t.numel()))
        return out


def test_grouped_experts_copy_no_weight():
    """The grouped product reads the stacked weights in place: over a forward and backward the
    only weight-sized tensors created are the three weight gradients (no stacked copy, no
    transposed copy), and what the forward saves for the backward besides the weights does not
    grow with the number of experts."""
    counts = [5, 0, 3] + [0] * 29
    ws = _stacks(len(counts), torch.float32)
    x = torch.randn(sum(counts), D, requires_grad=True)
    weights = {w.untyped_storage().data_ptr() for w in ws}
    saved: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            saved.append(t.untyped_storage().nbytes())
        return t

    with _Sizes() as sizes, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        grouped_experts(x, counts, *ws, ARGS.swiglu_limit).sum().backward()
    big = [op for op, n in sizes.numels if n >= ws[0].numel()]
    assert len(big) == 3, big  # the gradients of w1, w2, w3
    assert sum(saved) < 3 * D * F_ * 4, saved  # rows only: less than one expert's weights


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
    mesh = init_device_mesh("cpu", (world,))
    out = {}
    for hash_routed in (True, False):
        moe = _moe(hash_routed).train()
        apply_ep([moe], mesh)
        y, gx = _run(moe, *_inputs(rank, hash_routed))
        grads = {
            n: (p.grad.to_local() if n.startswith("experts.") else p.grad).clone()
            for n, p in moe.named_parameters()
            if p.grad is not None
        }
        local_w = moe.experts.w1.to_local().clone()  # this rank's slice of the stack
        load = None if hash_routed else moe.gate.load.clone()
        if not hash_routed:
            moe.gate.update_bias(dist.group.WORLD)
        out[hash_routed] = (y, gx, grads, local_w, load, moe.state_dict().get("gate.bias"))
    return out


def test_expert_parallel_matches_one_process():
    results = spawn(_ep_body, EP)
    for hash_routed in (True, False):
        ref = _moe(hash_routed).train()
        loads = []
        for rank in range(EP):
            y, gx = _run(ref, *_inputs(rank, hash_routed))  # grads accumulate over the ranks' inputs
            got_y, got_gx, _, local_w, _, _ = results[rank][hash_routed]
            torch.testing.assert_close(got_y, y, rtol=1e-12, atol=1e-13)
            torch.testing.assert_close(got_gx, gx, rtol=1e-12, atol=1e-13)
            ids = local_expert_ids(ARGS.n_experts, EP, rank)
            assert torch.equal(local_w, ref.experts.w1.detach()[ids.start : ids.stop])  # Shard(0)
            loads.append(results[rank][hash_routed][4])
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        for rank in range(EP):
            grads = results[rank][hash_routed][2]
            ids = local_expert_ids(ARGS.n_experts, EP, rank)
            for name in ("experts.w1", "experts.w2", "experts.w3"):
                # routed experts: this rank's slice of the sum over every rank's tokens
                want = ref_grads[name][ids.start : ids.stop]
                torch.testing.assert_close(grads[name], want, rtol=1e-12, atol=1e-13)
                if hash_routed and rank == 1:  # expert 3 got no token anywhere
                    assert not grads[name][3 - ids.start].any(), name
        if not hash_routed:
            # Each rank counts its own real tokens; the update sums them once (= one process).
            assert int(sum(loads).sum()) == 2 * (T - 1) * ARGS.n_activated_experts
            ref.gate.update_bias(None)
            for rank in range(EP):
                torch.testing.assert_close(results[rank][False][5], ref.gate.bias, rtol=0, atol=0)
