"""parallel/shards.py: a parameter's canonical name under every wrapper torch inserts, and the box of
the global tensor a rank holds."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

from tests._dist import spawn
from titan_thd.parallel.shards import WRAPPER_NAMES, canonical_name, local_box


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("layers.0.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("layers.0._checkpoint_wrapped_module.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("_orig_mod.layers.0.attn.wq.weight", "layers.0.attn.wq.weight"),
        ("layers.0._fsdp_wrapped_module.attn.wq.weight", "layers.0.attn.wq.weight"),
        # nested and repeated, at the start and inside
        ("_orig_mod._orig_mod.tok_embeddings.weight", "tok_embeddings.weight"),
        ("_fsdp_wrapped_module.layers.3._checkpoint_wrapped_module._orig_mod.ffn.w1", "layers.3.ffn.w1"),
        # a module whose name merely contains a wrapper's is not a wrapper
        ("layers.0.my_orig_mod.weight", "layers.0.my_orig_mod.weight"),
        ("x_checkpoint_wrapped_module.weight", "x_checkpoint_wrapped_module.weight"),
    ],
)
def test_canonical_name(name: str, expected: str) -> None:
    assert canonical_name(name) == expected


def test_canonical_name_of_real_wrappers() -> None:
    """The names torch itself produces: checkpoint_wrapper inside a compiled module."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    inner = nn.Sequential(nn.Linear(2, 2))
    inner[0] = checkpoint_wrapper(inner[0])
    model = torch.compile(inner, backend="eager")
    names = [n for n, _ in model.named_parameters()]
    assert any(w in n for n in names for w in WRAPPER_NAMES), names
    assert sorted(canonical_name(n) for n in names) == ["0.bias", "0.weight"]


def test_local_box_of_plain_tensor() -> None:
    t = torch.arange(12.0).reshape(3, 4)
    local, box = local_box(t)
    assert local is t
    assert box == (slice(0, 3), slice(0, 4))


def _boxes(rank: int, world: int) -> list[tuple[list[tuple[int, int]], bool]]:
    mesh = init_device_mesh("cpu", (world,))
    full = torch.arange(5 * 6, dtype=torch.float32).reshape(5, 6)
    out = []
    for placements in ([Shard(0)], [Shard(1)], [Replicate()]):
        d = distribute_tensor(full, mesh, placements)
        local, box = local_box(d)
        out.append(([(s.start, s.stop) for s in box], torch.equal(local, full[box])))
    return out


def test_local_box_of_dtensor() -> None:
    """Two gloo ranks: rows split unevenly (3 + 2), columns split (3 + 3), replicated."""
    r0, r1 = spawn(_boxes, 2)
    assert r0 == [([(0, 3), (0, 6)], True), ([(0, 5), (0, 3)], True), ([(0, 5), (0, 6)], True)]
    assert r1 == [([(3, 5), (0, 6)], True), ([(0, 5), (3, 6)], True), ([(0, 5), (0, 6)], True)]
