"""The composed layouts' meshes on the fake process group (construction only, one process) and the
start-up refusals of degrees that do not fit (before any process group).

World order (pp, dp_replicate, dp_shard, cp, tp), tp fastest: rank = (((p R + r) S + s) C + c) Tp + t.
"""

import pytest
from torch.distributed.tensor import DTensor, Shard

from titan_thd.config import ActivationCheckpoint
from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.model import build_dsv4
from titan_thd.models.dsv4.parallelize import parallelize_dsv4
from titan_thd.parallel import distributed
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.parallel.parallel_dims import ParallelDims

PP, R, S, C, TP, EP = 2, 2, 2, 2, 2, 2  # 32 ranks, every degree 2
WORLD = PP * R * S * C * TP


def rank_of(p, r, s, c, t):
    return (((p * R + r) * S + s) * C + c) * TP + t


@pytest.fixture
def dims():
    rank = rank_of(1, 1, 0, 1, 1)
    distributed.init_fake(WORLD, rank)
    d = ParallelDims(pp=PP, dp_shard=S, cp=C, tp=TP, world_size=WORLD, ep=EP, dp_replicate=R)
    d.build_meshes("cpu")
    yield d
    distributed.destroy()


def ranks(mesh) -> list[int]:
    return sorted(mesh.mesh.flatten().tolist())


def test_hsdp_ep_tp_meshes(dims):
    p, t = 1, 1
    assert dims.dp == R * S and dims.fsdp_degree == S * C and dims.efsdp_degree == S * C // EP
    # The planner's data-parallel ranks: replicas x shards (same pp, cp, tp coordinate).
    assert ranks(dims.get_mesh("batch")) == sorted(rank_of(p, r, s, 1, t) for r in range(R) for s in range(S))
    assert dims.mesh_rank("batch") == 1 * S + 0
    loss = sorted(rank_of(p, r, s, c, t) for r in range(R) for s in range(S) for c in range(C))
    assert ranks(dims.get_mesh("loss")) == loss
    fsdp = dims.get_mesh("fsdp")  # HSDP: 2-D, replicas outer
    assert fsdp.mesh_dim_names == ("replicate", "shard") and fsdp.shape == (R, S * C)
    assert sorted(fsdp["shard"].mesh.tolist()) == sorted(
        rank_of(p, 1, s, c, t) for s in range(S) for c in range(C)
    )
    # ep: consecutive dp_shard x cp ranks of one replica and tp coordinate (here the cp pair).
    assert ranks(dims.get_mesh("ep")) == [rank_of(p, 1, 0, c, t) for c in range(C)]
    ep_tp = dims.get_mesh("ep_tp")
    assert ep_tp.shape == (EP, TP)
    assert ranks(ep_tp) == sorted(rank_of(p, 1, 0, c, tt) for c in range(C) for tt in range(TP))
    assert ranks(dims.get_mesh("efsdp")) == sorted(rank_of(p, r, s, 1, t) for r in range(R) for s in range(S))


def test_dsv4_experts_under_tp_ep_hsdp(dims):
    """Experts: whole ones over ep, hidden columns over tp, FSDP over (replicate, efsdp) on the model
    width; everything else HSDP on (replicate, shard) (x tp for TP-split weights)."""
    args = flavors["micro"]
    model = parallelize_dsv4(
        build_on_meta(lambda: build_dsv4(args)),
        dims,
        ac=ActivationCheckpoint(),
    )
    experts = model.layers["1"].ffn.experts
    E, F, D = args.n_experts, args.moe_inter_dim, args.dim
    for name, hidden, width in (("w1", 1, 2), ("w3", 1, 2), ("w2", 2, 1)):
        p = getattr(experts, name)
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 4, name
        assert p.device_mesh.mesh_dim_names[-2:] == ("expert_ep", "expert_tp")
        assert p.placements[-2:] == (Shard(0), Shard(hidden)) and p.placements[1] == Shard(width), (
            p.placements
        )
        local = (
            [E // EP, F // TP, D // (S * C // EP)] if name != "w2" else [E // EP, D // (S * C // EP), F // TP]
        )
        assert list(p.to_local().shape) == local, name
    wq_b = model.layers["1"].attn.wq_b.weight
    assert wq_b.device_mesh.mesh_dim_names == ("replicate", "shard", "tp")


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"pp": 2, "dp_shard": -1, "cp": 2, "tp": 2, "world_size": 12}, r"= 8 does not divide world size 12.*nearest valid degrees: pp 1 or 3, cp 1 or 3, tp 1 or 3"),
        ({"pp": 1, "dp_shard": -1, "cp": 1, "tp": 1, "world_size": 6, "dp_replicate": 4}, r"dp_replicate 4 .*= 4 does not divide world size 6.*dp_replicate 3 or 6"),
        ({"pp": 1, "dp_shard": 2, "cp": 2, "tp": 1, "world_size": 8, "dp_replicate": 2, "ep": 3}, r"expert_parallel_degree = 3 does not divide dp_shard 2 × cp 2 = 4.*nearest valid degrees are 2 or 4"),
        ({"pp": 1, "dp_shard": 1, "cp": 1, "tp": 1, "world_size": 1, "dp_replicate": 0}, r"dp_replicate = 0: expected >= 1"),
    ],
)  # fmt: skip
def test_degrees_that_do_not_fit_name_the_nearest_valid_ones(kw, message):
    with pytest.raises(ValueError, match=message):
        ParallelDims(**kw)


def test_replicate_degree_reaches_the_dims(make_config):
    cfg = make_config("--parallelism.data_parallel_replicate_degree", "2")
    dims = ParallelDims.from_config(cfg.parallelism, 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.dp) == (2, 4, 8)
