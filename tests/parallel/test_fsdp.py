"""FSDP2 on 2 gloo processes against a single-process reference (float64, rel <= 1e-12).

Each rank trains on a different half of a batch with a *sum* loss; because apply_fsdp sums
gradients over the fsdp mesh (no division), the sharded gradients must equal the gradient of the
whole batch in one process, and one AdamW step must equal the single-process step.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests._dist import spawn
from titan_thd.components.precision import Precision
from titan_thd.parallel import distributed
from titan_thd.parallel.fsdp import apply_fsdp
from titan_thd.parallel.parallel_dims import ParallelDims

SEED = 1234


class Net(nn.Module):
    def __init__(self, dim=16, hidden=48, vocab=11, n_blocks=3):
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, dim)) for _ in range(n_blocks)
        )
        self.head = nn.Linear(dim, vocab)

    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


class Gated(nn.Module):
    """A block whose `gate` runs only for inputs of more than 4 rows: data-dependent control flow,
    like attention skipping an all-padding microbatch or a MoE expert that gets no tokens."""

    def __init__(self, dim=16):
        super().__init__()
        self.ff = nn.Linear(dim, dim)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x):
        h = self.ff(x)
        return h + self.gate(x) if x.shape[0] > 4 else h


def _batch():
    g = torch.Generator().manual_seed(7)
    return torch.randn(10, 16, generator=g, dtype=torch.float64), torch.randint(0, 11, (10,), generator=g)


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _train_step(model, x, y):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    loss = F.cross_entropy(model(x), y, reduction="sum")
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    opt.step()
    return loss.detach(), grads


def _fsdp_body(rank, world_size):
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=world_size)
    dims.build_meshes("cpu")
    out = {
        "sizes": {n: dims.get_mesh(n).size() for n in ("batch", "loss", "fsdp", "cp", "tp", "pp")},
        "batch_rank": dims.mesh_rank("batch"),
    }
    loss_mesh = dims.get_optional_mesh("loss")
    out["sum"] = distributed.dist_sum(torch.tensor([rank + 1.0]), loss_mesh).item()
    out["max"] = distributed.dist_max(rank + 10, loss_mesh)
    out["any"] = (distributed.any_rank(rank == 1), distributed.any_rank(False))

    # single-process reference on the whole batch, computed identically on every rank
    x, y = _batch()
    torch.manual_seed(SEED)
    ref = Net().double()
    ref_init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_loss, ref_grads = _train_step(ref, x, y)

    torch.manual_seed(SEED)
    model = Net().double()
    apply_fsdp(model, dims.get_mesh("fsdp"), blocks=model.blocks)
    full = {n: p.full_tensor() for n, p in model.named_parameters()}
    out["init_equal"] = all(torch.equal(full[n], ref_init[n]) for n in ref_init)

    half = slice(rank * 5, rank * 5 + 5)  # each rank trains on its own half of the batch
    loss, grads = _train_step(model, x[half], y[half])
    out["loss_rel"] = abs(distributed.dist_sum(loss, loss_mesh).item() - ref_loss.item()) / ref_loss.item()
    out["grad_rel"] = max(_rel(grads[n].full_tensor(), ref_grads[n]) for n in ref_grads)
    out["param_rel"] = max(
        _rel(p.full_tensor(), dict(ref.named_parameters())[n].detach()) for n, p in model.named_parameters()
    )
    out["moved"] = min(_rel(dict(ref.named_parameters())[n].detach(), ref_init[n]) for n in ref_init)

    # ranks that use different parameters (gate only on rank 1) still reduce-scatter in lockstep
    rows = slice(0, 3) if rank == 0 else slice(3, 10)
    torch.manual_seed(SEED)
    gated_ref = nn.Sequential(Gated(), Gated()).double()
    for part in (slice(0, 3), slice(3, 10)):
        gated_ref(x[part]).square().sum().backward()
    torch.manual_seed(SEED)
    gated = nn.Sequential(Gated(), Gated()).double()
    apply_fsdp(gated, dims.get_mesh("fsdp"), blocks=list(gated))
    gated(x[rows]).square().sum().backward()
    out["unused_grad_rel"] = max(
        _rel(p.grad.full_tensor(), dict(gated_ref.named_parameters())[n].grad)
        for n, p in gated.named_parameters()
    )

    # bf16 compute with fp32 master weights and fp32 reduction runs on gloo
    torch.manual_seed(SEED)
    mp_model = Net()
    mixed = Precision(torch.float32, torch.bfloat16, torch.float32)
    apply_fsdp(mp_model, dims.get_mesh("fsdp"), blocks=mp_model.blocks, precision=mixed)
    logits = mp_model(x[half].float())
    mp_loss = F.cross_entropy(logits.float(), y[half], reduction="sum")
    mp_loss.backward()
    out["mp_dtypes"] = (
        logits.dtype,
        {p.grad.dtype for p in mp_model.parameters()},
        {p.dtype for p in mp_model.parameters()},
    )
    out["mp_grad_rel"] = max(_rel(p.grad.full_tensor(), ref_grads[n]) for n, p in mp_model.named_parameters())
    return out


@pytest.mark.slow
def test_fsdp_sum_gradients_match_single_process():
    results = spawn(_fsdp_body, 2)
    for rank, r in enumerate(results):
        assert r["sizes"] == {"batch": 2, "loss": 2, "fsdp": 2, "cp": 1, "tp": 1, "pp": 1}
        assert r["batch_rank"] == rank
        assert (r["sum"], r["max"], r["any"]) == (3.0, 11, (True, False))
        assert r["init_equal"], "sharding changed the weights"
        assert r["loss_rel"] <= 1e-12, r["loss_rel"]
        assert r["grad_rel"] <= 1e-12, r["grad_rel"]
        assert r["param_rel"] <= 1e-12, r["param_rel"]
        assert r["unused_grad_rel"] <= 1e-12, r["unused_grad_rel"]
        assert r["moved"] > 1e-4  # the step changed every weight, so the comparison means something
        logits_dtype, grad_dtypes, param_dtypes = r["mp_dtypes"]
        assert (
            logits_dtype == torch.bfloat16
            and grad_dtypes == {torch.float32}
            and param_dtypes == {torch.float32}
        )
        assert r["mp_grad_rel"] <= 3e-2, r["mp_grad_rel"]  # bf16 compute, summed (not averaged) gradients
