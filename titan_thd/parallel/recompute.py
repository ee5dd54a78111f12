"""Recomputation of activations: the wrappers, and the decisions a recomputation must not take again
(docs/design.md §5.5; the rules are parallel/activation_checkpoint.py).

`checkpoint_module(m)` recomputes a module's forward in the backward (its own forward: FQNs and hooks
stay, so FSDP's unshard and the TP styles' input / output collectives run once in the forward, and
FSDP's pre-backward unshard runs before the recomputation); `checkpointed(fn)` does it for a function
a module holds as an attribute. Both are torch's non-reentrant checkpoint with `early_stop = False`:
every rank recomputes the whole region, so a collective inside it (the CP halo and all-gather, the EP
all-to-all, a TP reduce-scatter) is posted again by every rank of its group at the same point of the
same backward graph, in lockstep. With early stop a rank whose region saved fewer tensors (an expert
without rows) would stop before a collective its peers post. No per-op selective checkpointing: it
caches op outputs by invocation index, and the sparse attention mutates its bmm outputs in place
(exp_, masked_fill_), which such a cache does not survive.

What a region decides from the data is decided once: `decided_once(compute)` returns `compute()` in
the forward and records it; the recomputation of the same region replays the recorded value instead
(router and indexer top-k, MoE split sizes, the expert-parallel counts exchange). So the recomputed
graph has the forward's shapes and routing even where a tie or a non-deterministic kernel could
choose otherwise, and no collective runs for a decision. `in_recompute()` tells statistics (router
load) not to count a token twice.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from titan_thd.parallel.offload import Offloader

T = TypeVar("T")


# ============================================================================ wrappers
def checkpointed(fn: Callable[..., T], offload: tuple[Offloader, bool] | None = None) -> Callable[..., T]:
    """`fn` with its saved tensors dropped after the forward and recomputed in the backward (only
    its tensor inputs are kept). Without autograd (validation, no_grad) it is `fn` itself.
    `offload` (activation_checkpoint.offload): (the chunk's Offloader, whether this is its first
    wrapped block): the kept inputs wait in host memory (parallel/offload.py)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        # Around the checkpoint: its hooks see the inputs it keeps, not the recomputed tensors.
        with offload[0].hooks(first=offload[1]) if offload else contextlib.nullcontext():
            return checkpoint(
                fn, *args, use_reentrant=False, early_stop=False, context_fn=_decision_contexts, **kwargs
            )

    run.recomputed = fn  # type: ignore[attr-defined]
    return run


def checkpoint_module(module: nn.Module, offload: tuple[Offloader, bool] | None = None) -> None:
    """Recompute `module`'s forward in the backward: its instance `forward` becomes the checkpointed
    class forward. The module, its name and its hooks stay (FSDP's and the TP styles' run in
    `__call__`, around the checkpoint, not again in the recomputation). `offload`: `checkpointed`'s."""
    assert not is_checkpointed(module), f"{type(module).__name__} is checkpointed twice"
    module.forward = checkpointed(module.forward, offload)


def checkpoint_blocks(blocks: list[nn.Module], offload: bool) -> None:
    """Full recomputation of `blocks` (one model chunk's, in forward order); `offload`
    (activation_checkpoint.offload): their kept inputs in host memory, one Offloader for the chunk."""
    offloader = Offloader() if offload else None
    for i, block in enumerate(blocks):
        checkpoint_module(block, None if offloader is None else (offloader, i == 0))


def is_checkpointed(module: nn.Module) -> bool:
    return hasattr(module.forward, "recomputed")


# ============================================================================ decisions
class _Frame:
    """The decisions of one checkpointed call: recorded in its forward, replayed in its recompute."""

    __slots__ = ("values", "pos", "replay")

    def __init__(self, values: list):
        self.values, self.pos, self.replay = values, 0, False


_local = threading.local()


def _stack() -> list[_Frame]:
    if not hasattr(_local, "frames"):
        _local.frames = []
    return _local.frames


@contextlib.contextmanager
def _active(frame: _Frame) -> Iterator[None]:
    stack = _stack()
    stack.append(frame)
    try:
        yield
    finally:
        assert stack.pop() is frame
    if frame.replay:
        assert frame.pos == len(frame.values), (
            f"the recomputation replayed {frame.pos} of {len(frame.values)} recorded decisions: the "
            "region's forward took another path"
        )


def _decision_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """torch checkpoint's context_fn: one record for the forward, replayed by its recomputation."""
    values: list = []
    record, replay = _Frame(values), _Frame(values)
    replay.replay = True
    return _active(record), _active(replay)


_observer: Callable[[Any], None] | None = None


@contextlib.contextmanager
def observe_decisions(observe: Callable[[Any], None]) -> Iterator[None]:
    """Call `observe(value)` for every decision recorded meanwhile: what the records keep alive from a
    region's forward to its backward (the activation measurement counts it, memory/activations.py)."""
    global _observer
    previous, _observer = _observer, observe
    try:
        yield
    finally:
        _observer = previous


def decided_once(compute: Callable[[], T]) -> T:
    """`compute()`, except in the recomputation of a checkpointed region, which gets the value the
    region's forward computed (the same object). Outside any checkpointed region: `compute()`."""
    stack = _stack()
    replaying = next((f for f in stack if f.replay), None)  # the outermost recomputation
    if replaying is not None:
        assert replaying.pos < len(replaying.values), (
            "a recomputation asked for a decision its forward did not take"
        )
        value = replaying.values[replaying.pos]
        replaying.pos += 1
    else:
        value = compute()
        if _observer is not None and any(not f.replay for f in stack):
            _observer(value)
    for f in stack:  # nested regions keep their own record, for their own recomputation
        if not f.replay:
            f.values.append(value)
    return value


def in_recompute() -> bool:
    """True while a checkpointed region is being recomputed (statistics must not count again)."""
    return any(f.replay for f in _stack())
