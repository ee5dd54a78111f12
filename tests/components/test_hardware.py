"""The hardware-dependent `auto` defaults (components/hardware.py) and the progress line."""

import os
import subprocess
import sys

import pytest
import torch

from titan_thd.components import hardware
from titan_thd.components.hardware import Hardware
from titan_thd.components.metrics import mfu_warning, progress_line

NATIVE = Hardware(device="cuda:0 (test)", capability="sm_90", native_bf16_matmul=True)
EMULATED = Hardware(device="cpu (test)", capability="AVX2", native_bf16_matmul=False)


@pytest.mark.parametrize(
    "choice, hw, param_dtype, expected",
    [
        ("auto", NATIVE, torch.float32, "bfloat16"),
        ("auto", EMULATED, torch.float32, "float32"),
        ("auto", NATIVE, torch.float64, "float64"),
        ("auto", EMULATED, torch.float64, "float64"),
        ("auto", EMULATED, torch.bfloat16, "float32"),
        ("bfloat16", EMULATED, torch.float32, "bfloat16"),  # an explicit choice is kept
        ("float32", NATIVE, torch.float64, "float32"),
    ],
)
def test_muon_ns_dtype_auto(choice, hw, param_dtype, expected):
    assert hardware.muon_ns_dtype(choice, hw, param_dtype) == expected


def test_this_cpu_is_described_from_its_flags():
    hw = hardware.detect(torch.device("cpu"))
    assert hw.capability == torch.backends.cpu.get_cpu_capability()
    flags = hardware._cpu_flags()
    if not flags & {"avx512_bf16", "amx_bf16"}:  # e.g. AVX2-only EPYC: bf16 matmuls are emulated
        assert not hw.native_bf16_matmul
    assert hw.device.startswith("cpu (") and hardware.cpu_model_name() in hw.device
    assert ("no native bf16 matmul" in hw.describe()) != hw.native_bf16_matmul


def test_an_avx2_emulation_counts_as_no_native_bf16():
    """On a CPU with AMX or AVX512-BF16, the emulation of an AVX2-only machine must choose float32."""
    env = {
        **os.environ,
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }
    code = (
        "import torch; from titan_thd.components import hardware as h; "
        "hw = h.detect(torch.device('cpu')); print(hw.capability, hw.native_bf16_matmul, "
        "h.muon_ns_dtype('auto', hw, torch.float32))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["AVX2", "False", "float32"], out.stdout + out.stderr


def test_progress_line_eta_is_steps_left_times_recent_step_time():
    line = progress_line(10, 40, [2.0, 4.0, 3.0])
    assert line == "progress: step 10/40 (25%), 3.00 s/step (last 3), ETA 1m30s"
    assert progress_line(4, 5000, [3.0, 3.0, 3.0]).endswith("ETA 4h09m")


def test_no_eta_before_three_timed_steps():
    """A step-1 ETA of 33 minutes for a 4-minute run (the first step compiles and allocates) is
    worse than none: the trainer leaves the process's first step out and the line waits for 3."""
    assert progress_line(2, 40, [9.0]) == "progress: step 2/40 (5%), ETA warming up"
    assert progress_line(3, 40, [9.0, 1.0]).endswith("ETA warming up")
    assert "ETA warming up" not in progress_line(4, 40, [9.0, 1.0, 1.0])


def test_an_mfu_above_100_percent_is_a_warning_naming_the_peak_setting():
    record = {"step": 7, "mfu": 114.6, "tflops": 0.573}
    measured = mfu_warning(record, configured=False)
    assert "114.6 %" in measured and "measured at start-up came out low" in measured
    assert "--metrics.peak_tflops" in measured and "peak used 0.500 TFLOP/s" in measured
    assert "set below what the device does" in mfu_warning(record, configured=True)
    assert mfu_warning({"step": 7, "mfu": 99.9, "tflops": 0.5}, configured=False) is None


_FAULTS = """
import resource, torch
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for step in range(12):  # a step's three 64 MiB activations and a few small tensors, freed at its end
    if step == 8:
        before = faults()
    xs = [torch.empty(16 << 20).fill_(1.0) for _ in range(3)]
    small = torch.ones(1000)
    del xs
print(faults() - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_run_train_malloc_setting_keeps_a_freed_block_for_the_next_step(monkeypatch):
    """What TITAN_THD_MALLOC=reuse (run_train.sh) is for: glibc's default unmaps every freed 64 MiB
    block and faults its 16,384 pages in again on the next step; with the setting the heap, once it
    has grown over the first steps, serves later steps without a fault (steps 8-11 measured)."""
    reuse = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)}
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    counts = {}
    for name, extra in (("system", {}), ("reuse", reuse)):
        out = subprocess.run(
            [sys.executable, "-c", _FAULTS], env=clean | extra, capture_output=True, text=True, check=True
        )
        counts[name] = int(out.stdout.split()[-1])
    assert counts["system"] > 4 * 3 * 16_000 > 1_000 > counts["reuse"], counts
    monkeypatch.setenv("MALLOC_MMAP_MAX_", "0")
    assert "reuses freed memory" in hardware.describe_malloc(torch.device("cpu"))
    monkeypatch.delenv("MALLOC_MMAP_MAX_")
    assert "TITAN_THD_MALLOC=reuse" in hardware.describe_malloc(torch.device("cpu"))
    assert hardware.describe_malloc(torch.device("meta")) == ""
