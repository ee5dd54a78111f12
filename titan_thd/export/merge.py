"""A LoRA run's checkpoint as the merged model: the frozen base with every adapter folded in,
W + s * B @ A, in the precision of the export (float32 / bfloat16; --dtype released re-encodes it
into the base's FP8 / FP4 codes: export/released.py), streamed a group of tensors at a time without
building or gathering the model (scripts/convert_hf.py to-hf; docs/lora.md §4).

    merged_weight(W, A, B, s)                             # one tensor: [.., out, in] + s [.., out, r] @ [.., r, in]
    hf.export(spec, MergedExport(run, opened), args, "out")   # opened: export/checkpoint.py

The base is what the trainer held (models/hf/base.py `FrozenBase`: model.hf_path's tensors, FP8 / FP4
releases dequantised by the family's reader, the rest drawn from training.seed, in the master dtype).
The peak is about one group of base tensors (a quarter of --max-shard-size, or the largest tensor)
plus its adapters, one expert's W + s B A in float32, and the file being filled.
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.components.progress import Progress
from titan_thd.export.checkpoint import Opened
from titan_thd.lora.targets import adapter_names
from titan_thd.models.hf.base import FrozenBase
from titan_thd.models.hf.write import DcpExport
from titan_thd.models.projection import SCALING
from titan_thd.run import Run

QUANTIZED = ("float8", "fp8", "fp4", "float4", "int8", "int4", "mxfp", "nvfp")
"""Prefixes of quantised dtype names refused as a merge's dtype (`released` writes FP8 / FP4 codes)."""


def check_merge_dtype(dtype: str | None, lora: bool, released: bool = False) -> None:
    """ValueError unless `dtype` is one an export writes (float32, bfloat16; None: as stored; with
    `released`, the base folder's own FP8 / FP4 format); a LoRA run's refusal of FP8 / FP4 names
    `released`, the one way a merge is written into codes."""
    allowed = ("float32", "bfloat16", "released") if released else ("float32", "bfloat16")
    if dtype is None or dtype in allowed:
        return
    if lora and dtype.lower().startswith(QUANTIZED):
        raise ValueError(
            f"--dtype {dtype}: the merged model is written in float32 or bfloat16, or with --dtype released in the "
            "base folder's own FP8 / FP4 format (it prints how much of the update survives the re-encoding)"
        )
    raise ValueError(f"--dtype {dtype}: expected {' or '.join(allowed)}")


def merged_weight(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s B A computed in float64 for float64 weights, float32 otherwise, returned in W's dtype
    (a float32 or bfloat16 export); [E, ...] stacks merge expert by expert."""
    acc = torch.float64 if W.dtype == torch.float64 else torch.float32
    delta = torch.matmul(B.to(acc), A.to(acc)) * scaling
    return (W.to(acc) + delta).to(W.dtype)


def _adapter_entries(meta: nn.Module) -> dict[str, tuple[str, str, float]]:
    """{base tensor: (A's entry, B's entry, s)} of every adapted tensor of a model with adapters."""
    out = {}
    for name, module in meta.named_modules():
        for base, (a, b) in adapter_names(module).items():
            out[f"{name}.{base}"] = (f"{name}.{a}", f"{name}.{b}", getattr(module, SCALING))
    return out


class MergedExport:
    """The base with every adapter of the checkpoint folded in (float32 or float64 arithmetic, in the
    base's dtype), a group at a time (an export's tensors, models/hf/write.py); expert stacks expert
    by expert. `progress` advances once a tensor; `merged` counts the tensors with adapters."""

    def __init__(self, run: Run, opened: Opened, progress: Progress | None = None):
        seed, master = run.cfg.training.seed, run.precision.master
        self.base = FrozenBase(run.spec, run.model_args, run.hf, seed, master)
        self.adapters = DcpExport(opened.step_dir, "model.")
        self.pairs = _adapter_entries(opened.meta)
        missing = [n for p in self.pairs.values() for n in p[:2] if n not in self.adapters.metadata]
        if missing:
            raise ValueError(f"{opened.step_dir} lacks adapter entries {missing[:4]} ({len(missing)} in all)")
        self.merged, self.progress = 0, progress

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.base.entries()

    @torch.no_grad()
    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = self.base.load(names)
        wanted = sorted({n for k in names if k in self.pairs for n in self.pairs[k][:2]})
        adapters = self.adapters.load(wanted) if wanted else {}
        for k in names:
            if k in self.pairs:
                a, b, s = self.pairs[k]
                W, A, B = out[k], adapters[a], adapters[b]
                if W.dim() == 2:
                    out[k] = merged_weight(W, A, B, s)
                else:
                    for e in range(W.shape[0]):  # one expert at a time: no [E, out, in] float32 copy
                        W[e] = merged_weight(W[e], A[e], B[e], s)
                self.merged += 1
            if self.progress is not None:
                self.progress.advance()
        return out
