"""The peak of the bytes held by live tensors on CPU, where no allocator statistics exist.

    with LiveBytes(existing=[*model.parameters(), *model.buffers()]) as live:
        train_step()
    live.peak   # bytes: the existing tensors plus the largest sum of every storage alive at once

A dispatch mode sees every tensor an op returns (forward, backward, optimizer; autograd runs CPU
backward in the calling thread under the same mode), keeps a weak reference to its storage and
counts the storage's bytes until it is freed. Not seen: the memory an op uses internally and frees
before it returns, and storages made outside the mode and not passed as `existing`. The activation
memory estimate of the log header (memory/activations.py) is checked against it
(tests/memory/test_activation_memory.py); benchmarks/bench_memory.py reports it.
"""

from __future__ import annotations

import logging
import os
import resource
import sys
from collections.abc import Iterable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from titan_thd.parallel.distributed import all_gather_object


class LiveBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages while the mode is active (`peak`, `now`)."""

    def __init__(self, existing: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        for t in existing:
            self._add(t)
        self.now = self.peak = self._exact()

    def _add(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        known = self._live.get(ptr)
        if nbytes == 0 or (known is not None and not known[0].expired()):
            return 0
        self._live[ptr] = (StorageWeakRef(storage), nbytes)
        return nbytes

    def _exact(self) -> int:
        self._live = {p: (ref, n) for p, (ref, n) in self._live.items() if not ref.expired()}
        return sum(n for _, n in self._live.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        added = sum(self._add(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if added:
            self.now += added  # counts freed storages too until the next exact count
            if self.now > self.peak:  # only a possible new peak needs the exact count
                self.now = self._exact()
                self.peak = max(self.peak, self.now)
        return out


def max_rss_bytes() -> int:
    """This process's peak resident memory so far (the kernel's count: tensors, allocator caches,
    libraries), the figure a CPU run reports per rank at its end."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # Linux counts KiB


def log_peak_rss(what: str, is_main: bool) -> None:
    """Every rank's peak RSS so far, logged by rank 0 in one line (a collective: every rank calls it)."""
    peaks = all_gather_object(max_rss_bytes() / 2**30)
    if is_main:
        listed = ", ".join(f"{p:.2f}" for p in peaks)
        logging.getLogger("titan_thd").info("%s: %s GiB (largest %.2f)", what, listed, max(peaks))


def available_host_bytes() -> int:
    """What the kernel can give this host's processes without swapping: MemAvailable (free pages
    plus the reclaimable page cache); the free pages where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
