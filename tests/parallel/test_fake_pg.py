"""Dry runs on the fake process group: one process plays one rank of a large world.

Collectives are no-ops here, so these tests check construction only: mesh names, sizes and
membership, and the shapes of FSDP shards. Numerics are tested on real gloo processes.
"""

import math

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from titan_thd.config import Comm
from titan_thd.memory.state import estimate_memory_per_rank, largest_unsharded_unit_bytes
from titan_thd.parallel import distributed
from titan_thd.parallel.fsdp import apply_fsdp, build_on_meta, materialize_sharded
from titan_thd.parallel.parallel_dims import ParallelDims


@pytest.fixture
def fake_world():
    started = []

    def start(world_size, rank=0):
        started.append(distributed.init_fake(world_size, rank))
        return started[-1]

    yield start
    distributed.destroy()


def _coords(rank, pp, dp, cp, tp):
    """(pp, dp, cp, tp) coordinates of a global rank; tp varies fastest."""
    rest, t = divmod(rank, tp)
    rest, c = divmod(rest, cp)
    p, d = divmod(rest, dp)
    return p, d, c, t


def _global_rank(p, d, c, t, pp, dp, cp, tp):
    return ((p * dp + d) * cp + c) * tp + t


class Blocks(nn.Module):
    def __init__(self, dim=64, hidden=4096, n=2):
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.Linear(hidden, dim)) for _ in range(n)
        )
        self.norm = nn.LayerNorm(dim)


LAYOUTS = [  # pp, dp, cp, tp, rank
    (1, 1024, 1, 1, 777),
    (2, 64, 2, 4, 701),
    (4, 16, 4, 4, 1023),
    (1, 256, 4, 1, 37),
    (2, 2, 2, 2, 13),
]


@pytest.mark.parametrize("pp,dp,cp,tp,rank", LAYOUTS)
def test_named_meshes_and_fsdp_plan(fake_world, pp, dp, cp, tp, rank):
    world = pp * dp * cp * tp
    fake_world(world, rank)
    dims = ParallelDims(pp=pp, dp_shard=-1, cp=cp, tp=tp, world_size=world)
    dims.build_meshes("cpu")
    p, d, c, t = _coords(rank, pp, dp, cp, tp)

    def members(mesh):
        return sorted(mesh.mesh.flatten().tolist())

    expect = {
        "batch": [_global_rank(p, i, c, t, pp, dp, cp, tp) for i in range(dp)],
        "loss": sorted(_global_rank(p, i, j, t, pp, dp, cp, tp) for i in range(dp) for j in range(cp)),
        "cp": [_global_rank(p, d, j, t, pp, dp, cp, tp) for j in range(cp)],
        "tp": [_global_rank(p, d, c, j, pp, dp, cp, tp) for j in range(tp)],
        "pp": [_global_rank(j, d, c, t, pp, dp, cp, tp) for j in range(pp)],
    }
    expect["fsdp"] = expect["loss"]
    for name, ranks in expect.items():
        mesh = dims.get_mesh(name)
        assert mesh.size() == len(ranks) == dims.mesh_size(name), name
        assert members(mesh) == ranks, name
        assert (dims.get_optional_mesh(name) is None) == (len(ranks) == 1), name
    assert dims.mesh_rank("batch") == d and dims.mesh_rank("cp") == (c if cp > 1 else 0)
    assert dims.mesh_rank("fsdp") == d * cp + c

    model = Blocks()
    apply_fsdp(model, dims.get_mesh("fsdp"), blocks=model.layers)
    n = dims.fsdp_degree
    w = model.layers[0][0].weight
    assert isinstance(w, DTensor) and w.placements == (Shard(0),) and w.shape == (4096, 64)
    rows = math.ceil(4096 / n)
    assert w.to_local().shape == (max(0, min(rows, 4096 - dims.mesh_rank("fsdp") * rows)), 64)
    bias = model.layers[0][1].bias  # 64 rows over up to 1,024 ranks: most ranks hold nothing
    assert bias.to_local().numel() == max(
        0, min(math.ceil(64 / n), 64 - dims.mesh_rank("fsdp") * math.ceil(64 / n))
    )


