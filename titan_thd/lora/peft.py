"""Adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors` that `peft` loads onto
transformers' model of the base folder (docs/lora.md §3): for transformers + peft. vLLM's DeepSeek-V4
reads other names (DeepSeek's release tensors, one adapter per routed expert): lora/vllm.py, to-vllm.

Legend:  r rank   E routed experts   d model width   F expert width

A linear target becomes `base_model.model.<HF module>.lora_A.weight` [r, in] / `lora_B.weight` [out, r]
(ours as they are). A stacked routed-expert target is one of PEFT's `target_parameters` on the fused
3-D parameter (dsv4: `gate_up_proj` [E, 2F, d] = w1 then w3, `down_proj` [E, d, F]) with PEFT's
layout, which differs between the two factors:

    lora_A.weight [E * r, in]    row    e * r + j  = expert e's A row j   (expert-major blocks)
    lora_B.weight [out, r * E]   column j * E + e  = expert e's B column j (rank-major, interleaved)

and, when two parameters of one module are targeted, the first listed is wrapped innermost: its keys
carry one `base_layer.` more. `target_modules` is written as one regular expression of the exact
module paths (PEFT full-matches a string), so no loose suffix can reach the indexer's `q_b_proj` or
a compressor's `kv_proj`.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch

from titan_thd.lora.targets import LoRAPlan

PREFIX = "base_model.model."


class NotExportable(ValueError):
    """A planned target that PEFT cannot apply to the transformers model."""


def _stacked(plan: LoRAPlan) -> list[str]:
    return [n for n in plan.targets if plan.family.targets[n].peft_param]


def peft_tensors(
    adapters: dict[str, torch.Tensor], plan: LoRAPlan, blocks: list[str], hf_module: Callable[[str], str]
) -> dict[str, torch.Tensor]:
    """PEFT's state dict of our adapter tensors (`adapters`: our names, whole tensors, of every block in
    `blocks`, e.g. `layers.0`); `hf_module` maps our module path to transformers' module path."""
    refused = [n for n in plan.targets if n in plan.family.notes and "not exportable" in plan.family.notes[n]]
    if refused:
        raise NotExportable(f"lora.targets {refused}: {plan.family.notes[refused[0]]}")
    out: dict[str, torch.Tensor] = {}
    stacked = _stacked(plan)
    for block in blocks:
        for name in plan.targets:
            target = plan.family.targets[name]
            ours = f"{block}.{target.module}"
            hf = hf_module(ours)
            if not target.peft_param:
                out[f"{PREFIX}{hf}.lora_A.weight"] = adapters[f"{ours}.lora_A"]
                out[f"{PREFIX}{hf}.lora_B.weight"] = adapters[f"{ours}.lora_B"]
                continue
            # Nested ParamWrappers: the first targeted parameter of the module is the innermost.
            same_module = [n for n in stacked if plan.family.targets[n].module == target.module]
            wrap = "base_layer." * (len(same_module) - 1 - same_module.index(name))
            if target.params == ("w1", "w3"):
                A_ERI = adapters[f"{ours}.lora_A_w13"]
                B_EOR = torch.cat([adapters[f"{ours}.lora_B_w1"], adapters[f"{ours}.lora_B_w3"]], dim=1)
            else:
                (p,) = target.params
                A_ERI, B_EOR = adapters[f"{ours}.lora_A_{p}"], adapters[f"{ours}.lora_B_{p}"]
            E, r, n_in = A_ERI.shape
            out[f"{PREFIX}{hf}.{wrap}lora_A.weight"] = A_ERI.reshape(E * r, n_in).contiguous()
            out[f"{PREFIX}{hf}.{wrap}lora_B.weight"] = B_EOR.permute(1, 2, 0).reshape(-1, r * E).contiguous()
    return out


def adapter_config(plan: LoRAPlan, hf_module: Callable[[str], str], base_model: str = "") -> dict:
    """adapter_config.json for `plan` (block `layers.0` names the pattern of every block)."""
    linear = [n for n in plan.targets if not plan.family.targets[n].peft_param]
    paths = [re.escape(hf_module(f"layers.0.{plan.family.targets[n].module}")) for n in linear]
    pattern = "|".join(p.replace(r"layers\.0\.", r"layers\.\d+\.") for p in paths)
    params, seen = [], set()
    for n in _stacked(plan):
        t = plan.family.targets[n]
        hf = hf_module(f"layers.0.{t.module}")
        # PEFT matches a target parameter by the end of "<module path>.<parameter>": the path inside a block.
        suffix = hf.split("layers.0.", 1)[1] + "." + t.peft_param
        if suffix not in seen:
            params.append(suffix)
            seen.add(suffix)
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": plan.rank,
        "lora_alpha": plan.alpha,
        "use_rslora": plan.rslora,
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "target_modules": f"^(?:{pattern})$" if linear else None,
        "target_parameters": params or None,
        "modules_to_save": None,
    }
