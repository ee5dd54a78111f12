"""A trainer checkpoint opened for an export or for inference, the one way: its step folder found, its
kind and settings checked against the run (a LoRA checkpoint needs its run's [lora] and base), the
run's model built on the meta device (adapters attached) and the checkpoint's fingerprint checked
against it. Nothing of the weights is read.

    opened = open_checkpoint(run, "outputs/x")           # ValueError in one line on a mismatch
    opened.step_dir, opened.meta, opened.fingerprint     # then read_model(model, step_dir, fingerprint)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from torch import nn

from titan_thd.components import run_settings
from titan_thd.components.checkpoint import read_model
from titan_thd.components.checkpoint_folder import META_FILE, model_fingerprint, resolve_step_dir
from titan_thd.lora.targets import is_adapter
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.run import Run

LORA_SETTINGS = ("lora.rank", "lora.alpha", "lora.rslora", "lora.targets", "lora.base")
"""Run settings a checkpoint's adapters depend on beyond their names and shapes (its fingerprint)."""


@dataclass(frozen=True)
class Opened:
    step_dir: Path
    """The step folder (RUN/checkpoint/step-N) the source named."""
    meta: nn.Module
    """The run's model on the meta device, with its adapters in a LoRA run."""
    fingerprint: dict
    """Its fingerprint, the checkpoint's (components/checkpoint_folder.py `model_fingerprint`)."""


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


def open_checkpoint(run: Run, src: str | Path, adapters: bool = False) -> Opened:
    """The checkpoint `src` names (a step folder, a checkpoint folder or a run folder: its newest step),
    checked against `run` (see the module docstring); `adapters`: refuse a run without [lora] (an
    export of adapters). ValueError in one line."""
    step_dir = resolve_step_dir(src, run.cfg.checkpoint.folder)
    check_adapters(run, step_dir)
    if adapters and run.lora is None:
        raise ValueError("the config has lora.enable = false: there are no adapters to export (use to-hf)")
    meta = build_on_meta(run.build_model)
    fingerprint = model_fingerprint([meta], model=run.cfg.model.name, flavor=run.flavor)
    read_model(meta, step_dir, fingerprint, load=False)
    return Opened(step_dir, meta, fingerprint)
