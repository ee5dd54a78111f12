"""Stream a DeepSeek-V4 Hugging Face folder into a dsv4 model, each rank only the slices it holds.

`load_hf_into(model, path)` (the spec's `init_from_hf`) fills a model whose tensors are allocated,
plain (one process) or DTensors of any layout (FSDP / HSDP, TP, EP, EP x TP, a pipeline stage's
modules), in place: from the folder's headers it plans how each of our tensors is made of stored
ones (names mapped, per-expert tensors stacked, transformers' fused experts split, FP8 / FP4 weights
paired with their scales), checks the plan against the full model that config.json describes (a
meta copy: no memory), then every rank reads the box of each tensor it holds (models/hf/io.py),
dequantising only the scale blocks that box covers. The result is bitwise what reading the whole
folder and copying it in gives (tests/models/dsv4/test_hf_sharded.py).

Tensors the model has no place for that belong to layers it does not have (a second MTP layer,
layers past num_hidden_layers, a draft head such as DeepSeek-V4-Flash-0731's `dspark`) are skipped
with one logged line; any other unexpected tensor is an error.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch import nn

from titan_thd.config.jsonfile import read_json_object
from titan_thd.models.dsv4.hf_config import check_hf
from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources
from titan_thd.models.dsv4.hf_names import stored_to_ours
from titan_thd.models.dsv4.model import DSv4Model, build_dsv4
from titan_thd.models.hf.io import (
    LoadStats,
    Narrowed,
    Plain,
    SafetensorsFolder,
    Source,
    Stacked,
    check_fits,
    load_sources,
)

logger = logging.getLogger(__name__)


def dsv4_sources(folder: SafetensorsFolder, block: tuple[int, int] | None, where: str) -> dict[str, Source]:
    """Our name -> how to read it, for every tensor of the folder (headers only)."""
    quantized, scales = quantized_sources(folder.tensors, block)
    sources: dict[str, Source] = {}
    experts: dict[str, dict[int, Source]] = {}

    def put(key: str, source: Source, into: dict) -> None:
        if key in into:
            raise ValueError(f"{where}: {source.origin} and {into[key].origin} are both {key}")
        into[key] = source

    for name, stored in folder.tensors.items():
        if name in scales:
            continue
        source = quantized.get(name) or Plain(stored)
        key, expert, part = stored_to_ours(name)
        if expert is not None:
            put(str(expert), source, experts.setdefault(key, {}))
        elif part is not None:  # gate_up_proj [E, 2F, d]: w1 then w3 on dim 1 (torch.chunk's halves)
            rows = source.shape[1]
            half = -(-rows // 2)
            put(key, Narrowed(source, 1, 0, half), sources)
            put(key.removesuffix("w1") + "w3", Narrowed(source, 1, half, rows - half), sources)
        else:
            put(key, source, sources)
    for key, by_id in experts.items():
        ids = sorted(int(e) for e in by_id)
        if ids != list(range(len(ids))):
            absent = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise ValueError(
                f"{where}: {key}: experts {absent} are missing (the checkpoint has experts "
                f"{ids[0]}..{ids[-1]}, e.g. {by_id[str(ids[0])].origin})"
            )
        put(key, Stacked([by_id[str(e)] for e in ids]), sources)
    return sources


def _has_place(key: str, full: nn.Module) -> bool:
    """Whether the module a key belongs to exists in the model (its top-level module, and the entry
    of a layer list: `layers.50` or `mtp.1` do not in a 43-layer model with one MTP layer)."""
    parts = key.split(".")
    try:
        top = full.get_submodule(parts[0])
        if isinstance(top, (nn.ModuleDict, nn.ModuleList)) and len(parts) > 1:
            full.get_submodule(".".join(parts[:2]))
    except AttributeError:
        return False
    return True


def load_hf_into(model: DSv4Model, path: str | Path) -> LoadStats:
    """Load an HF checkpoint into an allocated model (plain or sharded tensors, or a pipeline stage of
    it), each rank reading only its slices; config.json must describe the model's architecture
    (ValueError naming the differing fields, or the file and tensor that do not fit, before anything
    is written). Returns what this rank read (LoadStats)."""
    path = Path(path)
    check_hf(model.args, path)
    folder = SafetensorsFolder(path)
    cfg_file = path / "config.json"
    block = check_quantization_config(read_json_object(cfg_file), str(cfg_file))
    sources = dsv4_sources(folder, block, str(path))
    with torch.device("meta"):  # the full model's names and shapes, no memory
        full = build_dsv4(model.args)
    expected = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    extras = sorted(k for k in sources if k not in expected and not _has_place(k, full))
    if extras:
        logger.warning(
            "%s: skipped %d tensors of layers the model does not have (MTP / draft layers), e.g. %s",
            path,
            len(extras),
            ", ".join(sources[k].origin for k in extras[:3]),
        )
        sources = {k: v for k, v in sources.items() if k not in extras}
    mtp = [k for k in expected if k.startswith("mtp.")]
    optional = mtp if not any(k in sources for k in mtp) else []
    if check_fits(sources, expected, str(path), "dsv4", optional):
        logger.warning("%s has no MTP weights; the MTP block keeps its initialisation", path)
    stats = load_sources(model, sources, folder)
    logger.info(
        "%s: loaded %d tensors, read %.1f of the folder's %.1f MB",
        path,
        stats.tensors,
        stats.bytes_read / 1e6,
        stats.folder_bytes / 1e6,
    )
    return stats
