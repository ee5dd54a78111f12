"""Adapters in the layout vLLM 0.34 serves a DeepSeek-V4 release folder with (`convert_hf.py to-vllm`,
docs/lora.md §6). Pure layout: names, shapes, the config; the checkpoint is read and the file written by
export/vllm_adapters.py.

Legend:  r rank   E routed experts   G head groups of wo_a   O o_lora rows per group

vLLM's `DeepseekV4ForCausalLM` names its modules after the release's tensors and reads PEFT's two files
with those names (its rename mapper adds `model.` itself). One key pair per release tensor:

    base_model.model.<release tensor name without .weight>.lora_A.weight   [r, in]
    base_model.model.<release tensor name without .weight>.lora_B.weight   [out, r]

    ours (one block)                              release tensors (the family's `to_hf`, the export's names)
    attn.{wq_a,wq_b,wkv,wo_b}.lora_A / lora_B      layers.L.attn.{wq_a,wq_b,wkv,wo_b}          as they are
    attn.wo_a.lora_A [r, I], lora_B [G * O, r]      layers.L.attn.wo_a                          as they are:
                                                   vLLM's grouped wo_a keeps one A and gives group g the B
                                                   rows g * O : (g + 1) * O, the rows our B_g holds
    ffn.shared_experts.{w1,w3,w2}                  layers.L.ffn.shared_experts.{w1,w3,w2}       as they are
    ffn.experts.lora_A_w13 [E, r, d]               layers.L.ffn.experts.E.w1 and .w3: A13[e] written to both
    ffn.experts.lora_B_w1 / _w3 [E, F, r]          layers.L.ffn.experts.E.w1 / .w3: B[e]
    ffn.experts.lora_A_w2 [E, r, F], lora_B_w2     layers.L.ffn.experts.E.w2

vLLM packs the routed experts' adapters only when w1, w2 and w3 of every global expert are present, so a
projection of the routed experts that the run did not adapt is written with A = B = 0 (a zero update).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from titan_thd.lora.targets import LoRAPlan

PREFIX = "base_model.model."
FORMAT = "to-vllm"
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values `vllm serve --max-lora-rank` takes (vllm/config/lora.py: MaxLoRARanks)."""

ToHF = Callable[[str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]]
"""A family's `HFAdapter.to_hf`: one of our tensors -> its release (name, tensor) pairs."""

SERVED: dict[str, dict[str, str]] = {
    "dsv4": {
        "attention.wq_a": "attn.fused_wqa_wkv (packed: wq_a, wkv)",
        "attention.wq_b": "attn.wq_b",
        "attention.wkv": "attn.fused_wqa_wkv (packed: wq_a, wkv)",
        "attention.wo_a": "attn.wo_a (DeepseekV4GroupedWoAWithLoRA: one A, B rows per head group)",
        "attention.wo_b": "attn.wo_b",
        "shared_expert.w1": "ffn.shared_experts.gate_up_proj (packed: w1, w3)",
        "shared_expert.w3": "ffn.shared_experts.gate_up_proj (packed: w1, w3)",
        "shared_expert.w2": "ffn.shared_experts.down_proj (the rename of w2)",
        "experts.w13": "ffn.experts (FusedMoEWithLoRA: per expert w1, w2, w3)",
        "experts.w2": "ffn.experts (FusedMoEWithLoRA: per expert w1, w2, w3)",
    }
}
"""Per family: our qualified LoRA target -> the module of vLLM's model that applies it (its class
DeepseekV4ForCausalLM, vllm/models/deepseek_v4/nvidia/model.py). A family or target not listed has no
vLLM layout here."""

# Our adapter names per base parameter (lora/targets.py's attach): (A, B).
_PAIR = {"weight": ("lora_A", "lora_B"), "w1": ("lora_A_w13", "lora_B_w1"), "w3": ("lora_A_w13", "lora_B_w3")}
_PAIR["w2"] = ("lora_A_w2", "lora_B_w2")
_EXPERT_PARAMS = ("w1", "w2", "w3")


