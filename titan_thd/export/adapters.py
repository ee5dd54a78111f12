"""A LoRA run's adapters in PEFT's format (`adapter_config.json` + `adapter_model.safetensors`, the
layout of lora/peft.py), for transformers + peft on the base folder (scripts/convert_hf.py to-peft;
docs/lora.md §3): read from the checkpoint and written a block of layers at a time, never the base.

    check_exportable(run)                                   # before the checkpoint is read
    path, tensors, size = write_peft(run, opened, "out", torch.float32)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from titan_thd.components.progress import Progress
from titan_thd.export.checkpoint import Opened
from titan_thd.lora.peft import adapter_config, peft_tensors
from titan_thd.lora.targets import is_adapter
from titan_thd.models.hf.write import DcpExport, SafetensorsFile
from titan_thd.run import Run

ADAPTER_FILE, ADAPTER_CONFIG = "adapter_model.safetensors", "adapter_config.json"


def check_exportable(run: Run) -> None:
    """NotExportable (one line) when a planned target is one PEFT cannot apply (dsv4's `attention.wo_a`):
    before the checkpoint is read."""
    if run.lora is not None:
        peft_tensors({}, run.lora, [], run.spec.hf.hf_module)


def base_name(run: Run) -> str:
    """adapter_config.json's base_model_name_or_path: the base folder (model.hf_path, by default the
    one the checkpoint recorded, export/recorded.py); never null, which peft's AutoPeftModel cannot
    follow. A seeded base has no folder: the string says what it is and how to get it."""
    if run.cfg.model.hf_path:
        return str(run.cfg.model.hf_path)
    return (
        f"titan_thd {run.cfg.model.name} flavor {run.flavor} drawn from training.seed = "
        f"{run.cfg.training.seed} (no folder: write it with models/hf/export.py)"
    )


def write_peft(
    run: Run, opened: Opened, out_dir: str | Path, dtype: torch.dtype, progress: Progress | None = None
) -> tuple[Path, int, int]:
    """The two files of the checkpoint's adapters: the file's header is planned on the meta device,
    then each block's adapters are read from the checkpoint, laid out and appended (models/hf/write.py
    `SafetensorsFile`); the config is written last. `progress` advances once a block. Returns (the
    folder, tensors, bytes); NotExportable before anything is written."""
    plan, hf_module = run.lora, run.spec.hf.hf_module
    assert plan is not None  # open_checkpoint(adapters=True) refused a run without [lora]
    on_meta = {n: p for n, p in opened.meta.named_parameters() if is_adapter(n)}
    blocks = [f"layers.{i}" for i in opened.meta.layers]
    config = adapter_config(plan, hf_module, base_model=base_name(run))
    layout = {b: peft_tensors(on_meta, plan, [b], hf_module) for b in blocks}  # NotExportable here
    entries = {name: (tuple(t.shape), dtype) for tensors in layout.values() for name, t in tensors.items()}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    file, checkpoint = SafetensorsFile(out / ADAPTER_FILE, entries), DcpExport(opened.step_dir, "model.")
    for block in blocks:
        names = [n for n in on_meta if n.startswith(block + ".")]
        for name, t in peft_tensors(checkpoint.load(names), plan, [block], hf_module).items():
            file.write(name, t.to(dtype))
        if progress is not None:
            progress.advance()
    file.close()
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out, len(entries), file.bytes
