"""The trainer (`titan_thd.train.main`) whose checkpoint save of one step hangs after its shards
are written, so that a test can SIGKILL the trainer in the middle of a save.

    python -m tests._slow_save_train STEP [--section.field value ...]

Prints "inside save" when the save of STEP has written its shards (the DCP index `.metadata` and
the rename to step-STEP are still to come), then sleeps. The tiny test flavor is registered.
"""

import sys
import time
from pathlib import Path

import torch.distributed.checkpoint as dcp

from tests import _tiny_llama
from titan_thd.train import main


def hang_in_save(step: int) -> None:
    write_data = dcp.FileSystemWriter.write_data

    def slow_write_data(self, plan, planner):
        future = write_data(self, plan, planner)
        if Path(self.path).name.startswith(f"step-{step}.tmp-"):
            future.wait()
            print("inside save", flush=True)
            time.sleep(600)
        return future

    dcp.FileSystemWriter.write_data = slow_write_data


if __name__ == "__main__":
    _tiny_llama.register()
    hang_in_save(int(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
