"""dsv4 under FSDP on 2 gloo ranks equals one process (gradients and the router-bias update), in
float64 (gradients rel <= 1e-12 of their largest entry; routing cannot flip at that precision)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests._dist import spawn
from tests.models.dsv4._util import meta, micro, packed
from titan_thd.config import ActivationCheckpoint
from titan_thd.models.dsv4 import build_dsv4, parallelize_dsv4, spec
from titan_thd.parallel.parallel_dims import ParallelDims

BATCHES = [
    {"lengths": [40, 3, 21], "pad_to": 4, "tail": 8, "seed": 1},
    {"lengths": [66], "tail": 6, "seed": 2},
]


def _loss(model, rank: int) -> torch.Tensor:
    tokens, batch = packed(**BATCHES[rank], vocab=micro().vocab_size, trained=0.8)
    out = model(tokens, meta(batch))
    labels = batch.labels.masked_fill(~batch.loss_mask, -100)
    return F.cross_entropy(out.logits, labels, reduction="sum") + sum(out.aux_losses.values())


def _fsdp_vs_one_process(rank: int, world_size: int) -> tuple[float, float]:
    """(largest gradient difference relative to the gradient's size, largest bias difference)."""
    torch.manual_seed(0)
    reference = build_dsv4(micro()).double().train()
    for r in range(world_size):
        _loss(reference, r).backward()
    spec.after_optimizer_step(reference, None)
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=world_size)
    dims.build_meshes("cpu")
    torch.manual_seed(0)
    model = parallelize_dsv4(
        build_dsv4(micro()).double(),
        dims,
        ac=ActivationCheckpoint(),
    ).train()
    _loss(model, rank).backward()
    spec.after_optimizer_step(model, dims.get_optional_mesh("loss").get_group())
    ref = dict(reference.named_parameters())
    grad_err = 0.0
    for n, p in model.named_parameters():
        g = None if p.grad is None else p.grad.full_tensor()
        if ref[n].grad is None:
            assert g is None or g.abs().max() == 0, n
            continue
        grad_err = max(grad_err, ((g - ref[n].grad).abs().max() / ref[n].grad.abs().max()).item())
    bias_err = max(
        (a.bias - b.bias).abs().max().item() for a, b in zip(model.router_gates(), reference.router_gates())
    )
    return grad_err, bias_err


@pytest.mark.slow
def test_fsdp_two_ranks_match_one_process():
    """Each rank packs different documents; summed FSDP gradients equal the one-process gradients,
    and the bias update sees the load of both ranks."""
    for grad_err, bias_err in spawn(_fsdp_vs_one_process, 2):
        assert grad_err <= 1e-12 and bias_err == 0.0
