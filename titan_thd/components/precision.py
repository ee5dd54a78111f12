"""The dtypes of a run: master weights, compute and gradient reduction, decided once at start-up.

    training.dtype                  master: the parameters the optimizer steps, their gradients once
                                    reduced, the optimizer state, the checkpoint
    training.mixed_precision_param  compute: what forward and backward run in (FSDP2 gathers the
                                    parameters in it); `auto` picks it for the machine
    training.mixed_precision_reduce reduction: the gradient reduce-scatter and the gradients FSDP
                                    accumulates unsharded between pipeline microbatches

Compute narrower than the master (float32 master, bfloat16 compute) is mixed precision: FSDP2's
`MixedPrecisionPolicy` casts each unit's parameters when it gathers them and hands the gradients
back in the reduction dtype, so updates smaller than a bf16 step still reach the float32 weights.
Compute equal to the master is a pure run (float32, float64 parity runs, or pure bfloat16, whose
updates below ~|w| / 256 round away: docs/design.md §5.6). Compute wider than the master is refused.

`auto` (the default):

    master float64    -> float64   (parity runs: nothing may round on the way)
    master bfloat16   -> bfloat16  (pure bf16, as asked)
    master float32    -> bfloat16 on CUDA GPUs with native bf16 (the references' default; this
                         project has not timed a GPU); float32 on CPUs: an AVX2 CPU emulates bf16,
                         and on an AMX CPU mixed bf16 measured 1.10x float32 for the dense recipe
                         but 0.59x for dsv4's (benchmarks/bench_precision.py; docs/results.md §6)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from titan_thd.components.hardware import Hardware
from titan_thd.config.checks import DTYPE_BYTES, validate_precision

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
# The config checks the dtype combinations (validate_precision) without torch, by these widths.
assert {name: dtype.itemsize for name, dtype in _DTYPES.items()} == DTYPE_BYTES


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Precision:
    master: torch.dtype
    """Parameters the optimizer steps, their reduced gradients, the optimizer state (training.dtype)."""
    compute: torch.dtype
    """Forward and backward: gathered parameters, activations, pipeline / CP / EP messages."""
    reduce: torch.dtype
    """Gradient reduce-scatter, and gradients FSDP keeps unsharded between pipeline microbatches
    (the master dtype unless mixed)."""
    reason: str = ""
    """How `auto` chose `compute` ("" for an explicit choice)."""

    @property
    def mixed(self) -> bool:
        """Compute narrower than the master: FSDP2 casts (applied on every layout, one rank included)."""
        return self.compute != self.master

    def describe(self, choice: str) -> str:
        """The log header's line."""
        how = f"{choice}: {self.reason}" if self.reason else choice
        kind = "mixed precision" if self.mixed else f"pure {_name(self.master)}"
        return (
            f"precision ({kind}): master weights and optimizer state {_name(self.master)}, compute "
            f"{_name(self.compute)}, gradient reduction {_name(self.reduce)} "
            f"(training.mixed_precision_param = {how})"
        )


def auto_compute(master: torch.dtype, hw: Hardware) -> tuple[torch.dtype, str]:
    """(compute dtype, reason) of mixed_precision_param = auto (module docstring)."""
    if master != torch.float32:
        return master, f"{_name(master)} master weights compute in {_name(master)}"
    if hw.native_bf16_matmul and hw.device.startswith("cuda"):
        return torch.bfloat16, "native bf16 matmul on a CUDA GPU"
    if hw.native_bf16_matmul:
        return (
            torch.float32,
            "native bf16 on this CPU, but mixed bf16 measured slower than float32 for the dsv4 recipe",
        )
    return torch.float32, "bf16 is emulated on this CPU (no native bf16 matmul)"


def resolve_precision(dtype: str, param: str, reduce: str, hw: Hardware) -> Precision:
    """The run's dtypes for training.dtype / mixed_precision_param / mixed_precision_reduce on `hw`."""
    validate_precision(dtype, param, reduce)
    master = _DTYPES[dtype]
    compute, reason = auto_compute(master, hw) if param == "auto" else (_DTYPES[param], "")
    if compute == master:  # pure (auto too, where it picks the master): gradients in the master's dtype
        return Precision(master, compute, master, reason)
    return Precision(master, compute, _DTYPES[reduce], reason)


def precision_warnings(precision: Precision, hw: Hardware, dry_run: bool = False) -> list[str]:
    """Header warnings: pure bf16's lost updates, bf16 compute on a CPU that emulates it (not in a
    dry run, which computes nothing worth timing)."""
    out = []
    if precision.master == torch.bfloat16:
        out.append(
            "training.dtype = bfloat16 is pure bf16: parameters, gradients and optimizer state in bfloat16, no "
            "float32 copy. An update smaller than half a bf16 step of its weight (about |w| / 256) is lost: "
            "at small learning rates (fine-tuning, lr 1e-5) one AdamW step leaves most weights unchanged "
            "(lost updates; docs/design.md §5.6). For bf16 compute on float32 master weights set training.dtype "
            "= float32 and training.mixed_precision_param = bfloat16"
        )
    if precision.compute == torch.bfloat16 and not hw.native_bf16_matmul and not dry_run:
        out.append(
            f"bf16 compute on {hw.device} ({hw.capability}), which has no native bf16 matmul: emulated, "
            "several times slower than float32"
        )
    return out
