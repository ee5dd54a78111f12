"""Built as shards: the trainer's model is built on the meta device, cut and sharded there, and every rank
allocates and fills only its own shards (parallel/seeded_init.py). The weights must be a function of
the seed alone: gathered from several layouts, bitwise those of the one-process model.

The reference is independent of the sharded path: one process, plain tensors, every block drawn in
full. Blocks are made small (BLOCK_BYTES = 4 KiB) so that every tensor spans many blocks and a rank's
rows start and end inside one.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from tests._dist import spawn
from titan_thd.components.precision import Precision
from titan_thd.config import load_config
from titan_thd.parallel import seeded_init
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.parallel.shards import canonical_name
from titan_thd.pipeline.runner import build
from titan_thd.startup import resolve_run

SEED, BLOCK = 1234, 4096
F32 = Precision(torch.float32, torch.float32, torch.float32)


def _args(model: str, flavor: str, *layout: str, folder: str) -> list[str]:
    return ["--model.name", model, "--model.flavor", flavor, "--job.dump_folder", folder, *layout]


def _reference(argv: list[str]) -> dict[str, torch.Tensor]:
    run = resolve_run(load_config(argv), 1)
    model = build_on_meta(lambda: run.spec.build(run.model_args)).to_empty(device="cpu")
    model.init_weights(SEED)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _all_layouts(rank: int, world: int, argvs: list[list[str]]) -> list[dict[str, torch.Tensor]]:
    """Every layout in turn, in one set of processes (their start-up is most of the cost)."""
    seeded_init.BLOCK_BYTES = BLOCK
    return [_sharded(world, argv) for argv in argvs]


def _sharded(world: int, argv: list[str]) -> dict[str, torch.Tensor]:
    fp32 = ["--training.mixed_precision_param", "float32", "--training.compile", "false"]
    run = resolve_run(load_config([*argv, *fp32]), world)
    assert run.precision == F32 and not run.compile.on
    run.dims.build_meshes("cpu")
    model = build_on_meta(lambda: run.spec.build(run.model_args))
    parts = build(model, run, torch.device("cpu"), init=lambda m: m.init_weights(SEED))
    out, sharded = {}, 0
    for name, t in parts.module.state_dict().items():
        if isinstance(t, DTensor):
            sharded += t.to_local().numel() < t.numel()
            t = t.full_tensor()
        out[canonical_name(name)] = t.detach().clone()
    assert sharded > 0, "nothing was sharded: the layout did not apply"
    return out


LAYOUTS = {
    "dsv4 fsdp4": ("dsv4", "micro", []),
    "dsv4 tp2 x fsdp2": ("dsv4", "micro", ["--parallelism.tensor_parallel_degree", "2"]),
    "dsv4 ep2 x fsdp2": ("dsv4", "micro", ["--parallelism.expert_parallel_degree", "2"]),
    "dsv4 pp2 x tp2": (
        "dsv4",
        "micro",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
    ),
    "llama pp2 x fsdp2": (
        "llama",
        "debug",
        ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "2"],
    ),
}


def test_every_layout_builds_the_one_process_weights(tmp_path, monkeypatch):
    # Here (the test's process: later tests must see the real block size) and in each spawned rank.
    monkeypatch.setattr(seeded_init, "BLOCK_BYTES", BLOCK)
    argvs = [
        _args(model, flavor, *extra, "--training.tokens_per_microbatch", "256", folder=str(tmp_path))
        for model, flavor, extra in LAYOUTS.values()
    ]
    references = {
        model: _reference(
            _args(model, flavor, "--training.tokens_per_microbatch", "256", folder=str(tmp_path))
        )
        for model, flavor, _ in LAYOUTS.values()
    }
    results = spawn(_all_layouts, 4, argvs)
    for i, (layout, (model, _, _)) in enumerate(LAYOUTS.items()):
        reference, seen = references[model], set()
        for rank, per_layout in enumerate(results):
            for name, t in per_layout[i].items():
                assert name in reference, (layout, rank, name)
                assert torch.equal(t, reference[name]), (
                    f"{layout}, rank {rank}: {name} differs from one process"
                )
                seen.add(name)
        persistent = {k for k in reference if not k.endswith(".load")}  # the routers' load counts
        assert persistent <= seen, (layout, sorted(persistent - seen)[:5])
