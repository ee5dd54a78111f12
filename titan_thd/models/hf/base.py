"""The frozen base of a run, from its Hugging Face folder or its seed: the one rule, used wherever a
base is made (the trainer's initialisation, inference's load, the merged export, to-dcp).

    init_base(model, folder, seed)                  # an allocated model (plain, sharded or a stage)
    base = FrozenBase(spec, args, folder, seed)     # our names -> tensors, one group at a time
    base.load(["layers.0.attn.wq_a.weight", ...]); base.tensor(key); base.entries()

A tensor the folder holds is read (FP8 / FP4 releases dequantised by the family's reader); one it
lacks (no folder, or a module the folder has no weights of: dsv4's MTP) is drawn from `seed` by the
model's init rule, as the seeded initialisation draws it (parallel/seeded_init.py), so a streamed
base equals the trainer's tensor for tensor. What the folder holds is never drawn first (Flash: about
8.7B values a rank would draw for nothing).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from titan_thd.models.hf.adapter import HFFamily
from titan_thd.models.hf.folder import HFFolder
from titan_thd.models.hf.io import LoadStats
from titan_thd.models.hf.load import load_into
from titan_thd.parallel.seeded_init import init_tensor


def init_base(model: nn.Module, folder: HFFolder | None, seed: int) -> LoadStats | None:
    """Fill an allocated model (its `init_weights(seed, skip=...)`, then the folder's tensors, each rank
    its slices): what the folder provides is read, the rest (adapters included) drawn from `seed`.
    Returns what the load read (None without a folder)."""
    provided = folder.sources(model.args).keys() if folder is not None else ()
    model.init_weights(seed, skip=provided)
    return load_into(model, folder) if folder is not None else None


class FrozenBase:
    """The base of the model `args` describe, our names -> tensors in `dtype` (None: the model's own),
    each exactly as `init_base` makes it, a group at a time (the protocol of the export writers,
    models/hf/write.py: `entries()`, `load(names)`); `provided` are the keys the folder holds."""

    def __init__(
        self,
        family: HFFamily,
        args: Any,
        folder: HFFolder | None,
        seed: int,
        dtype: torch.dtype | None = None,
    ):
        with torch.device("meta"):  # names, shapes, dtypes and init rules: no memory
            model = family.build(args)
        self.sources = folder.sources(args, model) if folder is not None else {}
        if dtype is not None:
            model = model.to(dtype)
        self.state, self.rules, self.seed, self.folder = model.state_dict(), model.init_rules(), seed, folder

    @property
    def provided(self) -> set[str]:
        return set(self.sources)

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    @torch.no_grad()
    def tensor(self, key: str) -> torch.Tensor:
        """One whole tensor of the base (`release` unmaps the folder's file it was read from)."""
        like = self.state[key]
        source = self.sources.get(key)
        if source is None:
            t = torch.empty(like.shape, dtype=like.dtype)
            init_tensor(t, self.seed, key, self.rules[key])
            return t
        assert self.folder is not None  # sources come from the folder
        return source.read(self.folder.headers, tuple(slice(0, n) for n in like.shape)).to(like.dtype)

    def release(self) -> None:
        """Unmap what was read: a file's pages stay in the process's memory while it is open."""
        if self.folder is not None:
            self.folder.headers.close()

    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {k: self.tensor(k) for k in names}
        self.release()  # once a group: reopening a file parses its header again
        return out
