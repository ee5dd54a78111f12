"""Dense Llama-style GQA transformer on packed THD microbatches."""

import dataclasses

from titan_thd.models.llama.args import LlamaArgs, flavors, flops_per_step
from titan_thd.models.llama.decode import LlamaDecoder
from titan_thd.models.llama.hf_adapter import HF
from titan_thd.models.llama.lora_targets import LORA
from titan_thd.models.llama.model import Llama, build_llama, padded_logits
from titan_thd.models.llama.parallelize import AC_REGIONS, apply_compile, parallelize_llama, tp_divides
from titan_thd.models.spec import CompileSpec, ModelSpec, ParallelSpec, PipelineSpec


def narrow(args: LlamaArgs, f: int) -> tuple[LlamaArgs, list[int]]:
    """Widths / f and two layers (the first saves the RoPE tables every layer reads; the others are
    alike), for measuring activation memory."""
    if args.dim % f or args.ffn_hidden_dim % f:
        raise ValueError(f"llama: dim {args.dim} / ffn_hidden_dim {args.ffn_hidden_dim} do not narrow by {f}")
    narrowed = dataclasses.replace(
        args, dim=args.dim // f, ffn_hidden_dim=args.ffn_hidden_dim // f, n_layers=min(2, args.n_layers)
    )
    return narrowed, [min(i, 1) for i in range(args.n_layers)]


spec = ModelSpec(
    name="llama",
    flavors=flavors,
    default_flavor="debug",
    build=build_llama,
    flops_per_step=flops_per_step,
    parallel=ParallelSpec(
        # Only the zigzag split balances causal attention (titan_thd.ops.cp_attention).
        cp_mode="zigzag",
        tp_divides=tp_divides,
        te_attention=lambda args: args.attention_backend == "te",
    ),
    parallelize=parallelize_llama,
    ac_regions=AC_REGIONS,
    pipeline=PipelineSpec(
        first=("tok_embeddings",),
        last=("norm", "output"),
        boundary_shape=lambda args, rows: (rows, args.dim),
    ),
    padded_forward=padded_logits,
    decoder=LlamaDecoder,
    hf=HF,
    narrow=narrow,
    # Its one region (the SwiGLU) measured 1.01x per step (benchmarks/bench_llama_vs_torchtitan.py
    # --compile, docs/results.md §5): `auto` never compiles it.
    compile=CompileSpec(apply_compile, payback_steps=0),
    lora=LORA,
)

__all__ = ["Llama", "LlamaArgs", "build_llama", "flavors", "flops_per_step", "parallelize_llama", "spec"]
