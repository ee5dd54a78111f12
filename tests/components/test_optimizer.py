import copy

import pytest
import torch
from torch import nn

from tests._dist import spawn
from titan_thd.components.muon import Muon, newton_schulz
from titan_thd.components.optimizer import build_optimizers, clip_grad_norm_, default_matrix_params
from titan_thd.config import Optimizer
from titan_thd.models.spec import ModelSpec, ParallelSpec

SPEC = ModelSpec(name="toy", flavors={}, build=None, flops_per_step=None, parallel=ParallelSpec("zigzag"))


class TinyLM(nn.Module):
    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.proj = nn.Linear(dim, dim)  # weight [D, D] is a matrix, bias a vector
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, vocab, bias=False)  # LM head [V, D]

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.proj(self.embed(x)))))


def _loss(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 11, (16,), generator=g)
    return nn.functional.cross_entropy(model(x), torch.roll(x, 1))


def test_default_matrix_params_skip_embedding_and_head():
    assert default_matrix_params(TinyLM()) == ["proj.weight"]


def test_adamw_first_step_and_decay_groups():
    torch.manual_seed(0)
    model = TinyLM()
    before = {n: p.detach().clone().double() for n, p in model.named_parameters()}
    cfg = Optimizer(lr=0.01, weight_decay=0.5, beta1=0.9, beta2=0.95, eps=1e-8)
    opts = build_optimizers(model, cfg, SPEC)
    _loss(model).backward()
    grads = {n: p.grad.detach().clone().double() for n, p in model.named_parameters()}
    opts.step()
    for n, p in model.named_parameters():
        # First bias-corrected Adam step: m_hat = g, v_hat = g^2 -> g / (|g| + eps).
        decay = cfg.weight_decay if p.ndim >= 2 else 0.0
        expect = before[n] * (1 - cfg.lr * decay) - cfg.lr * grads[n] / (grads[n].abs() + cfg.eps)
        torch.testing.assert_close(p.detach().double(), expect, rtol=0, atol=1e-6, msg=n)
    opts.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_muon_gets_matrices_adamw_the_rest():
    model = TinyLM()
    opts = build_optimizers(model, Optimizer(name="muon", lr=0.02), SPEC)
    muon, adamw = opts.optimizers
    assert isinstance(muon, Muon) and isinstance(adamw, torch.optim.AdamW)
    names = {id(p): n for n, p in model.named_parameters()}
    assert [names[id(p)] for g in muon.param_groups for p in g["params"]] == ["proj.weight"]
    rest = sorted(names[id(p)] for g in adamw.param_groups for p in g["params"])
    assert rest == ["embed.weight", "norm.bias", "norm.weight", "out.weight", "proj.bias"]
    _loss(model).backward()
    opts.step()
    assert set(muon.state[model.proj.weight]) == {"momentum_buffer"}
    assert "exp_avg" in adamw.state[model.out.weight]


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_unused_parameter_steps_with_a_zero_gradient(name):
    """As under FSDP (unused parameters are reduce-scattered as zeros): weight decay applies, the
    update itself is zero, the optimizer state exists."""
    torch.manual_seed(0)
    model = TinyLM()
    model.unused = nn.Linear(8, 8, bias=False)  # not called by forward
    before = model.unused.weight.detach().clone()
    opts = build_optimizers(model, Optimizer(name=name, lr=0.01, weight_decay=0.5), SPEC)
    _loss(model).backward()
    assert model.unused.weight.grad is None
    opts.step()
    torch.testing.assert_close(model.unused.weight.detach(), before * (1 - 0.01 * 0.5), rtol=0, atol=1e-7)
    assert any(model.unused.weight in opt.state for opt in opts.optimizers)


def test_matrix_params_must_be_2d():
    spec = ModelSpec(
        name="toy",
        flavors={},
        build=None,
        flops_per_step=None,
        parallel=ParallelSpec("zigzag"),
        matrix_params=lambda m: ["proj.bias"],
    )
    with pytest.raises(ValueError, match=r"Muon needs 2-D parameters.*proj\.bias"):
        build_optimizers(TinyLM(), Optimizer(name="muon"), spec)


