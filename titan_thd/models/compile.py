"""Regional `torch.compile` (training.compile, docs/dsv4.md §18).

Only small pure-tensor functions are compiled (element-wise chains that eager runs as many
memory-bound passes, e.g. dsv4's mHC update, the norms and the clamped SwiGLU): never a whole
block, whose plans, host syncs (`.tolist()`) and data-dependent shapes would break the graph or
recompile every microbatch. Modules hold the function they call as an attribute; a model's
`apply_compile` swaps in `compiled(fn)`, so the eager path stays the default and the same code.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile (inductor): dynamic shapes, since T, the routed rows per expert and
    the entry counts change from microbatch to microbatch; fullgraph, so a graph break is an error
    rather than a silent eager fallback. One wrapper per function: every module shares its code."""
    return torch.compile(fn, dynamic=True, fullgraph=True)
