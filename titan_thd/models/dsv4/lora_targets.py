"""dsv4's LoRA targets (models/projection.py, resolved by lora/targets.py): the main attention's projections, the shared expert and the
routed experts of every block in `layers`, named by their exact paths: the indexer's `wq_b` and the
compressors' projections are never adapted, and the MTP blocks (which transformers does not build,
so no served adapter could hold theirs) keep their base weights.

`attention` leaves out `wo_a` on purpose: transformers applies `o_a_proj` per head group
(`DeepseekV4GroupedLinear`), where PEFT's linear adapter cannot run; `attention.wo_a` trains and merges
(`convert_hf.py to-hf`) but `to-peft` refuses it. The routed experts' `w1` and `w3` share one A (PEFT's
adapter of the fused `gate_up_proj`), one adapter per expert.
"""

from __future__ import annotations

from titan_thd.models.projection import LoRATargets, Target

LORA = LoRATargets(
    targets={
        "attention.wq_a": Target("attn.wq_a"),
        "attention.wq_b": Target("attn.wq_b"),
        "attention.wkv": Target("attn.wkv"),
        "attention.wo_a": Target("attn.wo_a"),
        "attention.wo_b": Target("attn.wo_b"),
        "shared_expert.w1": Target("ffn.shared_experts.w1"),
        "shared_expert.w3": Target("ffn.shared_experts.w3"),
        "shared_expert.w2": Target("ffn.shared_experts.w2"),
        "experts.w13": Target("ffn.experts", ("w1", "w3"), "gate_up_proj"),
        "experts.w2": Target("ffn.experts", ("w2",), "down_proj"),
    },
    groups={
        "attention": ("attention.wq_a", "attention.wq_b", "attention.wkv", "attention.wo_b"),
        "shared_expert": ("shared_expert.w1", "shared_expert.w3", "shared_expert.w2"),
        "experts": ("experts.w13", "experts.w2"),
    },
    notes={"attention.wo_a": "trains and merges; not exportable to PEFT (transformers' grouped o_a_proj)"},
)