@pytest.mark.parametrize("name", ["adamw", "muon"])
def test_state_dict_round_trip_continues_identically(name):
    torch.manual_seed(0)
    model = TinyLM()
    cfg = Optimizer(name=name, lr=0.01)
    opts = build_optimizers(model, cfg, SPEC)
    for s in range(2):
        _loss(model, s).backward()
        opts.step()
        opts.zero_grad()
    state = opts.state_dict()
    assert any(k.startswith("state.proj.weight.") for k in state)  # flattened by parameter name
    twin = copy.deepcopy(model)
    twin_opts = build_optimizers(twin, cfg, SPEC)
    twin_opts.load_state_dict(copy.deepcopy(state))
    for m, o in ((model, opts), (twin, twin_opts)):
        _loss(m, 5).backward()
        o.step()
    for (n, a), b in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)


def test_muon_checkpoint_resumes_with_another_ns_dtype():
    """The Newton-Schulz dtype is a setting of the run, not checkpointed state (checkpoints written
    by torch.optim.Muon, which has no such key, resume too)."""
    torch.manual_seed(0)
    model = TinyLM()
    opts = build_optimizers(model, Optimizer(name="muon", lr=0.01), SPEC)
    _loss(model).backward()
    opts.step()
    state = opts.state_dict()
    assert not any(k.endswith(".ns_dtype") for k in state)
    twin_opts = build_optimizers(copy.deepcopy(model), Optimizer(name="muon", muon_ns_dtype="float32"), SPEC)
    twin_opts.load_state_dict(copy.deepcopy(state))
    assert twin_opts.optimizers[0].ns_dtype == torch.float32
    torch.testing.assert_close(
        twin_opts.optimizers[0].state_dict()["state"], opts.optimizers[0].state_dict()["state"]
    )


def _params_with_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.zeros(s)) for s in ((4, 3), (5,), (2, 2, 2))]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_clip_grad_norm_matches_float64_and_clips():
    params = _params_with_grads()
    ref = torch.cat([p.grad.double().flatten() for p in params]).norm()
    total = clip_grad_norm_(params, max_norm=0.5)
    assert float(total) == pytest.approx(float(ref), rel=1e-6)
    clipped = torch.cat([p.grad.double().flatten() for p in params]).norm()
    assert float(clipped) == pytest.approx(0.5, rel=1e-5)
    params = _params_with_grads()
    grads = [p.grad.clone() for p in params]
    assert float(clip_grad_norm_(params, max_norm=0.0)) == pytest.approx(float(ref), rel=1e-6)
    assert all(torch.equal(p.grad, g) for p, g in zip(params, grads))  # 0 = report only


def _dtensor_clip(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh_a = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    mesh_b = init_device_mesh("cpu", (world_size,), mesh_dim_names=("ep",))
    full = _params_with_grads()
    placements = [(mesh_a, Shard(0)), (mesh_a, Replicate()), (mesh_b, Shard(0))]
    params = []
    for p, (mesh, pl) in zip(full, placements):
        d = nn.Parameter(distribute_tensor(p.detach(), mesh, [pl]))
        d.grad = distribute_tensor(p.grad, mesh, [pl])
        params.append(d)
    total = clip_grad_norm_(params, max_norm=0.5)
    # Plain lists: a tensor sent through the result queue shares memory with a process that exits.
    return float(total), [p.grad.full_tensor().tolist() for p in params]


@pytest.mark.slow
def test_clip_grad_norm_dtensor_two_ranks():
    ref_params = _params_with_grads()
    ref_total = clip_grad_norm_(ref_params, max_norm=0.5)
    for total, clipped in spawn(_dtensor_clip, 2):
        assert total == pytest.approx(float(ref_total), rel=1e-6)
        for got, p in zip(clipped, ref_params):
            torch.testing.assert_close(torch.tensor(got), p.grad, rtol=1e-6, atol=1e-7)


def _muon_grads(shape, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g) for _ in range(steps)]