def test_meta_build_shard_materialize(fake_world):
    """A model too large for this machine (8 × 16384² ≈ 2.1e9 parameters, 8.6 GB in fp32) only
    ever allocates its 1/1024 shards."""
    fake_world(1024, 0)
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=1024)
    dims.build_meshes("cpu")
    model = build_on_meta(lambda: nn.Sequential(*[nn.Linear(16384, 16384, bias=False) for _ in range(8)]))
    assert all(p.is_meta for p in model.parameters())
    apply_fsdp(model, dims.get_mesh("fsdp"), blocks=list(model))
    materialize_sharded(model, "cpu")
    locals_ = [p.to_local() for p in model.parameters()]
    assert all(t.device.type == "cpu" and t.shape == (16, 16384) for t in locals_)
    assert all(torch.isfinite(t).all() and t.std() > 0.01 for t in locals_)
    est = estimate_memory_per_rank(model, dims, "adamw", torch.float32)
    assert est.params == sum(t.numel() for t in locals_) == 8 * 16 * 16384
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == (
        4 * est.params,
        4 * est.params,
        8 * est.params,
    )
    assert str(est) == (
        "2,097,152 parameters per rank (master 4 + grads 4 + optimizer 8 B per parameter); estimated "
        "memory per rank: params 8.00 MiB + grads 8.00 MiB + "
        "optimizer 16.00 MiB = 32.00 MiB (activations excluded)"
    )


def test_memory_estimate_muon_and_bf16():
    model = Blocks(dim=8, hidden=30, n=1)  # 30 rows over 4 ranks: rank 0 holds ceil(30/4) = 8
    dims = ParallelDims(pp=1, dp_shard=2, cp=2, tp=1, world_size=4)
    muon = {"layers.0.0.weight", "layers.0.1.weight"}
    est = estimate_memory_per_rank(model, dims, "muon", torch.bfloat16, muon_params=muon)
    local = {
        "layers.0.0.weight": 8 * 8,
        "layers.0.0.bias": 8,
        "layers.0.1.weight": 2 * 30,
        "layers.0.1.bias": 2,
        "norm.weight": 2,
        "norm.bias": 2,
    }
    assert est.params == sum(local.values())
    assert est.param_bytes == 2 * est.params
    states = sum(n * (1 if name in muon else 2) for name, n in local.items())
    assert est.optimizer_bytes == 2 * states
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        estimate_memory_per_rank(model, dims, "sgd")


def test_init_distributed_fake_mode(monkeypatch):
    monkeypatch.setenv("NGPU", "64")
    info = distributed.init_distributed(Comm(mode="fake"))
    try:
        assert (info.world_size, info.rank, info.fake) == (64, 0, True)
        assert distributed.is_fake() and distributed.world_size() == 64
        # collectives run but return the local value: fine for plans, useless for numbers
        dims = ParallelDims(pp=1, dp_shard=-1, cp=2, tp=1, world_size=64)
        dims.build_meshes("cpu")
        assert distributed.dist_sum(torch.tensor([3.0]), dims.get_mesh("loss")).item() == 3.0
    finally:
        distributed.destroy()
    monkeypatch.delenv("NGPU")
    with pytest.raises(ValueError, match="NGPU"):
        distributed.init_distributed(Comm(mode="fake"))


def test_single_process_helpers_are_local():
    info = distributed.init_distributed(Comm())
    assert (info.world_size, info.rank, info.fake) == (1, 0, False)
    assert not torch.distributed.is_initialized()
    assert distributed.dist_sum(2.5, None) == 2.5 and distributed.dist_max(7, None) == 7
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.broadcast_object({"a": 1}) == {"a": 1}


def test_largest_unsharded_unit_is_one_block_not_the_shard(fake_world):
    """The fake-PG dry run sizes its step by what one all-gather materialises: a whole block."""
    fake_world(64)
    dims = ParallelDims(pp=1, dp_shard=64, cp=1, tp=1, world_size=64)
    dims.build_meshes("cpu")
    model = build_on_meta(lambda: Blocks(dim=64, hidden=4096, n=2))
    apply_fsdp(model, dims.get_mesh("fsdp"), list(model.layers))
    block = (64 * 4096 + 4096) + (4096 * 64 + 64)  # both Linear layers of one block, with biases
    assert largest_unsharded_unit_bytes(model) == 4 * block
    # The root unit owns only the LayerNorm (64 weights + 64 biases), the blocks are their own units.
    assert largest_unsharded_unit_bytes(model.norm) == 4 * 128
