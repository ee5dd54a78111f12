"""A Hugging Face folder -> a trainer checkpoint (DCP), one tensor at a time (scripts/convert_hf.py to-dcp).

    save_dcp(spec, args, HFFolder(spec, path), out, seed)   # {"model": {fqn: tensor}} in DCP's format

The model is built on the meta device (names, shapes, dtypes: no memory); DCP plans the checkpoint
from those, and its writer asks for each tensor's data only when it writes it (`SavePlanner.
resolve_data`): the folder's tensor is read then (FP8 / FP4 dequantised to float32 on read), or a
tensor the folder lacks (dsv4's MTP block: transformers writes none) is drawn from `seed` by the
model's init rule, as the seeded init would draw it (parallel/seeded_init.py). The peak is one
tensor (Flash: one layer's stack of 256 routed experts, 8.6 GB in float32), not the model.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.planner import WriteItem, WriteItemType

from titan_thd.models.hf.adapter import HFFamily
from titan_thd.models.hf.base import FrozenBase
from titan_thd.models.hf.folder import HFFolder

PREFIX = "model."
"""The trainer's checkpoint keys: `model.<fqn>` (components/checkpoint.py)."""


class _ReadOnWrite(DefaultSavePlanner):
    """Plans from meta tensors; each tensor's data is made when the writer asks for it."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | Any:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        return self.make(write_item.index.fqn.removeprefix(PREFIX))


def save_dcp(family: HFFamily, args: Any, folder: HFFolder, out: str | Path, seed: int) -> int:
    """Write the model `args` describe, with `folder`'s weights (the rest drawn from `seed`: models/hf/
    base.py), to the DCP folder `out`; returns the number of tensors. The folder is checked first
    (headers only: nothing is written on bad input)."""
    base = FrozenBase(family, args, folder, seed)
    state = {
        k: torch.empty(shape, dtype=dtype, device="meta") for k, (shape, dtype) in base.entries().items()
    }

    def make(key: str) -> torch.Tensor:
        t = base.tensor(key)
        base.release()  # one tensor resident at a time
        return t

    # A file per tensor: DCP's writer keeps every tensor of a file until the file is written.
    writer = dcp.FileSystemWriter(out, single_file_per_rank=False)
    with warnings.catch_warnings():  # DCP warns that no process group exists: one writer is intended
        warnings.simplefilter("ignore")
        dcp.save({"model": state}, storage_writer=writer, planner=_ReadOnWrite(make))
    base.release()
    return len(state)
