"""Faults for end-to-end tests of run_train.sh, in the processes that it starts: a test puts this
folder on PYTHONPATH (Python imports `sitecustomize` at start-up) and names the fault in
TITAN_THD_TEST_FAULT; the product has no fault hooks.

    TITAN_THD_TEST_FAULT=raise:EXC:STEP:RANK   torchrun's rank RANK raises EXC (ValueError,
                                              CheckpointError or KeyError) when it reads the data
                                              of step STEP
    TITAN_THD_TEST_FAULT=hang_in_save:STEP     every rank hangs in the save of step STEP, after its
                                              shards are written (prints "inside save")
    TITAN_THD_TEST_FAULT=note_finalization     a trainer process whose interpreter finalizes says
                                              so ("trainer finalized"); the trainer ends with
                                              os._exit, which skips finalization (titan_thd/exits.py)
"""

import os

FAULT = os.environ.get("TITAN_THD_TEST_FAULT", "")


def _raise(name: str, step: int, rank: int) -> None:
    from titan_thd.components.checkpoint import CheckpointError
    from titan_thd.data.dataloader import THDDataLoader

    errors = {"ValueError": ValueError, "CheckpointError": CheckpointError, "KeyError": KeyError}
    original = THDDataLoader.__next__

    def failing_next(self):
        batch = original(self)
        if batch.step + 1 == step and int(os.environ.get("RANK", "0")) == rank:
            raise errors[name](f"test fault: {name} on rank {rank} at step {step}")
        return batch

    THDDataLoader.__next__ = failing_next


def _hang_in_save(step: int) -> None:
    import time
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    write_data = dcp.FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        future = write_data(self, plan, planner)
        if Path(self.path).name.startswith(f"step-{step}.tmp-"):
            future.wait()
            print("inside save", flush=True)
            time.sleep(600)
        return future

    dcp.FileSystemWriter.write_data = slow_write_data


def _note_finalization() -> None:
    import atexit
    import sys

    def note() -> None:
        if sys.argv[0].endswith(os.path.join("titan_thd", "train.py")):
            print("trainer finalized", file=sys.stderr, flush=True)

    atexit.register(note)


if FAULT:
    kind, *params = FAULT.split(":")
    if kind == "raise" and "RANK" in os.environ:  # torchrun's ranks only
        _raise(params[0], int(params[1]), int(params[2]))
    elif kind == "hang_in_save":
        _hang_in_save(int(params[0]))
    elif kind == "note_finalization":
        _note_finalization()
    elif kind != "raise":
        raise ValueError(f"TITAN_THD_TEST_FAULT = {FAULT!r}: unknown fault {kind!r}")
