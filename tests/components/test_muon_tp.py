"""Muon orthogonalises whole matrices under tensor parallelism (4 gloo processes, float64).

Updates laid out as the trainer lays out parameters: colwise / rowwise TP shards on a 1-D tp
mesh, and FSDP2 over TP on the 2-D (fsdp, tp) mesh (`_StridedShard` rows for colwise), with
shapes that do not split evenly. Each result must equal `newton_schulz` of the full matrix on one
process (the same arithmetic, so rel 1e-12), through the gather-to-owner path (not the fallback
where every rank gathers the matrix), and differ from orthogonalising the local shard.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tests._dist import spawn
from titan_thd.components.muon import _row_layout, newton_schulz, orthogonalise

SHAPES = {"colwise": (11, 6), "rowwise": (6, 11)}  # (out, in) of an nn.Linear


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        for k, (a, b) in SHAPES.items():
            setattr(self, k, nn.Linear(b, a, bias=False))

    def forward(self, x):  # fully_shard needs one; never called
        raise NotImplementedError


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Pair().double()


def _body(rank: int, world: int) -> dict[str, float]:
    plan = {"colwise": ColwiseParallel(), "rowwise": RowwiseParallel()}
    worst: dict[str, float] = {}
    for name, shape in (("1d", (world,)), ("2d", (2, world // 2))):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("tp",) if len(shape) == 1 else ("fsdp", "tp"))
        model = _model()
        full = {k: getattr(model, k).weight.detach().clone() for k in SHAPES}
        parallelize_module(model, mesh["tp"], plan)
        if len(shape) == 2:
            fully_shard(model, mesh=mesh["fsdp"])
        updates = [getattr(model, k).weight.detach() for k in SHAPES]
        assert all(isinstance(u, DTensor) and u.device_mesh.ndim == len(shape) for u in updates)
        # The owner path, not the everyone-gathers fallback (which gives the same numbers).
        assert all(_row_layout(u) is not None for u in updates), [u.placements for u in updates]
        for k, got in zip(SHAPES, orthogonalise(updates, 5, torch.float64)):
            ref = newton_schulz(full[k], 5, torch.float64)
            worst[f"{name} {k}"] = ((got.full_tensor() - ref).abs().max() / ref.abs().max()).item()
            local = got.to_local()
            if local.numel():  # the local shard's own orthogonalisation is something else
                assert not torch.allclose(
                    newton_schulz(updates[0 if k == "colwise" else 1].to_local(), 5, torch.float64), local
                )
    return worst


def test_muon_orthogonalises_whole_tp_matrices():
    for worst in spawn(_body, 4):
        assert len(worst) == 4 and all(v <= 1e-12 for v in worst.values()), worst
