"""Regional `torch.compile` (training.compile, docs/dsv4.md §18).

Only small pure-tensor functions are compiled (element-wise chains that eager runs as many
memory-bound passes, e.g. dsv4's mHC update, the norms and the clamped SwiGLU): never a whole
block, whose plans, host syncs (`.tolist()`) and data-dependent shapes would break the graph or
recompile every microbatch. Modules hold the function they call as an attribute; a model's
`apply_compile` swaps in `compiled(fn)`, so the eager path stays the default and the same code.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
from torch._inductor.runtime.cache_dir_utils import default_cache_dir


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile (inductor): dynamic shapes, since T, the routed rows per expert and
    the entry counts change from microbatch to microbatch; fullgraph, so a graph break is an error
    rather than a silent eager fallback. One wrapper per function: every module shares its code."""
    _one_inductor_cache_per_cpu_capability()
    return torch.compile(fn, dynamic=True, fullgraph=True)


def _one_inductor_cache_per_cpu_capability() -> None:
    """Inductor (torch 2.13) generates its C++ kernels for the vector ISA that ATEN_CPU_CAPABILITY
    selects, but its on-disk caches do not key on it: a run under `ATEN_CPU_CAPABILITY=avx2` (how the
    README emulates an AVX2-only CPU) after a native AVX-512 run on the same machine, or the other
    way round, reuses the other ISA's kernels and computes wrong numbers (measured: the float64
    dsv4 loss 555.21 instead of 565.77, tests/models/test_compile.py, AMD EPYC AVX-512). So each
    capability gets its own cache folder; a folder the user chose (TORCHINDUCTOR_CACHE_DIR) is kept.
    Importing inductor already writes its default folder into the environment, hence the comparison."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{capability}"
