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
import shutil
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor, wait_tensor

from titan_thd.config.choices import CompileChoice


@functools.cache
def compiled(fn: Callable) -> Callable:
    """`fn` under torch.compile (inductor): dynamic shapes, since T, the routed rows per expert and
    the entry counts change from microbatch to microbatch; fullgraph, so a graph break is an error
    rather than a silent eager fallback. One wrapper per function: every module shares its code.

    Tensor parallelism hands some activations over as AsyncCollectiveTensor (a DTensor's `to_local()`
    after an asynchronous redistribute: dsv4's vocabulary-parallel embedding of the MTP input).
    Given one, the compiled backward returns a plain gradient where autograd then expects a DTensor
    (AttributeError '_local_tensor' in the redistribute's backward, torch 2.13), so such an argument is
    waited for first; `wait_tensor` keeps it in the autograd graph."""
    _one_inductor_cache_per_cpu_capability()
    inner = torch.compile(fn, dynamic=True, fullgraph=True)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return inner(*(wait_tensor(a) if isinstance(a, AsyncCollectiveTensor) else a for a in args), **kwargs)

    return call


def _one_inductor_cache_per_cpu_capability() -> None:
    """Inductor (torch 2.13) generates its C++ kernels for the vector ISA that ATEN_CPU_CAPABILITY
    selects, but its on-disk caches do not key on it: a run under `ATEN_CPU_CAPABILITY=avx2` (how the
    CONTRIBUTING.md emulates an AVX2-only CPU) after a native AVX-512 run on the same machine, or the other
    way round, reuses the other ISA's kernels and computes wrong numbers (measured: the float64
    dsv4 loss 555.21 instead of 565.77, tests/models/test_compile.py, AMD EPYC AVX-512). So each
    capability gets its own cache folder; a folder the user chose (TORCHINDUCTOR_CACHE_DIR) is kept.
    Importing inductor already writes its default folder into the environment, hence the comparison."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and os.environ.get("TORCHINDUCTOR_CACHE_DIR", default_cache_dir()) == default_cache_dir():
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = f"{default_cache_dir()}_{capability}"


class CompileDecision(NamedTuple):
    on: bool
    choice: CompileChoice
    """training.compile as configured."""
    reason: str = ""
    """How `auto` decided ("" for an explicit choice)."""

    def describe(self) -> str:
        """The log header's line."""
        how = f"auto: {self.reason}" if self.choice == "auto" else str(self.choice).lower()
        state = "regional, the element-wise chains" if self.on else "off"
        return f"torch.compile: {state} (training.compile = {how})"


def has_cpp_compiler() -> bool:
    """Inductor's CPU backend builds C++ kernels."""
    return any(map(shutil.which, ("g++", "c++", "clang++")))


def resolve_compile(
    choice: CompileChoice, model: str, payback_steps: int, steps: int, device: str
) -> CompileDecision:
    """training.compile on `device` ("cpu" / "cuda") for a run of `steps`; `payback_steps` is the
    model's ModelSpec.compile.payback_steps. An explicit choice is taken as it is (checked elsewhere)."""
    if choice != "auto":
        return CompileDecision(bool(choice), choice)
    if device != "cpu":
        return CompileDecision(False, choice, f"not yet measured on {device}; set true to try it")
    if payback_steps <= 0:
        return CompileDecision(False, choice, f"{model}'s compiled regions were not measured faster")
    if not has_cpp_compiler():
        return CompileDecision(False, choice, "no C++ compiler (g++, c++, clang++) on PATH")
    if steps < payback_steps:
        return CompileDecision(
            False,
            choice,
            f"training.steps = {steps} < {payback_steps}, the steps {model} needs to repay the first step's compile",
        )
    return CompileDecision(
        True,
        choice,
        f"training.steps = {steps} >= {payback_steps}, the steps {model} needs to repay the compile",
    )


def compile_seconds() -> float:
    """Wall seconds this process has spent in torch.compile so far (dynamo, AOT autograd, inductor)."""
    from torch._dynamo.utils import calculate_time_spent

    return calculate_time_spent().get("total_wall_time", 0.0)


class CompileClock:
    """The log line of a step that compiled: the process's first step, and any later one that spent a
    second or more compiling (a new shape or dtype: a recompile)."""

    def __init__(self) -> None:
        self.seconds = compile_seconds()
        self.first = True

    def line(self, step: int, step_time: float) -> str | None:
        total = compile_seconds()
        spent, self.seconds = total - self.seconds, total
        if not (self.first or spent >= 1.0):
            return None
        self.first = False
        return f"training.compile: step {step} took {step_time:.1f} s, {spent:.1f} s of it compiling (torch.compile's own count)"
