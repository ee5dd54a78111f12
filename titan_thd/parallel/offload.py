"""The inputs of fully recomputed blocks in host memory (`activation_checkpoint.offload`).

Under full recomputation a block keeps only its inputs from its forward to its backward (torch's
non-reentrant checkpoint saves them as saved tensors, outside the checkpoint's own hooks). An
`Offloader` wraps each checkpointed call of one model chunk in `saved_tensors_hooks` that see
exactly those inputs:

    pack (forward)     a copy into host memory (pinned on CUDA, on a side stream after the compute
                       stream's work that made the tensor); the device tensor is freed when its
                       last other user lets go
    unpack (backward)  the block's inputs brought back (waiting for their copy), and the copy of the
                       block before it in the same forward started: the block whose recomputation the
                       backward runs next. So one block's inputs are on the device ahead of its need.

On a CPU host and device are one memory: the same code runs with plain copies, so the tests exercise
it (bitwise: a copy is exact, and the recomputation sees the same values and strides). Tensors that
are not contiguous stay where they are (a copy would change their strides; they are views of a
tensor the backward holds anyway). A DTensor (tensor parallelism's sequence-parallel rows) moves its
local shard and is rebuilt around it.

Memory: host bytes per rank = the inputs of every wrapped block of every microbatch in flight; the
device keeps one block's inputs ahead (the memory plan counts both: memory/plan.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch.distributed.tensor import DTensor

_observer: Callable[[torch.Tensor], None] | None = None


@contextlib.contextmanager
def observe_offload(observe: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Call `observe(host_copy)` for every tensor offloaded meanwhile (the activation measurement
    counts them as host memory: memory/activations.py)."""
    global _observer
    previous, _observer = _observer, observe
    try:
        yield
    finally:
        _observer = previous


class _Group:
    """The inputs one checkpointed call saved: host copies, and device copies once fetched."""

    __slots__ = ("device", "event", "fetched", "host", "prev")

    def __init__(self, prev: _Group | None):
        self.prev = prev
        """The group of the block before, in the same forward (its backward comes next)."""
        self.host: list[torch.Tensor] = []
        self.fetched: dict[int, torch.Tensor] | None = None
        self.device: torch.device | None = None
        self.event: torch.cuda.Event | None = None


class Offloader:
    """One model chunk's offload: the groups of its current forward, chained block to block."""

    def __init__(self) -> None:
        self._last: _Group | None = None
        self._stream: torch.cuda.Stream | None = None

    @contextlib.contextmanager
    def hooks(self, first: bool) -> Iterator[None]:
        """Around one checkpointed call; `first`: the chunk's first wrapped block (a new forward)."""
        group = _Group(None if first else self._last)
        self._last = group
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(group, t), lambda packed: self._unpack(group, packed)
        ):
            yield

    # ---------------------------------------------------------------- forward
    def _pack(self, group: _Group, t: torch.Tensor):
        local = t._local_tensor if isinstance(t, DTensor) else t
        if not local.is_contiguous():  # a view: kept, strides and all
            return ("kept", t)
        group.device = local.device
        cuda = local.device.type == "cuda"
        host = torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=cuda)
        with self._side(local.device):
            host.copy_(local, non_blocking=cuda)
        if cuda:  # its memory is not reused before the side stream's copy ran
            local.record_stream(self._stream)
        group.host.append(host)
        if _observer is not None:
            _observer(host)
        spec = (t._spec, t.requires_grad) if isinstance(t, DTensor) else None
        return ("host", len(group.host) - 1, spec)

    # ---------------------------------------------------------------- backward
    def _unpack(self, group: _Group, packed):
        if packed[0] == "kept":
            return packed[1]
        _, i, spec = packed
        self._fetch(group)
        if group.prev is not None:  # the next block of the backward: one ahead
            self._fetch(group.prev)
        assert group.fetched is not None and group.device is not None
        local = group.fetched.pop(i)
        if group.event is not None:
            current = torch.cuda.current_stream(group.device)
            current.wait_event(group.event)
            local.record_stream(current)
        return local if spec is None else DTensor(local, spec[0], requires_grad=spec[1])

    def _fetch(self, group: _Group) -> None:
        if group.fetched is not None or group.device is None:
            return
        cuda = group.device.type == "cuda"
        with self._side(group.device):
            group.fetched = {
                i: torch.empty_like(h, device=group.device).copy_(h, non_blocking=cuda)
                for i, h in enumerate(group.host)
            }
            if cuda:
                group.event = torch.cuda.Event()
                group.event.record(self._stream)

    def _side(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The copy stream on CUDA (after the compute stream's work so far); nothing on a CPU."""
        if device.type != "cuda":
            return contextlib.nullcontext()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        self._stream.wait_stream(torch.cuda.current_stream(device))
        return torch.cuda.stream(self._stream)
