"""`HFAdapter`: what one model family says about its Hugging Face format, and nothing else.

A family's `ModelSpec.hf` is one of these; the generic door (models/hf/load.py, models/hf/export.py)
does the rest for every family: read and check config.json, load a folder slice by slice into a
plain or sharded model, export a model or a DCP checkpoint in files of bounded size with the
tokenizer files (models/hf/tokenizer.py: the same for every family, so no field here). A family
whose tensors map one to one onto the folder's writes rename rules and uses the helpers below:

    OURS_TO_HF = [(r"^layers\\.(\\d+)\\.attn\\.wq\\.", r"model.layers.\\1.self_attn.q_proj."), ...]
    HF_TO_OURS = [(r"^model\\.layers\\.(\\d+)\\.self_attn\\.q_proj\\.", r"layers.\\1.attn.wq."), ...]
    hf = HFAdapter(
        to_hf=lambda key, value: [(rename(key, OURS_TO_HF), value)],
        sources=lambda folder, config, where: plain_sources(folder, HF_TO_OURS, where),
        config_from_args=config_from_args, args_from_config=args_from_config,
        architecture=lambda args: {...}, hf_module=lambda ours: module_name(ours, OURS_TO_HF, "toy"),
    )

Names are rewritten by `rename`, the one rename rule of the package: every rule of a table applies
in order, each to what the rules before it made.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from titan_thd.models.hf.io import Plain, SafetensorsFolder, Source
from titan_thd.models.hf.quant import Format

Rules = Sequence[tuple[str, str]]
"""(regex pattern, replacement) pairs, applied in order by `rename`."""


def rename(name: str, rules: Rules) -> str:
    """`name` after every rule of `rules` in order: `re.sub(pattern, replacement)` on what the rules
    before it made (so a later rule may rename the result of an earlier one; a table whose rules
    must not chain anchors its patterns so that one name matches one rule)."""
    for pattern, replacement in rules:
        name = re.sub(pattern, replacement, name)
    return name


def plain_sources(
    folder: SafetensorsFolder, rules: Rules, where: str, skip: Iterable[str] = ()
) -> dict[str, Source]:
    """`HFAdapter.sources` of a family whose tensors are stored one to one: our name (the stored
    name through `rules`) -> that stored tensor; stored names ending with one of `skip` are left out.
    ValueError when two stored tensors get the same name."""
    skip = tuple(skip)
    sources: dict[str, Source] = {}
    for name, stored in folder.tensors.items():
        if skip and name.endswith(skip):
            continue
        key = rename(name, rules)
        if key in sources:
            raise ValueError(f"{where}: {stored} and {sources[key].origin} are both {key}")
        sources[key] = Plain(stored)
    return sources


def module_name(ours: str, rules: Rules, family: str) -> str:
    """`HFAdapter.hf_module` through tensor rules that match whole name components (`...\\.wq\\.`):
    the module path with a dot appended, renamed, the dot removed. ValueError when no rule changes it
    (transformers has no such module)."""
    renamed = rename(ours + ".", rules)
    if renamed == ours + ".":
        raise ValueError(f"{family}: {ours!r} has no transformers module")
    return renamed[:-1]


@dataclass(frozen=True)
class HFAdapter:
    """One family's Hugging Face format: tensor names both ways, config.json both ways, the module
    names of transformers' model. Every callable is pure (no files, no process group)."""

    to_hf: Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
    """(our state-dict key, its tensor) -> the (stored name, tensor) pairs the export writes for it
    (one, or several: dsv4's expert stack is one tensor per expert). Views are fine: the export
    casts to its dtype and gives each tensor storage of its own."""
    sources: Callable[[SafetensorsFolder, dict, str], dict[str, Source]]
    """(a folder's headers, its config.json, the folder for messages) -> our key -> how it is read
    from stored tensors (models/hf/io.py `Plain`, `Stacked`, `Narrowed`, or the family's own
    `Source`, e.g. dsv4's dequantised FP8 / FP4 `Quantized`). Headers only, never tensor data;
    ValueError naming the file and the tensor for what cannot be read."""
    config_from_args: Callable[[Any, torch.dtype, dict | None, int], dict]
    """(args, dtype of the stored weights, bos / eos / pad ids of the tokenizer or None, the longest
    sequence trained or 0) -> the config.json that transformers' model class reads."""
    args_from_config: Callable[[dict, str], Any]
    """(config.json, its path for messages) -> the args it describes, training knobs at their
    defaults; ValueError for what the family cannot compute (another model_type, biases, ...)."""
    architecture: Callable[[Any], dict[str, Any]]
    """args -> {field: value} of every field config.json fixes: a flavor or args given with a
    folder must agree on each (the error names every difference)."""
    hf_module: Callable[[str], str]
    """our module path -> the path of the same module in transformers' model, the names of PEFT
    adapter files: `layers.3.attn.wq_a` -> `model.layers.3.self_attn.q_a_proj`; dsv4's expert stacks
    by parameter, `layers.3.ffn.experts.w1` -> `model.layers.3.mlp.experts.gate_up_proj` (a parameter
    of transformers' fused experts). ValueError for a module transformers does not have (dsv4's MTP)."""
    optional: tuple[str, ...] = ()
    """Top-level modules a folder may lack as a whole (dsv4's `mtp`: transformers writes none): they
    keep their initialisation, with one warning."""
    skip_unplaced: bool = False
    """True: stored tensors of modules the model does not have (layers past num_hidden_layers, a
    second MTP layer, a draft head) are skipped with one warning; False: they are unexpected
    tensors (an error)."""
    released: Callable[[str, tuple[int, ...]], Format | None] | None = None
    """(our key, global shape) -> how the family's published release stores that tensor (None: as a
    plain tensor), for a LoRA run whose base stays as released (models/packed_weight.py): a dry run plans it
    without the folder. None: the family publishes no block-quantised release."""
    initialises: bool = True
    """Whether `model.hf_path` may initialise a training run from such a folder (False: the load
    serves `load` and scripts/convert_hf.py only, and model.hf_path is refused)."""


class HFFamily(Protocol):
    """What models/hf/ reads of a family's `ModelSpec` (models/spec.py satisfies it): its name, its
    flavors, its adapter, and how to build the model args describe. A protocol, so that this package
    needs no import of the spec that imports it."""

    name: str
    flavors: dict[str, Any]
    hf: HFAdapter | None
    build: Callable[[Any], nn.Module]
