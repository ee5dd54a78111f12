"""DeepSeek-V4(-Flash) hybrid-attention MoE model on packed THD microbatches.

from titan_thd.models.dsv4 import load_hf, export_hf
model, args = load_hf("path/to/hf_checkpoint")        # config.json + *.safetensors
export_hf(model, args, "out_dir")                      # loadable by transformers' DeepseekV4ForCausalLM

(the family's door to models/hf/, through its adapter `spec.hf`, hf_adapter.py)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from titan_thd.models.dsv4.args import CP_MODE, DSv4Args, flavors
from titan_thd.models.dsv4.decode import DSv4Decoder
from titan_thd.models.dsv4.flops import flops_per_step
from titan_thd.models.dsv4.hf_adapter import HF
from titan_thd.models.dsv4.lora_targets import LORA
from titan_thd.models.dsv4.model import DSv4Model, build_dsv4, per_document_logits
from titan_thd.models.dsv4.parallelize import (
    AC_REGIONS,
    apply_compile,
    parallelize_dsv4,
    routed_expert_params,
    tp_divides,
)
from titan_thd.models.hf import HFFolder, export, load, load_into
from titan_thd.models.hf.io import LoadStats
from titan_thd.models.spec import CompileSpec, ModelSpec, ParallelSpec, PipelineSpec


def matrix_params(model: nn.Module) -> list[str]:
    """Muon's share: every 2-D weight and the [E, out, in] stacks of routed experts, except the
    embedding, the LM head and the compressor slot biases (`ape`). Norm weights, mHC base / scale,
    sinks and balancing biases are vectors (AdamW)."""
    return [
        name
        for name, p in model.named_parameters()
        if p.ndim in (2, 3) and not name.endswith(".ape") and name not in ("embed.weight", "head.weight")
    ]


def update_router_bias(model: nn.Module, reduce_group: torch.distributed.ProcessGroup | None) -> None:
    """After each optimizer step: nudge every learned router's bias towards balanced expert load."""
    for gate in model.router_gates():
        gate.update_bias(reduce_group)


_WIDTHS = ("dim", "head_dim", "rope_dim", "q_lora_rank", "o_lora_rank", "index_head_dim", "moe_inter_dim")


def narrow(args: DSv4Args, f: int) -> tuple[DSv4Args, list[int]]:
    """A copy with every width / f and one layer per (attention type, routing) kind, for measuring
    activation memory (memory/activations.py), and the copy's layer for every layer of `args`.
    Counts stay (heads, windows, top-k, routed experts per token); the expert count drops to 8 at
    most: experts are weights, and only the router's [T, E] scores depend on it."""
    if any(getattr(args, w) % f for w in _WIDTHS) or args.rope_dim // f % 2:
        raise ValueError(f"dsv4: widths {[getattr(args, w) for w in _WIDTHS]} do not narrow by {f}")
    kinds = [(t, i < args.n_hash_layers) for i, t in enumerate(args.layer_types)]
    unique = sorted(set(kinds), key=lambda kind: (not kind[1], kinds.index(kind)))  # hash layers first
    narrowed = dataclasses.replace(
        args,
        **{w: getattr(args, w) // f for w in _WIDTHS},
        layer_types=tuple(t for t, _ in unique),
        n_hash_layers=sum(hashed for _, hashed in unique),
        n_experts=max(args.n_activated_experts, min(args.n_experts, 8)),
    )
    return narrowed, [unique.index(kind) for kind in kinds]


def mtp_reads_embedding(model: DSv4Model) -> tuple[str, ...]:
    """Pipeline parallelism: the MTP block on the last stage embeds the next tokens with `embed`."""
    return ("embed",) if len(model.mtp) and model.args.mtp_loss_weight > 0 else ()


PIPELINE = PipelineSpec(
    first=("embed",),
    last=("hc_head", "norm", "head", "mtp"),
    boundary_shape=lambda args, rows: (rows, args.hc_mult, args.dim),  # the mHC streams
    tied=mtp_reads_embedding,
)

spec = ModelSpec(
    name="dsv4",
    flavors=flavors,
    default_flavor="tiny",
    build=build_dsv4,
    flops_per_step=flops_per_step,
    parallel=ParallelSpec(
        cp_mode=CP_MODE,
        min_tokens_per_cp_rank=lambda args: args.halo,
        tp_divides=tp_divides,
        expert_params=routed_expert_params,
        routed_experts=lambda args: args.n_experts,
    ),
    parallelize=parallelize_dsv4,
    ac_regions=AC_REGIONS,
    pipeline=PIPELINE,
    matrix_params=matrix_params,
    hf=HF,
    padded_forward=per_document_logits,
    decoder=DSv4Decoder,
    after_optimizer_step=update_router_bias,
    narrow=narrow,
    # 20-30 s of compile on the recipe's first step against 1.03x (the recipe, 2 threads) to
    # 1.12-1.20x (alternating steps in one process) per step of ~3.5 s on a 2-core EPYC
    # (docs/dsv4.md §18): it pays back after 50-300 steps.
    compile=CompileSpec(apply_compile, payback_steps=300),
    lora=LORA,
)


def load_hf(path: str | Path, flavor_or_args: str | DSv4Args | None = None) -> tuple[DSv4Model, DSv4Args]:
    """(model, args) from an HF DeepseekV4 folder, float32 on CPU (models/hf/load.py `load`):
    `flavor_or_args` a flavor name or DSv4Args the folder must match (their training knobs are kept);
    None takes everything from config.json."""
    model = load(spec, path, flavor_or_args)
    return model, model.args


def load_hf_into(model: DSv4Model, path: str | Path) -> LoadStats:
    """Load an HF folder into an allocated (plain or sharded) model, each rank its slices."""
    return load_into(model, HFFolder(spec, path))


def export_hf(
    model: DSv4Model, args: DSv4Args, out_dir: str | Path, dtype: torch.dtype | None = None, **options
):
    """Write `model` as an HF folder (models/hf/export.py `export`: tokenizer, context, max_shard_size)."""
    return export(spec, model, args, out_dir, dtype, **options)


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
