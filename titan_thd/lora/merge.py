"""Adapters folded into their base weights: W + s * B @ A, in the precision of the export (never into
FP8 / FP4 codes, where an update of 1e-3 of a weight's scale rounds to nothing).

    merged_weight(W, A, B, s)              # one tensor: [.., out, in] + s * [.., out, r] @ [.., r, in]
    merge_(model)                          # in place on a whole model; the adapters are removed
    adapter_pair(base)                     # the (A, B) tensor names of a base tensor's adapter
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.lora.targets import adapter_names, is_adapter
from titan_thd.models.projection import SCALING
from titan_thd.parallel.shards import PAIRS

# Our adapter tensor's last name -> (base parameter it updates, A's name, B's name).
_OF_BASE = {
    "weight": ("lora_A", "lora_B"),
    "w1": ("lora_A_w13", "lora_B_w1"),
    "w3": ("lora_A_w13", "lora_B_w3"),
    "w2": ("lora_A_w2", "lora_B_w2"),
}


def merged_weight(W: torch.Tensor, A: torch.Tensor, B: torch.Tensor, scaling: float) -> torch.Tensor:
    """W + s B A computed in float64 for float64 weights, float32 otherwise, returned in W's dtype
    (a float32 or bfloat16 export); [E, ...] stacks merge expert by expert."""
    acc = torch.float64 if W.dtype == torch.float64 else torch.float32
    delta = torch.matmul(B.to(acc), A.to(acc)) * scaling
    return (W.to(acc) + delta).to(W.dtype)


def adapter_pair(base: str) -> tuple[str, str] | None:
    """(A, B) tensor names of a base tensor's adapter, by our naming (None: `base` is not adaptable)."""
    module, _, leaf = base.rpartition(".")
    pair = _OF_BASE.get(leaf)
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