@pytest.mark.parametrize("shape", [(6, 10), (12, 5)])
def test_muon_bfloat16_matches_torch_muon(shape):
    """Independent reference: torch.optim.Muon with the same hyperparameters, three steps."""
    w0 = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    ours, ref = nn.Parameter(w0.clone()), nn.Parameter(w0.clone())
    opt = Muon([ours], lr=0.02, weight_decay=0.1, momentum=0.9, ns_steps=5, ns_dtype="bfloat16")
    ref_opt = torch.optim.Muon(
        [ref], lr=0.02, weight_decay=0.1, momentum=0.9, ns_steps=5, adjust_lr_fn="match_rms_adamw"
    )
    for grad in _muon_grads(shape, 3):
        ours.grad, ref.grad = grad.clone(), grad.clone()
        opt.step()
        ref_opt.step()
    assert not torch.equal(ours, w0)
    torch.testing.assert_close(ours, ref, rtol=0, atol=1e-6)
    torch.testing.assert_close(
        opt.state[ours]["momentum_buffer"], ref_opt.state[ref]["momentum_buffer"], rtol=0, atol=0
    )


def test_newton_schulz_float32_orthogonalises_in_the_singular_basis():
    """float64 SVD reference: U^T X V is diagonal with entries near 1 (the quintic's band)."""
    g = torch.randn(24, 40, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    u, _, vh = torch.linalg.svd(g, full_matrices=False)
    x = newton_schulz(g, steps=5, dtype=torch.float32).double()
    core = u.mT @ x @ vh.mT
    off = core - torch.diag_embed(core.diagonal())
    assert off.abs().max() < 1e-5
    assert 0.6 < core.diagonal().min() and core.diagonal().max() < 1.25
    tall = newton_schulz(g.mT, steps=5, dtype=torch.float32).double()
    torch.testing.assert_close(tall, x.mT, rtol=0, atol=1e-6)


def test_muon_refuses_bad_input():
    with pytest.raises(ValueError, match=r"2-D weights only.*\(3,\)"):
        Muon([nn.Parameter(torch.zeros(3))], lr=0.1, weight_decay=0.0)
    with pytest.raises(ValueError, match="ns_dtype: got 'float16'"):
        Muon([nn.Parameter(torch.zeros(3, 3))], lr=0.1, weight_decay=0.0, ns_dtype="float16")


def test_muon_on_a_stack_equals_muon_per_matrix():
    """A [E, A, B] stack (routed experts) steps as E separate matrices would: the batched
    Newton-Schulz scales each by its own norm, the learning rate by its own max(A, B) (float64,
    the same products batched: rel 1e-12)."""
    g = torch.Generator().manual_seed(4)
    start = torch.randn(3, 6, 9, generator=g, dtype=torch.float64)
    grads = [torch.randn(3, 6, 9, generator=g, dtype=torch.float64) * (1 + 10 * s) for s in range(3)]
    stack = nn.Parameter(start.clone())
    alone = [nn.Parameter(start[e].clone()) for e in range(3)]
    opt_stack = Muon([stack], lr=0.02, weight_decay=0.1, ns_dtype="float64")
    opt_alone = Muon(alone, lr=0.02, weight_decay=0.1, ns_dtype="float64")
    for grad in grads:
        stack.grad = grad.clone()
        for e, w in enumerate(alone):
            w.grad = grad[e].clone()
        opt_stack.step()
        opt_alone.step()
    torch.testing.assert_close(stack.detach(), torch.stack([w.detach() for w in alone]), rtol=1e-12, atol=0)
    assert not torch.equal(stack.detach(), start)


SHAPES = [(7, 5), (1, 4), (6, 6), (3, 8)]  # uneven rows, a rank with an empty shard
STACK = (4, 7, 5)  # 4 experts of 7 x 5: rows and columns split unevenly over 2 ranks
STACK_PLACEMENTS = [0, 1, 2]  # Shard(dim): experts (ep, FSDP dim 0), rows (FSDP dim 1), columns (TP)


def _sharded_muon(rank, world_size, grads):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from titan_thd.components import muon

    calls = []
    real_ns = muon.newton_schulz
    muon.newton_schulz = lambda g, *a, **k: calls.append(tuple(g.shape)) or real_ns(g, *a, **k)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    ws = [nn.Parameter(distribute_tensor(w, mesh, [Shard(0)])) for w in _muon_start()]
    opt = Muon(ws, lr=0.02, weight_decay=0.1, ns_dtype="float32")
    for step_grads in grads:
        for w, g in zip(ws, step_grads):
            w.grad = distribute_tensor(g, mesh, [Shard(0)])
        opt.step()
    # A stack of experts in every placement: its own optimizer (the owner choice above stays).
    stacks = [nn.Parameter(distribute_tensor(_stack_start(), mesh, [Shard(d)])) for d in STACK_PLACEMENTS]
    opt = Muon(stacks, lr=0.02, weight_decay=0.1, ns_dtype="float32")
    for g in _stack_grads():
        for w, d in zip(stacks, STACK_PLACEMENTS):
            w.grad = distribute_tensor(g, mesh, [Shard(d)])
        opt.step()
    return [w.full_tensor().tolist() for w in ws], calls[:6], [w.full_tensor().tolist() for w in stacks]


def _stack_start():
    return torch.randn(STACK, generator=torch.Generator().manual_seed(2))


def _stack_grads():
    return [torch.randn(STACK, generator=torch.Generator().manual_seed(20 + s)) for s in range(3)]


def _muon_start():
    g = torch.Generator().manual_seed(1)
    return [torch.randn(shape, generator=g) for shape in SHAPES]


@pytest.mark.slow
def test_muon_on_fsdp_shards_equals_one_process():
    """Each matrix is orthogonalised whole by one owner rank (matrices spread over the ranks by
    size) and its shards scattered back: the result equals the unsharded optimizer's (float32)."""
    grads = [
        [
            torch.randn(shape, generator=torch.Generator().manual_seed(10 * s + i))
            for i, shape in enumerate(SHAPES)
        ]
        for s in range(3)
    ]
    ws = [nn.Parameter(w) for w in _muon_start()]
    opt = Muon(ws, lr=0.02, weight_decay=0.1, ns_dtype="float32")
    for step_grads in grads:
        for w, g in zip(ws, step_grads):
            w.grad = g.clone()
        opt.step()
    results = spawn(_sharded_muon, 2, grads)
    for full, _, _ in results:
        for got, w in zip(full, ws):
            torch.testing.assert_close(torch.tensor(got), w.detach(), rtol=0, atol=1e-6)
    # Greedy by size: rank 0 owns (7, 5) and (3, 8), rank 1 owns (1, 4) and (6, 6); full matrices only.
    owned = [sorted(set(calls)) for _, calls, _ in results]
    assert owned == [[(3, 8), (7, 5)], [(1, 4), (6, 6)]], owned
    assert [len(calls) for _, calls, _ in results] == [6, 6]  # 2 matrices x 3 steps each
    # Stacks: split over the experts, the rows or the columns, each equals one process's stack.
    stack = nn.Parameter(_stack_start())
    opt = Muon([stack], lr=0.02, weight_decay=0.1, ns_dtype="float32")
    for g in _stack_grads():
        stack.grad = g
        opt.step()
    for _, _, stacks in results:
        for got, d in zip(stacks, STACK_PLACEMENTS):
            torch.testing.assert_close(
                torch.tensor(got), stack.detach(), rtol=0, atol=1e-6, msg=f"Shard({d})"
            )
