"""Read a Hugging Face folder for any family: its config.json, the args it describes, the check of a
flavor against it, and the load of its weights into a plain or sharded model (each rank its slices).

    args = folder_args(spec, path)                        # config.json -> the family's args
    check(spec, args, path, "model.flavor = 'tiny'")       # ValueError naming every difference
    stats = load_into(spec, model, path)                  # allocated model (plain / DTensor shards)
    folder, sources = folder_sources(spec, args, path)    # our key -> Source, checked (headers only)
    model = load(spec, path)                              # built from config.json, float32 on CPU
    rows = vocab_size(path, tokenizer.vocab_size)         # start-up: the embedding's rows

The family says only how (its `ModelSpec.hf`, an `HFAdapter`, models/hf/adapter.py). `load_into`
plans every tensor of the model from the folder's headers, checks the plan against the full model
that the args describe (built on the meta device: no memory), then reads what this rank holds
(models/hf/io.py); bad input is refused before anything is written, in one line naming the file and
the tensor. The model keeps its args as `model.args`.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_thd.config.jsonfile import read_json_object
from titan_thd.models.hf.adapter import HFAdapter
from titan_thd.models.hf.io import LoadStats, SafetensorsFolder, Source, check_fits, load_sources
from titan_thd.models.packed_weight import load_packed

if TYPE_CHECKING:
    from titan_thd.models.spec import ModelSpec

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def adapter_of(spec: ModelSpec) -> HFAdapter:
    """The family's adapter; ValueError when the family has no Hugging Face format."""
    if spec.hf is None:
        raise ValueError(f"model {spec.name} has no Hugging Face format (its ModelSpec.hf is None)")
    return spec.hf


def read_config(path: str | Path, prefix: str = "") -> dict:
    """config.json of a Hugging Face folder, the one reader of that file; ValueError `<prefix>...`
    naming the folder or the file (and line) when it is not a folder, missing or not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{prefix}{path}: not a folder (a Hugging Face folder holds config.json + *.safetensors)"
        )
    return read_json_object(path / CONFIG_FILE, prefix, missing=" (a Hugging Face folder holds config.json)")


def vocab_size(path: str | Path, tokenizer_vocab: int) -> int:
    """`vocab_size` of the config.json of `model.hf_path` (start-up: it fixes the embedding's rows, for
    every family); ValueError naming model.hf_path and the file unless it covers the tokenizer's ids."""
    if not Path(path).is_dir():
        raise ValueError(f"model.hf_path = {str(path)!r}: the folder does not exist (or is not a folder)")
    cfg_file = Path(path) / CONFIG_FILE
    vocab = read_config(path, prefix=f"model.hf_path = {str(path)!r}: ").get("vocab_size")
    if vocab is None:
        raise ValueError(f"model.hf_path: {cfg_file} has no vocab_size")
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"model.hf_path: {cfg_file}: vocab_size = {vocab!r}, expected a positive integer")
    if vocab < tokenizer_vocab:
        raise ValueError(
            f"model.hf_path: {cfg_file} has vocab_size = {vocab}, fewer rows than the tokenizer's "
            f"{tokenizer_vocab} ids (data.tokenizer must be the checkpoint's tokenizer)"
        )
    return vocab


def folder_args(spec: ModelSpec, path: str | Path) -> Any:
    """The args that a folder's config.json describes (training knobs at their defaults); ValueError
    naming the file when it cannot be read or describes what the family cannot compute."""
    adapter, cfg_file = adapter_of(spec), Path(path) / CONFIG_FILE
    config = read_config(path)
    try:
        return adapter.args_from_config(config, str(cfg_file))
    except (TypeError, AttributeError) as e:  # e.g. a string where a number or a table belongs
        raise ValueError(f"{cfg_file}: a value of the wrong type ({e})") from None


