"""A dsv4 LoRA run's adapters in the layout vLLM serves on the run's base folder (`convert_hf.py
to-vllm`, docs/lora.md §6): the layout of lora/vllm.py, read from the checkpoint and written a block of
layers at a time (`SafetensorsFile`, the one safetensors writer), after every check that can refuse.

    line = to_vllm(src, out, "float32", open_run)          # the command: checks, the files, the summary
    check_vllm(run)                                         # the format and the base: before reading
    path, tensors, size = write_vllm(run, opened, "out", torch.float32)
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch

from titan_thd.components.progress import Progress
from titan_thd.export.adapters import ADAPTER_CONFIG, ADAPTER_FILE
from titan_thd.export.checkpoint import Opened, open_checkpoint
from titan_thd.export.commands import export_inputs
from titan_thd.export.merge import check_merge_dtype
from titan_thd.lora import vllm
from titan_thd.lora.targets import is_adapter
from titan_thd.models.hf.io import SafetensorsFolder
from titan_thd.models.hf.staging import refuse_overlap, staged
from titan_thd.models.hf.write import DcpExport, SafetensorsFile
from titan_thd.run import Run


def check_vllm(run: Run) -> None:
    """ValueError in one line, before the checkpoint is read, when vLLM cannot serve the run's adapters:
    a family, target or rank the format cannot express (lora/vllm.py), or no base folder (a base drawn
    from training.seed exists nowhere for vLLM to load)."""
    if run.lora is None:
        raise ValueError("the config has lora.enable = false: there are no adapters to export (use to-hf)")
    vllm.check_plan(run.lora, run.spec.name)
    if not run.cfg.model.hf_path:
        raise ValueError(
            f"model.hf_path is empty: the run's base was drawn from training.seed, which vLLM cannot load; "
            f"{vllm.FORMAT} needs a run trained on a base folder that vLLM serves (DeepSeek's release format)"
        )


def release_name(key: str) -> str:
    """The base folder's tensor that a vLLM adapter key applies to (`<name>.weight`)."""
    stem = key.removeprefix(vllm.PREFIX).removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
    return stem + ".weight"


def check_names(keys: list[str], folder: SafetensorsFolder) -> None:
    """ValueError unless every adapter key names a tensor of the base folder: vLLM loads DeepSeek's
    release names, which a transformers-format folder does not hold."""
    missing = [release_name(k) for k in keys if release_name(k) not in folder.tensors]
    if missing:
        example = next(iter(folder.tensors), "")
        raise ValueError(
            f"model.hf_path {folder.path} holds no tensor {missing[0]} ({len(set(missing))} adapted tensors "
            f"in all; it stores e.g. {example}): vLLM's DeepseekV4ForCausalLM serves adapters on a folder in "
            "DeepSeek's release format (its tensor names)"
        )


def write_vllm(
    run: Run, opened: Opened, out_dir: str | Path, dtype: torch.dtype, progress: Progress | None = None
) -> tuple[Path, int, int]:
    """adapter_config.json + adapter_model.safetensors in vLLM's layout: the header planned from the meta
    adapters, every key checked against the base folder's tensors, then each block's adapters read from
    the checkpoint (one layer's experts at most, never all), laid out and appended; the config last.
    `progress` advances once a block. Returns (the folder, tensors, bytes); ValueError before anything
    is written."""
    plan, to_hf = run.lora, run.spec.hf.to_hf
    assert plan is not None  # check_vllm refused a run without [lora]
    shapes = {k: tuple(v.shape) for k, v in opened.meta.state_dict().items()}

    def layout(adapters: dict[str, torch.Tensor], block: str) -> dict[str, torch.Tensor]:
        return vllm.vllm_tensors(adapters, plan, block, to_hf, shapes)

    on_meta = {n: p for n, p in opened.meta.named_parameters() if is_adapter(n)}
    blocks = [f"layers.{i}" for i in opened.meta.layers]
    planned = {b: layout(on_meta, b) for b in blocks}
    entries = {name: (tuple(t.shape), dtype) for tensors in planned.values() for name, t in tensors.items()}
    folder = run.hf.headers if run.hf is not None else SafetensorsFolder(run.cfg.model.hf_path)
    check_names(list(entries), folder)
    config = vllm.adapter_config(plan, vllm.target_leaves(entries), str(run.cfg.model.hf_path))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    file, checkpoint = SafetensorsFile(out / ADAPTER_FILE, entries), DcpExport(opened.step_dir, "model.")
    for block in blocks:
        names = [n for n in on_meta if n.startswith(block + ".")]
        for name, t in layout(checkpoint.load(names), block).items():
            file.write(name, t.to(dtype))
        if progress is not None:
            progress.advance()
    file.close()
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return out, len(entries), file.bytes


def to_vllm(
    src: Path, out: Path, dtype: str, open_run: Callable[[], Run], emit: Callable[[str], None] | None = None
) -> str:
    """A dsv4 LoRA run's checkpoint -> the adapters vLLM serves on its base folder, checked before
    anything is read or written; the summary line and the `vllm serve` command that serves them."""
    check_merge_dtype(dtype, lora=False)
    run = open_run()
    check_vllm(run)
    opened = open_checkpoint(run, src, adapters=True)
    refuse_overlap(out, export_inputs(run, src, opened.step_dir))
    blocks = len(opened.meta.layers)
    with Progress(f"{vllm.FORMAT}: writing the adapters", blocks, "blocks", announce=False, emit=emit) as p:
        with staged(out) as tmp:
            _, n, size = write_vllm(run, opened, tmp, getattr(torch, dtype), p)
    path = out
    assert run.lora is not None
    command = vllm.serve_command(str(run.cfg.model.hf_path), str(out), out.name or "adapter", run.lora.rank)
    return (
        f"wrote {path} from checkpoint {opened.step_dir}: {n} adapter tensors ({size / 1e6:.1f} MB, {dtype})\n"
        f"serve it (vLLM 0.34, not run on a GPU here): {command}"
    )
