"""Host synchronisations of a step, counted per place (tests/test_train_syncs.py, docs/design.md §3.12).

A device-to-host synchronisation is an op whose result the host must wait for: a tensor's value read
as a Python number (`.item()`, `int()`, `bool()`: aten._local_scalar_dense), an output whose shape
depends on the values (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without an output
size), or a whole tensor copied out (`.tolist()`, `.numpy()`: on a CPU they dispatch no op, so a
torch-function mode sees them). Each is counted at its place: the innermost frame in titan_thd/.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path

from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {
    "aten._local_scalar_dense",
    "aten.nonzero",
    "aten.masked_select",
    "aten._unique2",
    "aten.unique_consecutive",
    "aten.unique_dim",
    "aten.repeat_interleave",
}
SYNC_METHODS = {"tolist", "numpy"}
PACKAGE = Path(__file__).resolve().parents[1] / "titan_thd"


def place() -> str:
    """`titan_thd/<file>:<function>` of the innermost frame in the package."""
    frame = sys._getframe(2)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if PACKAGE in path.parents:
            return f"{path.relative_to(PACKAGE.parent)}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "outside titan_thd"


class _Ops(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__qualname__ and str(func.overloadpacket) in SYNC_OPS:
            self.counts[place()] += 1
        return func(*args, **(kwargs or {}))


class _Methods(TorchFunctionMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in SYNC_METHODS:
            self.counts[place()] += 1
        return func(*args, **(kwargs or {}))


class SyncCounter:
    """`with SyncCounter() as c: ...` -> c.counts: {place: host synchronisations}."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()

    def __enter__(self) -> SyncCounter:
        self._modes = [_Methods(self.counts), _Ops(self.counts)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)
