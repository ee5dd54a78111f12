"""A LoRA run's checkpoint for serving: its adapters in PEFT's format, or the model with the adapters
merged, written from the checkpoint's adapter entries without building or gathering the base
(scripts/convert_hf.py to-peft / to-hf; docs/lora.md §3, §4); inference/loading.py checks a LoRA
checkpoint with `check_adapters`.

    step_dir, meta = lora_checkpoint(run, "outputs/x")         # checked: this run's adapters and base
    write_peft_streamed(run, step_dir, meta, "out", torch.float32)   # a block of adapters at a time
    hf.export(spec, MergedSource(run, step_dir, meta), args, "out")  # W + s B A, a group at a time

The base is what the trainer held: `model.hf_path`'s tensors (FP8 / FP4 releases dequantised by the
family's reader), the rest (no folder, or a module the folder lacks, dsv4's MTP) drawn from
training.seed, in the master dtype (`BaseSource`). The merged export's peak is about one group of
base tensors (a quarter of --max-shard-size, or the largest tensor) plus its adapters, one expert's
W + s B A in float32, and the file being filled.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_thd.components import run_settings
from titan_thd.components.checkpoint import read_model
from titan_thd.components.checkpoint_folder import META_FILE, model_fingerprint, resolve_step_dir
from titan_thd.lora.merge import merged_weight
from titan_thd.lora.peft import adapter_config, peft_tensors
from titan_thd.lora.targets import adapter_names, is_adapter
from titan_thd.models.hf.io import DTYPES
from titan_thd.models.hf.load import folder_sources
from titan_thd.models.hf.write import DcpSource
from titan_thd.models.projection import SCALING
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.parallel.seeded_init import init_tensor
from titan_thd.run import Run

Progress = Callable[[str], None]

LORA_SETTINGS = ("lora.rank", "lora.alpha", "lora.rslora", "lora.targets", "lora.base")
"""Run settings a checkpoint's adapters depend on beyond their names and shapes (its fingerprint)."""
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


