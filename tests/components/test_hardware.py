"""The hardware-dependent `auto` defaults (components/hardware.py) and the progress line."""

import os
import subprocess
import sys

import pytest
import torch

from titan_thd.components import hardware
from titan_thd.components.hardware import Hardware
from titan_thd.train import progress_line

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
    assert progress_line(10, 40, [2.0, 4.0]) == "progress: step 10/40 (25%), 3.00 s/step (last 2), ETA 1m30s"
    assert progress_line(1, 5000, [3.0]).endswith("ETA 4h09m")