def match_args(
    spec: ModelSpec, ckpt: Any, flavor_or_args: str | Any | None, where: str, name: str = "the given args"
) -> Any:
    """The args to build: the checkpoint's (`flavor_or_args` None), or the flavor's / given ones after
    checking that their architecture is the checkpoint's (ValueError naming each differing field)."""
    if flavor_or_args is None:
        return ckpt
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in spec.flavors:
            raise ValueError(
                f"{spec.name} flavor {flavor_or_args!r} is unknown; expected one of {list(spec.flavors)}"
            )
        wanted, name = spec.flavors[flavor_or_args], f"flavor {flavor_or_args!r}"
    else:
        wanted = flavor_or_args
    architecture = adapter_of(spec).architecture
    have, want = architecture(ckpt), architecture(wanted)
    diffs = [f"{k}: checkpoint {have[k]!r} vs {want[k]!r}" for k in want if have[k] != want[k]]
    if diffs:
        raise ValueError(f"{where} does not match {name}: " + "; ".join(diffs))
    return replace(wanted)


def check(spec: ModelSpec, args: Any, path: str | Path, name: str = "the given args") -> None:
    """ValueError unless the folder's config.json describes `args`' architecture (`name` says where
    they come from) and its safetensors files are complete (index, headers, sizes). Cheap (config.json
    and the headers): start-up calls it before anything is built."""
    path = Path(path)
    match_args(spec, folder_args(spec, path), args, str(path / CONFIG_FILE), name)
    SafetensorsFolder(path)


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


def folder_sources(
    spec: ModelSpec, args: Any, path: str | Path
) -> tuple[SafetensorsFolder, dict[str, Source]]:
    """(the folder, our key -> how it is read) of every tensor of the model `args` describe that the
    folder holds, checked against that model's names and shapes (ValueError naming the file and the
    tensor); headers only. A top-level module of `adapter.optional` may be absent (one warning)."""
    adapter, path = adapter_of(spec), Path(path)
    check(spec, args, path)
    folder = SafetensorsFolder(path)
    sources = adapter.sources(folder, read_config(path), str(path))
    with torch.device("meta"):  # the full model's names and shapes, no memory
        full = spec.build(args)
    expected = {k: tuple(v.shape) for k, v in full.state_dict().items()}
    if adapter.skip_unplaced:
        extras = sorted(k for k in sources if k not in expected and not _has_place(k, full))
        if extras:
            logger.warning(
                "%s: skipped %d tensors of layers the model does not have (MTP / draft layers), e.g. %s",
                path,
                len(extras),
                ", ".join(sources[k].origin for k in extras[:3]),
            )
            sources = {k: v for k, v in sources.items() if k not in extras}
    optional = []
    for top in adapter.optional:
        keys = [k for k in expected if k.startswith(top + ".")]
        if not any(k in sources for k in keys):
            optional += keys
    absent = check_fits(sources, expected, str(path), spec.name, optional)
    if absent:
        tops = sorted({k.split(".")[0] for k in absent})
        logger.warning("%s has no weights of %s; they keep their initialisation", path, ", ".join(tops))
    return folder, sources


def load_into(spec: ModelSpec, model: nn.Module, path: str | Path) -> LoadStats:
    """Load a folder into an allocated model (plain or sharded tensors, or a pipeline stage of it),
    each rank reading only its slices; config.json must describe `model.args`' architecture
    (ValueError naming the differing fields, or the file and tensor that do not fit, before anything
    is written). Returns what this rank read."""
    folder, sources = folder_sources(spec, model.args, path)
    # A LoRA run's base kept as released: its codes and scales as stored (models/packed_weight.py).
    codes_read = load_packed(model, sources, folder)
    stats = load_sources(model, sources, folder)
    stats = replace(stats, bytes_read=stats.bytes_read + codes_read)
    logger.info(
        "%s: loaded %d tensors, read %.1f of the folder's %.1f MB",
        path,
        stats.tensors,
        stats.bytes_read / 1e6,
        stats.folder_bytes / 1e6,
    )
    return stats


def load(spec: ModelSpec, path: str | Path, flavor_or_args: str | Any | None = None) -> nn.Module:
    """The family's model with a folder's weights, float32 on CPU. `flavor_or_args`: a flavor name or
    args the folder must match (their training knobs are kept); None takes everything from
    config.json."""
    path = Path(path)
    args = match_args(spec, folder_args(spec, path), flavor_or_args, str(path / CONFIG_FILE))
    model = spec.build(args)
    load_into(spec, model, path)
    return model