def check_adapters(run: Run, step_dir: Path) -> None:
    """ValueError in one line when the checkpoint's kind is not the run's (adapters with a config
    without [lora], or the whole model with one), or its adapters were trained with other lora.*
    settings or on another base (model.hf_path's fingerprint, or the seed) than the config's."""
    try:
        saved = json.loads((step_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return  # read_model names what is missing or damaged
    has_adapters = any(is_adapter(k) for k in saved.get("fingerprint", {}).get("params", {}))
    if run.lora is not None and not has_adapters:
        raise ValueError(
            f"{step_dir} is not a LoRA checkpoint: it holds the whole model (full fine-tuning), no adapters "
            "(to-hf exports it; generate.py / evaluate.py load it with lora.enable = false)"
        )
    if run.lora is None and has_adapters:
        raise ValueError(
            f"{step_dir} holds LoRA adapters, but the config has lora.enable = false: give the run's "
            "config (its [lora] section and model.hf_path)"
        )
    mine = saved.get("settings") or {}
    keys = [k for k in LORA_SETTINGS if k in mine and run.lora is not None]
    diff = run_settings.changes({k: mine[k] for k in keys}, {k: run.settings.get(k) for k in keys})
    if diff:  # lora.base: the same fingerprint is the same base, from any folder
        raise ValueError(
            f"{step_dir} was trained with other settings than the config's: {run_settings.describe(diff)} "
            "(checkpoint -> config); give the run's config and base (model.hf_path)"
        )


def check_exportable(run: Run) -> None:
    """NotExportable (one line) when a planned target is one PEFT cannot apply (dsv4's `attention.wo_a`):
    before the checkpoint is read."""
    if run.lora is not None:
        peft_tensors({}, run.lora, [], run.spec.hf.hf_module)


def lora_checkpoint(run: Run, src: str | Path) -> tuple[Path, nn.Module]:
    """(the step folder `src` names, the run's model with adapters on the meta device) of an export:
    `check_adapters`, then the fingerprint (every adapter's name and shape); ValueError in one line."""
    step_dir = resolve_step_dir(src, run.cfg.checkpoint.folder)
    check_adapters(run, step_dir)
    if run.lora is None:
        raise ValueError("the config has lora.enable = false: there are no adapters to export (use to-hf)")
    meta = build_on_meta(run.build_model)
    read_model(
        meta, step_dir, model_fingerprint([meta], model=run.cfg.model.name, flavor=run.flavor), load=False
    )
    return step_dir, meta


def _adapter_entries(meta: nn.Module) -> dict[str, tuple[str, str, float]]:
    """{base tensor: (A's entry, B's entry, s)} of every adapted tensor of a model with adapters."""
    out = {}
    for name, module in meta.named_modules():
        for base, (a, b) in adapter_names(module).items():
            out[f"{name}.{base}"] = (f"{name}.{a}", f"{name}.{b}", getattr(module, SCALING))
    return out


class BaseSource:
    """The frozen base of a run, our names -> tensors in the master dtype, a group at a time (models/hf/
    write.py's source protocol): model.hf_path's tensors, the others drawn from training.seed, each
    exactly as the trainer's initialisation then `hf.load_into` made them."""

    def __init__(self, run: Run):
        model = build_on_meta(lambda: run.spec.build(run.model_args)).to(run.precision.master)
        self.state, self.rules, self.seed = model.state_dict(), model.init_rules(), run.cfg.training.seed
        self.folder, self.sources = None, {}
        if run.cfg.model.hf_path:
            self.folder, self.sources = folder_sources(run.spec, run.model_args, run.cfg.model.hf_path)

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {k: (tuple(v.shape), v.dtype) for k, v in self.state.items()}

    @torch.no_grad()
    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = {}
        for k in names:
            like = self.state[k]
            t = torch.empty(like.shape, dtype=like.dtype)
            source = self.sources.get(k)
            if source is None:
                init_tensor(t, self.seed, k, self.rules[k])
            else:
                t.copy_(source.read(self.folder, tuple(slice(0, n) for n in t.shape)).to(t.dtype))
            out[k] = t
        if self.folder is not None:
            self.folder.close()
        return out


class MergedSource:
    """The base with every adapter of the checkpoint folded in, W + s * B @ A (lora/merge.py, float32
    or float64 arithmetic, in the base's dtype), a group at a time; expert stacks expert by expert."""

    def __init__(self, run: Run, step_dir: Path, meta: nn.Module, progress: Progress | None = None):
        self.base, self.adapters = BaseSource(run), DcpSource(step_dir, "model.")
        self.pairs = _adapter_entries(meta)
        missing = [n for p in self.pairs.values() for n in p[:2] if n not in self.adapters.metadata]
        if missing:
            raise ValueError(f"{step_dir} lacks adapter entries {missing[:4]} ({len(missing)} in all)")
        self.merged, self.done, self.progress = 0, 0, progress
        self.start = self.last = time.perf_counter()

    def entries(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.base.entries()

    @torch.no_grad()
    def load(self, names: list[str]) -> dict[str, torch.Tensor]:
        out = self.base.load(names)
        wanted = sorted({n for k in names if k in self.pairs for n in self.pairs[k][:2]})
        adapters = self.adapters.load(wanted) if wanted else {}
        for k in names:
            if k not in self.pairs:
                continue
            a, b, s = self.pairs[k]
            W, A, B = out[k], adapters[a], adapters[b]
            if W.dim() == 2:
                out[k] = merged_weight(W, A, B, s)
            else:
                for e in range(W.shape[0]):  # one expert at a time: no [E, out, in] float32 copy
                    W[e] = merged_weight(W[e], A[e], B[e], s)
            self.merged += 1
        self.done += len(names)
        total = len(self.base.state)
        if self.progress and (time.perf_counter() - self.last > 10 or self.done == total):
            self.last = time.perf_counter()
            self.progress(
                f"to-hf: {self.done} of {total} tensors written, {self.merged} with their adapters merged "
                f"({self.last - self.start:.0f} s)"
            )
        return out


_ST_DTYPE = {v: k for k, v in DTYPES.items()}


def write_peft_streamed(
    run: Run,
    step_dir: Path,
    meta: nn.Module,
    out_dir: str | Path,
    dtype: torch.dtype,
    progress: Progress | None = None,
) -> tuple[Path, int, int]:
    """adapter_config.json + adapter_model.safetensors of the checkpoint's adapters in PEFT's format
    (lora/peft.py), read and written a block at a time: the file's header is planned on the meta
    device, then each block's adapters are read from the checkpoint, laid out and appended. The config
    is written last. Returns (the folder, tensors, bytes); NotExportable before anything is written."""
    plan, hf_module = run.lora, run.spec.hf.hf_module
    on_meta = {n: p for n, p in meta.named_parameters() if is_adapter(n)}
    blocks = [f"layers.{i}" for i in meta.layers]
    config = adapter_config(plan, hf_module, base_model=run.cfg.model.hf_path)
    layout = {b: peft_tensors(on_meta, plan, [b], hf_module) for b in blocks}  # NotExportable here
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for tensors in layout.values():
        for name, t in tensors.items():
            n = t.numel() * dtype.itemsize
            header[name] = {"dtype": _ST_DTYPE[dtype], "shape": list(t.shape), "data_offsets": [at, at + n]}
            at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "adapter_model.safetensors.tmp"
    source, start = DcpSource(step_dir, "model."), time.perf_counter()
    last = start
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for i, block in enumerate(blocks):
            names = [n for n in on_meta if n.startswith(block + ".")]
            for name, t in peft_tensors(source.load(names), plan, [block], hf_module).items():
                assert list(t.shape) == header[name]["shape"], name
                f.write(t.to(dtype).contiguous().view(torch.uint8).numpy().tobytes())
            if progress and (time.perf_counter() - last > 10 or i + 1 == len(blocks)):
                last = time.perf_counter()
                progress(f"to-peft: {i + 1} of {len(blocks)} blocks ({last - start:.0f} s)")
    tmp.replace(out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out, len(header) - 1, at
