"""What scripts/convert_hf.py's subcommands do (it parses the arguments and prints the line each
returns; its docstring is the user's guide):

    run_to_hf(run, src, out, dtype, max_shard_size)      to-hf --config: a run's checkpoint -> HF folder
    to_peft(src, out, dtype, open_run)                   to-peft: a LoRA run's adapters -> PEFT folder
    to_dcp(hf_dir, out, flavor)                          to-dcp: HF folder -> DCP folder
    dcp_to_hf(dcp_dir, out, flavor, hf_config, dtype, max_shard_size)   to-hf of a DCP folder
    to_release(hf_dir, out, block, max_shard_size)       to-release: HF folder -> the release's format

Each returns the summary line; ValueError (NotExportable too) in one line on bad input.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from titan_thd.components.checkpoint_folder import PER_EXPERT_PARAM
from titan_thd.components.progress import Progress
from titan_thd.exits import one_line
from titan_thd.export.adapters import check_exportable, write_peft
from titan_thd.export.checkpoint import open_checkpoint
from titan_thd.export.merge import MergedExport, check_merge_dtype
from titan_thd.export.released import release_encoder
from titan_thd.models import MODEL_NAMES, get_model_spec, hf
from titan_thd.models.hf.released import parse_block, write_release
from titan_thd.models.hf.staging import refuse_overlap, staged
from titan_thd.models.hf.to_dcp import save_dcp
from titan_thd.models.hf.write import DcpExport
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.run import Run

Emit = Callable[[str], None]
"""Where a command's progress lines go (a command line's stderr)."""


def _as_dtype(dtype: str | None) -> torch.dtype | None:
    return getattr(torch, dtype) if dtype else None


def export_inputs(run: Run, src: Path, step_dir: Path) -> dict[str, Path | str | None]:
    """What an export of a run's checkpoint reads, for `refuse_overlap`: the source as given (a run
    folder names the run), its step folder, the base folder (model.hf_path; none for a seeded base)."""
    return {"run folder": src, "checkpoint": step_dir, "base folder": run.cfg.model.hf_path or None}


def run_to_hf(
    run: Run, src: Path, out: Path, dtype: str | None, max_shard_size: int, emit: Emit | None = None
) -> str:
    """A trainer checkpoint with its run's config -> HF folder with the tokenizer files, streamed from
    the checkpoint's model entries a group at a time (the model is never built). A LoRA run's: the
    base (model.hf_path or the seed) with its adapters merged, W + s * B @ A (export/merge.py), its
    progress lines to `emit` (default: the log)."""
    check_merge_dtype(dtype, lora=run.lora is not None, released=True)  # FP8 / FP4: as the base stores them
    cfg = run.cfg
    opened = open_checkpoint(run, src)
    refuse_overlap(out, export_inputs(run, src, opened.step_dir))
    progress = None
    if run.lora is not None:  # a merge can take minutes; a plain export copies tensors
        parts = len(opened.meta.state_dict())
        progress = Progress("to-hf: merging the adapters into the base", parts, "tensors", emit=emit)
        tensors = MergedExport(run, opened, progress)  # bad input refused before the first line
    else:
        tensors = DcpExport(opened.step_dir)
    # --dtype released: the base folder's own FP8 / FP4 format (export/released.py)
    encoder, extra = release_encoder(run, tensors) if dtype == "released" else (None, None)
    with progress or contextlib.nullcontext(), staged(out) as tmp:
        hf.export(
            run.spec,
            tensors,
            run.model_args,
            tmp,
            None if encoder is not None else _as_dtype(dtype),
            tokenizer=run.tokenizer,
            tokenizer_source=None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer,
            context=cfg.training.tokens_per_microbatch,
            max_shard_size=max_shard_size,
            encode=encoder,
            config_extra=extra,
        )
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    merged = (
        f" (base + the adapters of {tensors.merged} tensors)" if isinstance(tensors, MergedExport) else ""
    )
    survival = "".join("\n" + line for line in encoder.report()) if encoder is not None else ""
    return f"wrote {out} from checkpoint {opened.step_dir}{merged}: {files}{survival}"


def to_peft(src: Path, out: Path, dtype: str, open_run: Callable[[], Run], emit: Emit | None = None) -> str:
    """A LoRA run's checkpoint -> adapter_config.json + adapter_model.safetensors (PEFT), the adapters
    alone read from the checkpoint, a block at a time (the base is never built). `open_run`: the run,
    resolved once `dtype` is known to be one PEFT files hold; progress lines (a long export's) to `emit`."""
    check_merge_dtype(dtype, lora=False)
    run = open_run()
    check_exportable(run)
    opened = open_checkpoint(run, src, adapters=True)
    refuse_overlap(out, export_inputs(run, src, opened.step_dir))
    blocks = len(opened.meta.layers)
    with Progress("to-peft: writing the adapters", blocks, "blocks", announce=False, emit=emit) as progress:
        with staged(out) as tmp:
            _, n, size = write_peft(run, opened, tmp, getattr(torch, dtype), progress)
    return (
        f"wrote {out} from checkpoint {opened.step_dir}: {n} adapter tensors ({size / 1e6:.1f} MB, {dtype})"
    )


def hf_family(hf_dir: Path) -> tuple[ModelSpec, hf.HFFolder]:
    """(spec, the folder) of the family whose adapter reads the folder's config.json (its model_type)."""
    errors = []
    for name in MODEL_NAMES:
        spec = get_model_spec(name)
        if spec.hf is None:
            continue
        try:
            folder = hf.HFFolder(spec, hf_dir)
            _ = folder.args  # the family's reading of config.json: ValueError when it is not its own
            return spec, folder
        except ValueError as e:
            errors.append(f"{name}: {one_line(e)}")
    raise ValueError(f"{hf_dir}: no model family reads this config.json ({'; '.join(errors)})")


def to_dcp(hf_dir: Path, out: Path, flavor: str | None) -> str:
    """An HF folder -> a DCP folder of the trainer's `model` entries, one tensor at a time."""
    refuse_overlap(out, {"source folder": hf_dir})
    spec, folder = hf_family(hf_dir)
    if flavor is not None:
        if flavor not in spec.flavors:
            raise ValueError(f"--flavor {flavor!r}: expected one of {list(spec.flavors)} ({spec.name})")
        folder.check(spec.flavors[flavor], f"flavor {flavor!r}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    # One tensor at a time; what the folder lacks (transformers writes no MTP) is drawn from a seed.
    with staged(out) as tmp:
        n = save_dcp(spec, folder.args, folder, tmp, seed=int(torch.randint(2**62, ())))
        shutil.copy(folder.config_file, tmp / "config.json")
    return f"wrote {out}: {n} model tensors, args {spec.hf.architecture(folder.args)}"


def _dcp_args(spec: ModelSpec, source: DcpExport, flavor: str | None, hf_config: Path | None) -> Any:
    """The args of a DCP folder: from an HF config.json, or a flavor with the checkpoint's vocabulary
    (the trainer rounds the tokenizer's up): the model's first tensor is its embedding [V, d]."""
    if hf_config is not None:
        if spec.hf is None:
            raise ValueError(f"model {spec.name} reads no config.json (its ModelSpec.hf is None)")
        if hf_config.name == "config.json":
            return hf.folder_args(spec, str(hf_config.parent))
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(hf_config, Path(tmp) / "config.json")
            return hf.folder_args(spec, tmp)
    args = spec.flavors[flavor]
    first = next(iter(build_on_meta(lambda: spec.build(args)).state_dict()))
    return dataclasses.replace(args, vocab_size=source.entries()[first][0][0])


def dcp_to_hf(
    dcp_dir: Path,
    out: Path,
    flavor: str | None,
    hf_config: Path | None,
    dtype: str | None,
    max_shard_size: int,
) -> str:
    """A DCP folder (to-dcp's, or a checkpoint without its run's config) -> HF folder, streamed."""
    if dtype == "released":
        raise ValueError(
            "--dtype released writes the format of a run's base folder: give the run's --config (model.hf_path "
            "a release-format folder), or write a folder in the release format with to-release"
        )
    refuse_overlap(out, {"DCP folder": dcp_dir, "config": hf_config})
    if (flavor is None) == (hf_config is None):
        raise ValueError(
            "to-hf needs --config (the run's TOML: the model, and the tokenizer files to export), or for a "
            "DCP folder exactly one of --flavor or --hf-config"
        )
    source = DcpExport(dcp_dir, "model.")
    entries = source.entries()
    # The family whose model fits the entries: its flavor, or the one reading the config.json.
    spec = args = None
    for name in MODEL_NAMES:
        candidate = get_model_spec(name)
        if candidate.hf is None or (flavor is not None and flavor not in candidate.flavors):
            continue
        try:
            cand_args = _dcp_args(candidate, source, flavor, hf_config)
        except (ValueError, KeyError):
            continue
        first = next(iter(build_on_meta(lambda c=candidate, a=cand_args: c.build(a)).state_dict()))
        if first in entries:
            spec, args = candidate, cand_args
            break
    if spec is None:
        raise ValueError(
            f"{dcp_dir}: no model family with "
            + (f"flavor {flavor!r}" if flavor else f"the config {hf_config}")
            + " fits its entries"
        )
    expected = build_on_meta(lambda: spec.build(args)).state_dict()
    # A checkpoint from before the experts were stacked holds one entry per expert instead.
    legacy = any(PER_EXPERT_PARAM.search(k) for k in entries)
    missing = [
        f"model.{k}"
        for k in expected
        if k not in entries and not (legacy and re.search(r"experts\.w[123]$", k))
    ]
    if missing:
        raise ValueError(f"{dcp_dir} lacks {len(missing)} tensors of this architecture, e.g. {missing[:5]}")
    shapes = [
        f"model.{k}: checkpoint {entries[k][0]} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in entries and entries[k][0] != tuple(v.shape)
    ]
    if shapes:
        raise ValueError(f"{dcp_dir} does not have this architecture's shapes: " + "; ".join(shapes[:5]))
    check_merge_dtype(dtype, lora=False)
    with staged(out) as tmp:
        hf.export(spec, source, args, tmp, _as_dtype(dtype), max_shard_size=max_shard_size)
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    legacy_note = " (from per-expert entries)" if legacy else ""
    return f"wrote {out}: config.json + {len(files)} safetensors file(s){legacy_note}"


def to_release(hf_dir: Path, out: Path, block: str, max_shard_size: int) -> str:
    """Any HF folder -> the family's release format (FP8 / packed FP4, models/hf/released.py); the
    summary line and the encoder's report."""
    rows_cols = parse_block(block)
    refuse_overlap(out, {"source folder": hf_dir})
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    spec, folder = hf_family(hf_dir)
    with staged(out) as tmp:
        encoder = write_release(spec, folder, tmp, rows_cols, max_shard_size)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    lines = [f"wrote {out} in the release format (FP8 blocks {block}, FP4 experts): {size / 1e6:.1f} MB"]
    return "\n".join(lines + list(encoder.report()))
