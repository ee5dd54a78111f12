"""Whole-model twins of the streamed LoRA exports, for tests only: the merge in place on a model, the
adapter names by our naming, and the PEFT folder written from a dict of whole tensors (by
safetensors' own writer, not the package's titan_thd/models/hf/write.py `SafetensorsFile`).

    merge_(model)                                   # W + s B A in place; the adapters are removed
    adapter_pair("layers.0.attn.wq_a.weight")       # ("layers.0.attn.wq_a.lora_A", "...lora_B")
    write_peft(out, tensors, config, dtype)         # adapter_model.safetensors + adapter_config.json
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from titan_thd.export.merge import merged_weight
from titan_thd.lora.targets import adapter_names, is_adapter
from titan_thd.models.projection import ADAPTERS, SCALING
from titan_thd.parallel.shards import PAIRS


def adapter_pair(base: str) -> tuple[str, str] | None:
    """(A, B) tensor names of a base tensor's adapter, by our naming (None: `base` is not adaptable)."""
    module, _, leaf = base.rpartition(".")
    pair = ADAPTERS.get(leaf)
    if pair is None:
        return None
    return f"{module}.{pair[0]}", f"{module}.{pair[1]}"


@torch.no_grad()
def merge_(model: nn.Module) -> int:
    """Fold every attached adapter into its base weight, in place, and remove the adapters; returns
    the number of base tensors changed. The model then computes what the adapted one computed."""
    changed = 0
    for module in list(model.modules()):
        pairs = adapter_names(module)
        if not pairs:
            continue
        s = getattr(module, SCALING)
        for base, (a, b) in pairs.items():
            W = module.get_parameter(base)
            W.copy_(merged_weight(W, module.get_parameter(a), module.get_parameter(b), s))
            changed += 1
        for name in [n for n, _ in module.named_parameters(recurse=False) if is_adapter(n)]:
            del module._parameters[name]
        delattr(module, SCALING)
        delattr(module, PAIRS)
    for p in model.parameters():
        p.requires_grad_(True)
    return changed


def write_peft(
    out_dir: str | Path, tensors: dict[str, torch.Tensor], config: dict, dtype: torch.dtype | None
) -> Path:
    """Write the two files (tensors cast to `dtype`, default their own), the config last."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = {k: (v if dtype is None else v.to(dtype)).contiguous() for k, v in tensors.items()}
    save_file(cast, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
