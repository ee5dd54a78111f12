"""Subprocess body for the checkpoint crash / signal tests (run with `python -m`).

python -m tests.components._ckpt_worker sigterm DUMP       # train until SIGTERM, save, exit 0
                                                           # (the stop signal as the Trainer owns it)
python -m tests.components._ckpt_worker kill_in_save DUMP  # save step 1, hang inside step 2's save
"""

import logging
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn

from titan_thd.components.checkpoint import CheckpointManager
from titan_thd.components.checkpoint_folder import model_fingerprint
from titan_thd.components.optimizer import OptimizersContainer
from titan_thd.components.signals import StopSignal
from titan_thd.config import Checkpoint
from titan_thd.parallel.distributed import any_rank


class TrainState:
    def __init__(self):
        self.step = 0

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, sd):
        self.step = sd["step"]


def build(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def train_step(model, opt, sched, step):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    F.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    opt.zero_grad()
    sched.step()


def manager(dump, model, opt, sched, state, **cfg):
    return CheckpointManager(
        Checkpoint(enable=True, **cfg),
        dump,
        model=model,
        optimizer=OptimizersContainer(model, [opt]),
        lr_schedulers=sched,
        states={"train_state": state},
        fingerprint=model_fingerprint([model], model="worker"),
    )


def main(mode, dump):
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    model, opt, sched = build()
    state = TrainState()
    mgr = manager(dump, model, opt, sched, state, interval=1000)
    if mode == "sigterm":
        stop = StopSignal()
        stop.install()
        while True:
            state.step += 1
            train_step(model, opt, sched, state.step)
            print(f"step {state.step}", flush=True)
            time.sleep(0.05)
            if any_rank(stop.requested):
                mgr.save(state.step, force=True)
                stop.restore()
                print(f"stopped at {state.step}", flush=True)
                return
    assert mode == "kill_in_save", mode
    state.step = 1
    train_step(model, opt, sched, 1)
    mgr.save(1, force=True)
    original = dcp.FileSystemWriter.write_data

    def slow_write(self, plan, planner):
        future = original(self, plan, planner)
        future.wait()  # the shards are on disk, the index (.metadata) is not
        print("inside save", flush=True)
        time.sleep(600)
        return future

    dcp.FileSystemWriter.write_data = slow_write
    state.step = 2
    train_step(model, opt, sched, 2)
    mgr.save(2, force=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
