"""What the machine at hand computes fast, decided once at start-up, and the `auto` defaults it sets.

bfloat16 matrix products are native on CUDA GPUs with bf16 support and on x86 CPUs with
AVX512-BF16 or AMX-BF16. Elsewhere (e.g. an AVX2-only EPYC) oneDNN emulates them and a bf16 matmul
costs ~10x a float32 one, so Muon's Newton-Schulz in bf16 turned a 5-12 s step of the dsv4 recipe
into 68-73 s. `optimizer.muon_ns_dtype = "auto"` therefore picks:

    parameters in float64   -> float64 (parity runs: nothing may round to float32 on the way)
    native bf16 matmuls      -> bfloat16 (torch.optim.Muon's choice)
    otherwise                -> float32

The CPU check needs both the CPU's flags and oneDNN's own answer, so an AVX2 emulation on a newer
CPU (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`) is treated like the older CPU it imitates.
"""

from __future__ import annotations

import functools
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

_NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")

PEAK_BF16_TFLOPS = {  # dense bf16 tensor-core peak per GPU (vendor data sheets, no sparsity)
    "H200": 989.0,
    "H100 SXM": 989.0,
    "H100 80GB HBM3": 989.0,
    "H100 NVL": 835.0,
    "H100 PCIe": 756.0,
    "H100": 756.0,  # an H100 the name does not place: the PCIe card, the lowest
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "A10G": 70.0,
    "L4": 121.0,
}
"""The MFU peak of a GPU (train's metrics and the machine check), whatever the compute dtype."""


@dataclass(frozen=True)
class Hardware:
    device: str
    """What computes: `cuda:0 (NVIDIA H100 ...)` or `cpu (AMD EPYC ...)`."""
    capability: str
    """CUDA compute capability `sm_90`, or torch's CPU kernel level (`AVX2`, `AVX512`, ...)."""
    native_bf16_matmul: bool
    """bfloat16 matrix products run in hardware (not emulated)."""

    def describe(self) -> str:
        bf16 = "native bf16 matmul" if self.native_bf16_matmul else "no native bf16 matmul"
        return f"{self.device}, {self.capability}, {bf16}"


def cpu_model_name() -> str:
    """The CPU's model name as lscpu shows it (`AMD EPYC`), or the platform's processor string."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@functools.cache
def detect(device: torch.device) -> Hardware:
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return Hardware(
            device=f"{device} ({torch.cuda.get_device_name(device)})",
            capability=f"sm_{major}{minor}",
            native_bf16_matmul=torch.cuda.is_bf16_supported(),
        )
    capability = torch.backends.cpu.get_cpu_capability()
    native = (
        bool(_cpu_flags() & set(_NATIVE_BF16_CPU_FLAGS))
        and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        and capability not in ("DEFAULT", "AVX2")
    )
    return Hardware(device=f"cpu ({cpu_model_name()})", capability=capability, native_bf16_matmul=native)


def gpu_peak_tflops(device: torch.device) -> tuple[str, float | None]:
    """(the GPU's name, its dense bf16 peak from PEAK_BF16_TFLOPS: the longest key its name contains;
    None for a GPU the table does not hold)."""
    name = torch.cuda.get_device_name(device)
    hits = [k for k in PEAK_BF16_TFLOPS if k in name]
    return name, PEAK_BF16_TFLOPS[max(hits, key=len)] if hits else None


def muon_ns_dtype(choice: str, hw: Hardware, param_dtype: torch.dtype) -> str:
    """The Newton-Schulz dtype for `optimizer.muon_ns_dtype = choice` (see the module docstring)."""
    if choice != "auto":
        return choice
    if param_dtype == torch.float64:
        return "float64"
    return "bfloat16" if hw.native_bf16_matmul else "float32"


def describe_malloc(device: torch.device) -> str:
    """How glibc's allocator treats the CPU step's large tensors ('' on a GPU or without glibc).
    By default glibc unmaps every freed block over 32 MiB and the next step faults its pages in
    again; run_train.sh's TITAN_THD_MALLOC=reuse (its default for one process) keeps them (docs/dsv4.md §16)."""
    if device.type != "cpu" or not sys.platform.startswith("linux"):
        return ""
    if os.environ.get("MALLOC_MMAP_MAX_") == "0":
        return ", glibc malloc reuses freed memory"
    return ", glibc malloc returns large blocks to the OS (TITAN_THD_MALLOC=reuse keeps them: faster on one process)"
