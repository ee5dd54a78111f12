"""Learning-rate schedule: linear warmup, then cosine / linear / constant decay to min_lr_factor.

`lr_factor(i)` is the multiplier of `optimizer.lr` used by optimizer step i + 1 (i = steps already
taken). Warmup ramps (i + 1) / (warmup + 1), so the first step already moves the weights; the
decay then runs from 1 at i = warmup to `min_lr_factor` at the last step of the schedule
(i = total - 1) and stays there if training runs longer (a warmup longer than the schedule simply
never reaches the decay). The schedule length is
`lr_scheduler.total_steps`, or `training.steps` when that is 0; pinning it gives a resumed run
exactly the schedule of an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
from typing import Any

from torch.optim.lr_scheduler import LambdaLR

from titan_thd.components.optimizer import OptimizersContainer
from titan_thd.config import LRScheduler as LRSchedulerConfig


def lr_factor(i: int, warmup_steps: int, total_steps: int, decay: str, min_lr_factor: float) -> float:
    """Multiplier of the peak learning rate for the step that follows `i` completed steps."""
    if i < warmup_steps:
        return (i + 1) / (warmup_steps + 1)
    if decay == "none":
        return 1.0
    span = total_steps - 1 - warmup_steps
    progress = min(1.0, (i - warmup_steps) / span) if span > 0 else 1.0
    if decay == "linear":
        shape = 1.0 - progress
    else:
        assert decay == "cosine", decay
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_factor + (1.0 - min_lr_factor) * shape


class LRSchedulersContainer:
    """One LambdaLR per optimizer of the container, all on the same schedule.

    Checkpoint state is just the number of steps taken; loading it sets every optimizer's lr to
    the schedule's value for that step.
    """

    def __init__(self, optimizers: OptimizersContainer, cfg: LRSchedulerConfig, training_steps: int):
        total = cfg.total_steps or training_steps
        self.factor = functools.partial(
            lr_factor,
            warmup_steps=cfg.warmup_steps,
            total_steps=total,
            decay=cfg.decay,
            min_lr_factor=cfg.min_lr_factor,
        )
        self.schedulers = [LambdaLR(opt, self.factor) for opt in optimizers.optimizers]

    def step(self) -> None:
        for s in self.schedulers:
            s.step()

    @property
    def current_lr(self) -> float:
        """Learning rate of the first parameter group: the one the next optimizer step uses."""
        return self.schedulers[0].optimizer.param_groups[0]["lr"]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.schedulers[0].last_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        step = int(state["last_epoch"])
        for s in self.schedulers:
            s.last_epoch = step
            for group, base in zip(s.optimizer.param_groups, s.base_lrs):
                group["lr"] = base * self.factor(step)
