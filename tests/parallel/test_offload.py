"""activation_checkpoint.offload (parallel/offload.py) on a chain of fully recomputed blocks, CPU.

Against the same chain recomputed without offload (the reference): the loss and every gradient
bitwise equal; each block's inputs went to host memory (observed, one copy per block input); the
backward fetches a block's inputs when its recomputation unpacks them and the block before it one
ahead, in reverse order; a non-contiguous input stays where it is; validation (no autograd) offloads
nothing; a DTensor input moves its local shard and comes back a DTensor (no model of today passes one:
llama's sequence-parallel rows reach its blocks as plain tensors). The trainer's layouts: tests/test_train_long.py.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from titan_thd.parallel import offload
from titan_thd.parallel.recompute import checkpoint_blocks

D, T = 6, 5


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, D)

    def forward(self, x, scale):
        return torch.tanh(self.lin(x)) * scale + x


def _chain(offloaded: bool) -> nn.ModuleList:
    torch.manual_seed(0)
    blocks = nn.ModuleList(_Block() for _ in range(3)).double()
    checkpoint_blocks(list(blocks), offload=offloaded)
    return blocks


def _step(blocks, x, scale):
    h = x
    for b in blocks:
        h = b(h, scale)
    loss = (h**2).sum()
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in blocks.parameters()]


def test_offloaded_inputs_give_the_same_step_bitwise(monkeypatch):
    x = torch.randn(T, D, dtype=torch.float64, requires_grad=True)
    scale = torch.randn(T, 1, dtype=torch.float64)
    want = _step(_chain(False), x, scale)
    want_dx, x.grad = x.grad.clone(), None

    order: list[str] = []
    fetch, unpack = offload.Offloader._fetch, offload.Offloader._unpack

    def logged_fetch(self, group):
        if group.fetched is None and group.device is not None:
            order.append(f"fetch {groups.index(group)}")
        fetch(self, group)

    def logged_unpack(self, group, packed):
        out = unpack(self, group, packed)
        order.append(f"unpack {groups.index(group)}")
        return out

    groups: list = []
    monkeypatch.setattr(offload.Offloader, "_fetch", logged_fetch)
    monkeypatch.setattr(offload.Offloader, "_unpack", logged_unpack)
    monkeypatch.setattr(offload, "_Group", _recording(offload._Group, groups))
    host: list[torch.Tensor] = []
    with offload.observe_offload(host.append):
        got = _step(_chain(True), x, scale)
    assert torch.equal(got[0], want[0]) and torch.equal(x.grad, want_dx)
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
    assert [tuple(h.shape) for h in host] == [(T, D), (T, 1)] * 3  # each block's two inputs
    assert all(h.device.type == "cpu" for h in host)
    # the last block's inputs first, the block before fetched with them (one ahead), and so on
    assert order == [
        *["fetch 2", "fetch 1", "unpack 2", "unpack 2"],
        *["fetch 0", "unpack 1", "unpack 1"],
        *["unpack 0", "unpack 0"],
    ], order


def _recording(cls, into: list):
    class Recorded(cls):
        __slots__ = ()

        def __init__(self, prev):
            super().__init__(prev)
            into.append(self)

    return Recorded


def test_a_view_stays_and_validation_offloads_nothing():
    blocks = _chain(True)
    x = torch.randn(D, T, dtype=torch.float64, requires_grad=True).t()  # not contiguous
    host: list[torch.Tensor] = []
    with offload.observe_offload(host.append):
        ref = copy.deepcopy(blocks)
        with torch.no_grad():
            for b in ref:
                b(x, torch.ones(T, 1, dtype=torch.float64))
        assert host == []
        _step(blocks, x, torch.ones(T, 1, dtype=torch.float64))
    # block 0's x is a view (kept); its scale and the later blocks' inputs went to host memory
    assert [tuple(h.shape) for h in host] == [(T, 1), (T, D), (T, 1), (T, D), (T, 1)]


class _Elementwise(nn.Module):
    def forward(self, x):
        return torch.tanh(x) * x + x


def _dtensor_body(rank: int, world_size: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    x = torch.randn(T * world_size, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    out = []
    for offloaded in (False, True):
        blocks = [_Elementwise() for _ in range(3)]
        checkpoint_blocks(blocks, offload=offloaded)
        local = x.chunk(world_size)[rank].clone().requires_grad_()
        h = DTensor.from_local(local, mesh, [Shard(0)])  # sequence-parallel rows, as a DTensor
        host: list[torch.Tensor] = []
        with offload.observe_offload(host.append):
            for b in blocks:
                h = b(h)
            assert isinstance(h, DTensor)
            (h.to_local() ** 2).sum().backward()
        out.append((local.grad, len(host)))
    (want, _), (got, moved) = out
    return moved == 3 and torch.equal(got, want)


def test_a_dtensor_input_moves_its_local_shard():
    from tests._dist import spawn

    assert spawn(_dtensor_body, 1) == [True]
