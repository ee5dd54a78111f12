"""Expert-parallel meshes and sharding on the fake process group (construction only), and the
user errors of `parallelism.expert_parallel_degree` (before any process group)."""

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor, Shard

from titan_thd.config import ActivationCheckpoint, load_config
from titan_thd.memory.state import estimate_memory_per_rank, largest_unsharded_unit_bytes
from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.model import build_dsv4
from titan_thd.models.dsv4.parallelize import parallelize_dsv4
from titan_thd.parallel import distributed
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.startup import resolve_run

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def fake_world():
    yield lambda world, rank: distributed.init_fake(world, rank)
    distributed.destroy()


@pytest.mark.parametrize(
    "pp,dp,cp,ep,rank",
    [(1, 256, 4, 64, 777), (2, 4, 2, 4, 13), (1, 4, 1, 4, 2)],
)
def test_ep_and_efsdp_meshes(fake_world, pp, dp, cp, ep, rank):
    world = pp * dp * cp
    fake_world(world, rank)
    dims = ParallelDims(pp=pp, dp_shard=-1, cp=cp, tp=1, world_size=world, ep=ep)
    dims.build_meshes("cpu")
    stage, flat = divmod(rank, dp * cp)  # this rank's stage and its dp x cp index (cp fastest)
    base = stage * dp * cp
    group, pos = divmod(flat, ep)
    expect = {
        "ep": [base + group * ep + j for j in range(ep)],  # a run of ep consecutive dp x cp ranks
        "efsdp": [base + g * ep + pos for g in range(dp * cp // ep)],  # the same position in every run
    }
    for name, ranks in expect.items():
        mesh = dims.get_mesh(name)
        assert sorted(mesh.mesh.flatten().tolist()) == ranks, name
        assert mesh.size() == dims.mesh_size(name) == len(ranks), name
    assert dims.mesh_rank("ep") == pos


def test_dsv4_experts_sharded_over_efsdp(fake_world):
    """micro at dp 16 x cp 4 with ep 4 (fsdp rank 0): the stacked experts of every MoE are split
    over ep 4 on the expert dimension (this rank: expert 0 of 4) and over efsdp 16 on their output
    dimension; dense weights over all 64. The memory estimate (from shapes and meshes) equals the
    shards actually held, and the largest unit is one block without its experts (they are
    gathered apart)."""
    fake_world(64, 0)
    dims = ParallelDims(pp=1, dp_shard=-1, cp=4, tp=1, world_size=64, ep=4)
    dims.build_meshes("cpu")
    args = flavors["micro"]
    model = parallelize_dsv4(
        build_on_meta(lambda: build_dsv4(args)),
        dims,
        ac=ActivationCheckpoint(),
    )
    local = 0
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor), name
        if ".ffn.experts." in name:
            assert p.device_mesh.mesh_dim_names == ("efsdp", "ep"), name
            assert p.placements == (Shard(1), Shard(0)), (name, p.placements)
            out = args.dim if name.endswith("w2") else args.moe_inter_dim
            assert tuple(p.to_local().shape) == (1, out // 16, p.shape[2]), name
        else:
            assert p.device_mesh.size() == 64, name
        local += p.to_local().numel()
    assert estimate_memory_per_rank(model, dims, "adamw", torch.float32).params == local
    block = model.layers["1"]
    dense = sum(p.numel() * 4 for n, p in block.named_parameters() if ".experts." not in n)
    embed = model.embed.weight.numel() * 4  # the root unit: embedding, head and the rest
    assert dense <= largest_unsharded_unit_bytes(model) <= max(dense, 2 * embed + dense)


def _cfg(tmp_path, *extra):
    return load_config(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "dsv4_flash_thd.toml"),
            "--model.flavor",
            "micro",
            "--job.dump_folder",
            str(tmp_path),
            *extra,
        ]
    )


@pytest.mark.parametrize(
    "world, extra, message",
    [
        (
            8,
            ("--parallelism.expert_parallel_degree", "8"),
            r"expert_parallel_degree = 8 does not divide .*n_experts = 4",
        ),
        (
            6,
            ("--parallelism.expert_parallel_degree", "4"),
            r"expert_parallel_degree = 4 does not divide dp_shard 6 × cp 1 = 6 .*nearest valid degrees are 3 or 6",
        ),
        (2, ("--parallelism.expert_parallel_degree", "0"), r"expert_parallel_degree: got 0"),
        (  # ep lives inside one HSDP replica: dp_shard x cp = 1 here
            4,
            (
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.data_parallel_replicate_degree",
                "4",
            ),
            r"expert_parallel_degree = 2 does not divide dp_shard 1 × cp 1 = 1",
        ),
    ],
)
def test_bad_expert_parallel_degree(tmp_path, world, extra, message):
    with pytest.raises(ValueError, match=message):
        resolve_run(_cfg(tmp_path, *extra), world)


def test_expert_parallel_needs_experts(tmp_path):
    cfg = load_config(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "debug_dense_thd.toml"),
            "--job.dump_folder",
            str(tmp_path),
            "--parallelism.expert_parallel_degree",
            "2",
        ]
    )
    with pytest.raises(
        ValueError, match=r"expert_parallel_degree = 2: model llama debug has no routed experts"
    ):
        resolve_run(cfg, 2)
