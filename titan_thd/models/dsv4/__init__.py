"""DeepSeek-V4(-Flash) hybrid-attention MoE model on packed THD microbatches.

from titan_thd.models.dsv4 import load_hf, export_hf
model, args = load_hf("path/to/hf_checkpoint")        # config.json + *.safetensors
export_hf(model, args, "out_dir")                      # loadable by transformers' DeepseekV4ForCausalLM
"""

from __future__ import annotations

import torch
from torch import nn

from titan_thd.models.dsv4.args import CP_MODE, DSv4Args, flavors
from titan_thd.models.dsv4.flops import flops_per_step
from titan_thd.models.dsv4.hf_interop import check_hf, export_hf, load_hf, load_hf_into
from titan_thd.models.dsv4.model import DSv4Model, build_dsv4, per_document_logits
from titan_thd.models.dsv4.parallelize import apply_compile, parallelize_dsv4, tp_divides
from titan_thd.models.spec import ModelSpec


def matrix_params(model: nn.Module) -> list[str]:
    """Muon's share: every 2-D weight except the embedding, the LM head and the compressor slot
    biases (`ape`). Norm weights, mHC base / scale, sinks and balancing biases are vectors (AdamW)."""
    return [
        name
        for name, p in model.named_parameters()
        if p.ndim == 2 and not name.endswith(".ape") and name not in ("embed.weight", "head.weight")
    ]


def update_router_bias(model: nn.Module, reduce_group: torch.distributed.ProcessGroup | None) -> None:
    """After each optimizer step: nudge every learned router's bias towards balanced expert load."""
    for gate in model.router_gates():
        gate.update_bias(reduce_group)


spec = ModelSpec(
    name="dsv4",
    flavors=flavors,
    build=build_dsv4,
    flops_per_step=flops_per_step,
    cp_mode=CP_MODE,
    parallelize=parallelize_dsv4,
    tp_divides=tp_divides,
    min_tokens_per_cp_rank=lambda args: args.halo,
    matrix_params=matrix_params,
    init_from_hf=load_hf_into,
    check_hf=check_hf,
    padded_forward=per_document_logits,
    after_optimizer_step=update_router_bias,
    compile=apply_compile,
)

__all__ = [
    "DSv4Args",
    "DSv4Model",
    "build_dsv4",
    "export_hf",
    "flavors",
    "flops_per_step",
    "load_hf",
    "load_hf_into",
    "parallelize_dsv4",
    "spec",
]
