"""components/precision.py: the refused combinations (with their byte widths), `auto` per machine,
and the memory estimate's bytes per parameter for each scheme (parallel/fsdp.py)."""

import pytest
import torch
from torch import nn

from tests.conftest import TRAIN_ARGS
from titan_thd.components.hardware import Hardware
from titan_thd.components.precision import (
    Precision,
    precision_warnings,
    resolve_precision,
    validate_precision,
)
from titan_thd.config import load_config
from titan_thd.memory.state import estimate_memory_per_rank
from titan_thd.parallel.parallel_dims import ParallelDims

CPU_NATIVE = Hardware("cpu (Intel Xeon)", "AVX512", True)
CPU_AVX2 = Hardware("cpu (AMD EPYC)", "AVX2", False)
GPU = Hardware("cuda:0 (NVIDIA H100)", "sm_90", True)
F32, BF16, F64 = torch.float32, torch.bfloat16, torch.float64


def test_compute_wider_than_master_is_refused_with_the_widths():
    with pytest.raises(
        ValueError, match=r"mixed_precision_param = float32 \(4 bytes\).*bfloat16 \(2 bytes\)"
    ):
        validate_precision("bfloat16", "float32", "float32")
    with pytest.raises(ValueError, match=r"mixed_precision_reduce = bfloat16.*4-byte gradients to 2"):
        validate_precision("float32", "float32", "bfloat16")
    # Refused by the config, before any process group or model exists.
    with pytest.raises(ValueError, match="wider than training.dtype"):
        load_config(
            [*TRAIN_ARGS, "--training.dtype", "bfloat16", "--training.mixed_precision_param", "float32"]
        )


@pytest.mark.parametrize(
    "dtype, param, reduce, hw, expect",
    [
        ("float32", "auto", "float32", CPU_NATIVE, (F32, F32, F32)),  # measured slower on CPUs
        ("float32", "auto", "float32", CPU_AVX2, (F32, F32, F32)),  # emulated
        ("float32", "auto", "bfloat16", CPU_AVX2, (F32, F32, F32)),  # pure: reduces in the master dtype
        ("float32", "auto", "float32", GPU, (F32, BF16, F32)),
        ("float32", "auto", "bfloat16", GPU, (F32, BF16, BF16)),
        ("float32", "bfloat16", "float32", CPU_AVX2, (F32, BF16, F32)),  # explicit: as asked
        ("float64", "auto", "float32", GPU, (F64, F64, F64)),  # parity runs stay float64
        ("bfloat16", "auto", "float32", GPU, (BF16, BF16, BF16)),  # pure bf16: no float32 anywhere
        ("float32", "float32", "float32", GPU, (F32, F32, F32)),
    ],
)
def test_resolution(dtype, param, reduce, hw, expect):
    p = resolve_precision(dtype, param, reduce, hw)
    assert (p.master, p.compute, p.reduce) == expect
    assert p.mixed == (expect[0] != expect[1])
    assert bool(p.reason) == (param == "auto")
    line = p.describe(param)
    assert f"training.mixed_precision_param = {param}" in line
    assert ("mixed precision" in line) == p.mixed


def test_warnings_name_the_lost_updates_and_the_emulation():
    pure = resolve_precision("bfloat16", "auto", "float32", CPU_NATIVE)
    (w,) = precision_warnings(pure, CPU_NATIVE)
    assert "pure bf16" in w and "lost" in w and "|w| / 256" in w
    mixed = resolve_precision("float32", "bfloat16", "float32", CPU_AVX2)
    (w,) = precision_warnings(mixed, CPU_AVX2)
    assert "emulated" in w
    assert precision_warnings(mixed, CPU_AVX2, dry_run=True) == []
    assert precision_warnings(mixed, CPU_NATIVE) == []


class Stage(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32, bias=False)  # 512 elements
        self.b = nn.Linear(32, 16, bias=False)  # 512


@pytest.mark.parametrize(
    "precision, sharded, stage",
    [
        (Precision(F32, F32, F32), (4, 4, 8), (4, 4)),
        (Precision(F32, BF16, F32), (4, 4, 8), (2, 4)),  # bf16 compute copy, float32 gradients
        (Precision(F32, BF16, BF16), (4, 4, 8), (2, 2)),
        (Precision(BF16, BF16, BF16), (2, 2, 4), (2, 2)),  # pure bf16
    ],
)
def test_bytes_per_parameter_of_each_scheme(precision, sharded, stage):
    """Sharded master, gradient and AdamW state per parameter over dp 4; under pp 2 also the
    stage's parameters that FSDP keeps gathered (compute dtype) with their unsharded gradients
    (reduction dtype) between microbatches: all 1024 of them, not 1 / 4."""
    model = Stage()
    flat = ParallelDims(pp=1, dp_shard=4, cp=1, tp=1, world_size=4)
    est = estimate_memory_per_rank(model, flat, "adamw", precision)
    assert est.params == 1024 // 4 and est.stage_params == 0
    assert (est.param_bytes, est.grad_bytes, est.optimizer_bytes) == tuple(b * est.params for b in sharded)
    piped = ParallelDims(pp=2, dp_shard=4, cp=1, tp=1, world_size=8)
    est = estimate_memory_per_rank(model, piped, "adamw", precision)
    assert est.stage_params == 1024
    assert (est.stage_param_bytes, est.stage_grad_bytes) == (stage[0] * 1024, stage[1] * 1024)
    assert est.total_bytes == sum(sharded) * 256 + sum(stage) * 1024
    assert f"compute copy {stage[0]} + grads {stage[1]} B" in str(est)
    assert f"master {sharded[0]} + grads {sharded[1]} + optimizer {sharded[2]} B per parameter" in str(est)


def test_one_process_counts_the_unsharded_copy_only_when_fsdp_wraps_it():
    """pp 2 on one dp rank: a pure run has no FSDP (the parameters are the stage's copy, nothing
    extra); mixed precision applies FSDP (over one rank) and adds the bf16 copy and its grads."""
    model, dims = Stage(), ParallelDims(pp=2, dp_shard=1, cp=1, tp=1, world_size=2)
    assert estimate_memory_per_rank(model, dims, "adamw", Precision(F32, F32, F32)).stage_params == 0
    mixed = estimate_memory_per_rank(model, dims, "adamw", Precision(F32, BF16, F32))
    assert (mixed.stage_param_bytes, mixed.stage_grad_bytes) == (2 * 1024, 4 * 1024)
