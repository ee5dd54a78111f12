"""Load a Hugging Face folder for any family into a plain or sharded model (each rank its slices).

    folder = HFFolder(spec, path)              # models/hf/folder.py: config.json, headers, sources
    stats = load_into(model, folder)           # allocated model (plain / DTensor shards)
    model = load(spec, path)                   # built from config.json, float32 on CPU

The family says only how (its `ModelSpec.hf`, an `HFAdapter`, models/hf/adapter.py). `load_into`
takes the folder's plan of every tensor of the model (from its headers, checked against the full
model that the args describe, built on the meta device: no memory; planned once per args, so a
run's start-up, which opened the folder, plans it once), then reads what this rank holds (models/hf/
io.py); bad input is refused before anything is written, in one line naming the file and the tensor.
The model keeps its args as `model.args`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import nn

from titan_thd.models.hf.adapter import HFFamily
from titan_thd.models.hf.folder import HFFolder, match_args
from titan_thd.models.hf.io import LoadStats, load_sources
from titan_thd.models.packed_weight import load_packed

logger = logging.getLogger(__name__)


def load_into(model: nn.Module, folder: HFFolder) -> LoadStats:
    """Load a folder into an allocated model (plain or sharded tensors, or a pipeline stage of it),
    each rank reading only its slices; config.json must describe `model.args`' architecture
    (ValueError naming the differing fields, or the file and tensor that do not fit, before anything
    is written). Returns what this rank read."""
    sources, headers = folder.sources(model.args), folder.headers
    # A LoRA run's base kept as released: its codes and scales as stored (models/packed_weight.py).
    codes_read = load_packed(model, sources, headers)
    stats = load_sources(model, sources, headers)
    stats = replace(stats, bytes_read=stats.bytes_read + codes_read)
    logger.info(
        "%s: loaded %d tensors, read %.1f of the folder's %.1f MB",
        folder.path,
        stats.tensors,
        stats.bytes_read / 1e6,
        stats.folder_bytes / 1e6,
    )
    return stats


def load(family: HFFamily, path: str | Path, flavor_or_args: str | Any | None = None) -> nn.Module:
    """The family's model with a folder's weights, float32 on CPU. `flavor_or_args`: a flavor name or
    args the folder must match (their training knobs are kept); None takes everything from
    config.json."""
    folder = HFFolder(family, path)
    args = match_args(family, folder.args, flavor_or_args, str(folder.config_file))
    model = family.build(args)
    load_into(model, folder)
    return model
