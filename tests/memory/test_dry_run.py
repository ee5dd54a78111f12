"""The fake-process-group dry run builds its model on the meta device and fills its shards only for
a step that fits this machine (memory/dry_run.py, docs/results.md §14)."""

import torch
from torch import nn

from titan_thd.components.optimizer import OptimizersContainer
from titan_thd.memory.dry_run import materialize


def test_materialize_points_the_optimizers_at_the_filled_parameters():
    """A plain parameter (no FSDP, e.g. a pp-only layout) is replaced when its shards are filled: the
    optimizers built on the meta model follow it, and the step updates the filled weights."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    optimizers = OptimizersContainer(model, [opt])
    materialize(model, torch.device("cpu"), optimizers)
    params = list(model.parameters())
    assert not any(p.is_meta for p in params)
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    before = params[0].detach().clone()
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    assert not torch.equal(before, params[0])
