"""The chunked cross-entropy (components/chunked_loss.py) against today's loss on the full logits.

Reference: `cross_entropy_sum(F.linear(x, w), labels, mask)` (F.cross_entropy on [T, V]) and its
autograd gradients, float64: the chunked loss and dX, dW equal them to 1e-12 relative for every
chunk size (1, uneven, whole, beyond the trained rows), with ignored and untrained rows; a
vocabulary-parallel head (2 gloo tp ranks, the weight a Shard(0) DTensor, sequence-parallel input
rows) gives the same loss and gradients as one process. Also: what the loss keeps for its backward
is no [T, V] tensor.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests._dist import spawn
from titan_thd.components.chunked_loss import HeadInput
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.packed_batch import IGNORE_INDEX

T, D, V = 23, 8, 30


def _case(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g, dtype=dtype)
    head = nn.Linear(D, V, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, D, generator=g, dtype=dtype))
    labels = torch.randint(0, V, (T,), generator=g)
    labels[[2, 9, 10]] = IGNORE_INDEX
    mask = torch.ones(T, dtype=torch.bool)
    mask[[0, 5, 17]] = False
    return x, head, labels, mask


def _loss_and_grads(x, head, labels, mask, chunk):
    x = x.detach().clone().requires_grad_()
    head.zero_grad()
    logits = HeadInput.of(x, head, chunk) if chunk else head(x)
    loss = cross_entropy_sum(logits, labels, mask)
    (loss * 0.37).backward()  # an incoming gradient other than 1
    return loss.detach(), x.grad, head.weight.grad.clone()


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("chunk", [1, 4, 7, T, 100])
def test_chunked_equals_full_logits_float64(chunk):
    x, head, labels, mask = _case()
    want = _loss_and_grads(x, head, labels, mask, 0)
    got = _loss_and_grads(x, head, labels, mask, chunk)
    assert got[0].dtype == want[0].dtype == torch.float64
    for g, w in zip(got, want):
        assert _rel(g, w) <= 1e-12, (chunk, _rel(g, w))
    # untrained and ignored rows get no gradient, as with the full logits
    assert torch.equal(got[1][[0, 2, 5, 9, 10, 17]], torch.zeros(6, D, dtype=torch.float64))


def test_no_trained_row_gives_zero_loss_and_gradients():
    x, head, labels, _ = _case()
    loss, dx, dw = _loss_and_grads(x, head, labels, torch.zeros(T, dtype=torch.bool), 4)
    assert float(loss) == 0.0 and not dx.any() and not dw.any()


def test_bf16_head_upcasts_like_the_full_logits():
    x, head, labels, mask = _case(torch.bfloat16)
    want = _loss_and_grads(x, head, labels, mask, 0)
    got = _loss_and_grads(x, head, labels, mask, 5)
    assert got[0].dtype == torch.float32 and got[2].dtype == torch.bfloat16
    assert _rel(got[0], want[0]) <= 1e-6
    assert _rel(got[1].float(), want[1].float()) <= 1e-2  # one bf16 rounding of the logit gradient
    assert _rel(got[2].float(), want[2].float()) <= 1e-2


def test_frozen_head_gets_no_weight_gradient_and_keeps_no_logits():
    x, head, labels, mask = _case()
    head.weight.requires_grad_(False)
    x = x.requires_grad_()
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = cross_entropy_sum(HeadInput.of(x, head, 4), labels, mask)
    loss.backward()
    assert head.weight.grad is None and x.grad is not None
    assert all(V not in shape for shape in saved if shape != (V, D)), saved


def _tp_body(rank: int, world_size: int, chunk: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    x, head, labels, mask = _case()
    want = _loss_and_grads(x, head, labels, mask, 0)
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    tp_head = nn.Linear(D, V, bias=False).double()
    local_VD = head.weight.detach().chunk(world_size)[rank]
    tp_head.weight = nn.Parameter(DTensor.from_local(local_VD, mesh, [Shard(0)]))
    # T = 23 rows do not split over 2 ranks: one untrained padding row for sequence parallelism
    x24 = torch.cat([x, torch.zeros(1, D, dtype=x.dtype)])
    labels24 = torch.cat([labels, torch.tensor([IGNORE_INDEX])])
    mask24 = torch.cat([mask, torch.tensor([False])])
    mine = x24.chunk(world_size)[rank].clone().requires_grad_()  # this rank's sequence-parallel rows
    loss = cross_entropy_sum(HeadInput.of(mine, tp_head, chunk), labels24, mask24)
    (loss * 0.37).backward()
    dw = tp_head.weight.grad.full_tensor()
    dx = torch.cat(_all_gather(mine.grad, world_size))[:T]
    return max(_rel(loss.detach(), want[0]), _rel(dx, want[1]), _rel(dw, want[2]))


def _all_gather(t, world_size):
    out = [torch.empty_like(t) for _ in range(world_size)]
    torch.distributed.all_gather(out, t.contiguous())
    return out


@pytest.mark.slow
def test_vocabulary_parallel_head_equals_one_process():
    for worst in spawn(_tp_body, 2, 5):
        assert worst <= 1e-12, worst
