import math

import pytest
import torch

from titan_thd.components.lr_scheduler import LRSchedulersContainer, lr_factor
from titan_thd.components.optimizer import build_optimizers
from titan_thd.config import LRScheduler, Optimizer
from titan_thd.models.spec import ModelSpec, ParallelSpec


def test_warmup_then_cosine_worked_values():
    f = [lr_factor(i, warmup_steps=2, total_steps=7, decay="cosine", min_lr_factor=0.1) for i in range(9)]
    # warmup (i+1)/(w+1); cosine over i = 2..6 (span 4); held at min afterwards
    expected = [1 / 3, 2 / 3, 1.0]
    expected += [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in (1, 2, 3, 4)]
    expected += [0.1, 0.1]
    assert f == pytest.approx(expected, abs=1e-12)


def test_linear_and_none():
    lin = [lr_factor(i, 0, 5, "linear", 0.0) for i in range(5)]
    assert lin == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0])
    assert [lr_factor(i, 1, 5, "none", 0.0) for i in range(5)] == pytest.approx([0.5, 1, 1, 1, 1])
    # warmup longer than the schedule: all warmup, no division by zero
    assert [lr_factor(i, 5, 3, "cosine", 0.0) for i in range(3)] == pytest.approx([1 / 6, 2 / 6, 3 / 6])
    assert lr_factor(0, 0, 1, "cosine", 0.2) == pytest.approx(0.2)


def _opt_and_sched(total_steps=0, training_steps=6):
    model = torch.nn.Linear(3, 3)
    spec = ModelSpec(name="toy", flavors={}, build=None, flops_per_step=None, parallel=ParallelSpec("zigzag"))
    opts = build_optimizers(model, Optimizer(lr=1.0), spec)
    cfg = LRScheduler(warmup_steps=1, decay="linear", min_lr_factor=0.0, total_steps=total_steps)
    return opts, LRSchedulersContainer(opts, cfg, training_steps)


def test_container_drives_every_param_group_and_resumes():
    opts, sched = _opt_and_sched(total_steps=5, training_steps=100)  # pinned schedule wins
    seen = []
    for _ in range(4):
        seen.append(sched.current_lr)
        opts.step()
        sched.step()
        groups = [g["lr"] for o in opts.optimizers for g in o.param_groups]
        assert groups == pytest.approx([groups[0]] * len(groups))
    assert seen == pytest.approx([0.5, 1.0, 2 / 3, 1 / 3])
    state = sched.state_dict()
    opts2, sched2 = _opt_and_sched(total_steps=5, training_steps=100)
    sched2.load_state_dict(state)
    assert sched2.current_lr == pytest.approx(sched.current_lr)
    opts2.step()
    sched2.step()
    opts.step()
    sched.step()
    assert sched2.current_lr == pytest.approx(sched.current_lr) == pytest.approx(0.0)