def max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds `rank` (it zero-pads a smaller adapter)."""
    fits = [v for v in VLLM_RANKS if v >= rank]
    assert fits, rank  # check_plan refuses a larger rank first
    return fits[0]


def check_plan(plan: LoRAPlan, family: str) -> None:
    """ValueError in one line naming the target (or rank) and the format when vLLM cannot serve `plan`."""
    served = SERVED.get(family)
    if served is None:
        raise ValueError(
            f"model {family}: {FORMAT} writes adapters for vLLM's DeepseekV4ForCausalLM only (model dsv4); "
            "use to-peft for transformers + peft"
        )
    refused = [t for t in plan.targets if t not in served]
    if refused:
        raise ValueError(
            f"lora.targets {refused}: {FORMAT} cannot express them (vLLM's DeepseekV4ForCausalLM has no LoRA "
            f"layer for them; it serves {', '.join(served)})"
        )
    if plan.rank > VLLM_RANKS[-1]:
        raise ValueError(
            f"lora.rank = {plan.rank}: {FORMAT} cannot express it (vLLM 0.34's --max-lora-rank is at most "
            f"{VLLM_RANKS[-1]})"
        )


def _key(release: str, factor: str) -> str:
    assert release.endswith(".weight"), release
    return f"{PREFIX}{release.removesuffix('.weight')}.{factor}.weight"


def _pairs(
    to_hf: ToHF, base: str, A: torch.Tensor, B: torch.Tensor
) -> Iterable[tuple[str, torch.Tensor, str, torch.Tensor]]:
    """(A's key, A, B's key, B) per release tensor of our base tensor `base`: the family's own name map
    applied to each factor (an [E, ...] stack splits per expert with its base, in the same order)."""
    a_items, b_items = list(to_hf(base, A)), list(to_hf(base, B))
    assert [n for n, _ in a_items] == [n for n, _ in b_items], base
    for (name, a), (_, b) in zip(a_items, b_items, strict=True):
        yield _key(name, "lora_A"), a, _key(name, "lora_B"), b


def vllm_tensors(
    adapters: dict[str, torch.Tensor],
    plan: LoRAPlan,
    block: str,
    to_hf: ToHF,
    base_shapes: dict[str, tuple[int, ...]],
) -> dict[str, torch.Tensor]:
    """vLLM's keys -> tensors of one block's adapters (`adapters`: our names, whole tensors; meta tensors
    plan the file). `base_shapes`: our base tensors' shapes (the zero adapters of a routed-expert
    projection the run did not adapt). Views of the factors: the writer copies each."""
    out: dict[str, torch.Tensor] = {}
    experts_module, adapted = None, set()
    for name in plan.targets:
        target = plan.family.targets[name]
        module = f"{block}.{target.module}"
        for p in target.params:
            a, b = _PAIR[p]
            base = f"{module}.{p}"
            A, B = adapters[f"{module}.{a}"], adapters[f"{module}.{b}"]
            assert A.shape[:-2] == B.shape[:-2] and A.shape[-2] == B.shape[-1] == plan.rank, (base, A.shape)
            for ka, va, kb, vb in _pairs(to_hf, base, A, B):
                out[ka], out[kb] = va, vb
            if p in _EXPERT_PARAMS:
                experts_module, device = module, A.device
                adapted.add(p)
    if experts_module is not None:
        for p in _EXPERT_PARAMS:
            if p in adapted:
                continue
            *lead, rows, cols = base_shapes[f"{experts_module}.{p}"]
            # One zero matrix per factor, expanded over the experts: no [E, ...] allocation.
            zero_A = torch.zeros(plan.rank, cols, device=device).expand(*lead, plan.rank, cols)
            zero_B = torch.zeros(rows, plan.rank, device=device).expand(*lead, rows, plan.rank)
            for ka, va, kb, vb in _pairs(to_hf, f"{experts_module}.{p}", zero_A, zero_B):
                out[ka], out[kb] = va, vb
    return out


def target_leaves(keys: Iterable[str]) -> list[str]:
    """The modules' last names (`wq_a`, `w1`, ...) of vLLM keys, in order of first appearance."""
    leaves: dict[str, None] = {}
    for k in keys:
        leaves[k.removesuffix(".weight").rsplit(".", 2)[-2]] = None
    return list(leaves)


def adapter_config(plan: LoRAPlan, leaves: list[str], base_model: str) -> dict:
    """adapter_config.json for vLLM (vllm/lora/peft_helper.py): `r`, `lora_alpha`, `target_modules`
    (required; leaf names, informative: vLLM wraps modules by its own table), `use_rslora`; no
    `modules_to_save`, DoRA or bias, which it refuses."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": plan.rank,
        "lora_alpha": plan.alpha,
        "use_rslora": plan.rslora,
        "target_modules": leaves,
        "lora_dropout": 0.0,
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
    }


def serve_command(base_folder: str, out_dir: str, name: str, rank: int) -> str:
    """The `vllm serve` line for the release folder with these adapters (vLLM 0.34's flags)."""
    return (
        f"vllm serve {base_folder} --enable-lora --lora-modules {name}={out_dir} "
        f"--max-lora-rank {max_lora_rank(rank)}"
    )
