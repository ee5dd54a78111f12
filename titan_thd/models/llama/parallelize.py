"""Parallelise a Llama model: tensor parallel -> compile -> activation recomputation -> FSDP, in that
fixed order (context parallelism needs no wrapping: the attention reads BatchMeta.cp).

docs/design.md §5.1: Megatron-style TP with sequence parallelism on the token rows and a
vocabulary-parallel LM head (components/loss.py computes the loss on its `Shard(-1)` logits).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from titan_thd.components.precision import Precision
from titan_thd.config import ActivationCheckpoint
from titan_thd.models.compile import compiled
from titan_thd.models.llama.model import FeedForward, Llama, swiglu
from titan_thd.parallel.activation_checkpoint import blocks_to_wrap
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.recompute import checkpoint_blocks, checkpoint_module
from titan_thd.parallel.tensor_parallel import ColwiseWithAdapter, RowwiseWithAdapter, present


def parallelize_llama(
    model: Llama,
    parallel_dims: ParallelDims,
    *,
    compile: bool = False,
    ac: ActivationCheckpoint,
    precision: Precision | None = None,
) -> Llama:
    """The model (or one pipeline chunk of it) under the layout of `parallel_dims`."""
    apply_tp(model, parallel_dims)
    if compile:  # training.compile as start-up resolved it
        apply_compile(model)
    apply_ac(model, ac)
    apply_fsdp(model, parallel_dims, precision)
    return model


AC_REGIONS = {
    "mlp": "the SwiGLU feed-forward (w1, w3, activation, w2)",
    "norms": "attention_norm and ffn_norm",
}
"""ModelSpec.ac_regions: activation_checkpoint.regions this model recomputes (mode = selective)."""


def apply_ac(model: Llama, ac: ActivationCheckpoint) -> None:
    """Recompute the first `ac.layers` blocks of this chunk (0 = all), whole (`full`) or in the regions
    `ac.regions` (`selective`); non-reentrant, FQNs unchanged. Under tensor parallelism a recomputed
    block (or feed-forward) posts its TP collectives again in the backward, on every tp rank alike;
    the modules' own input / output redistributions (PrepareModuleInput, SequenceParallel) run in their
    `__call__` and are not repeated (docs/design.md §5.5)."""
    if ac.mode == "none":
        return
    blocks = blocks_to_wrap(list(model.layers.values()), ac.layers)
    if ac.mode == "full":
        checkpoint_blocks(blocks, ac.offload)
        return
    for block in blocks:
        if "mlp" in ac.regions:
            checkpoint_module(block.feed_forward)
        if "norms" in ac.regions:
            checkpoint_module(block.attention_norm)
            checkpoint_module(block.ffn_norm)


def tp_divides(args) -> dict[str, int]:
    """Model sizes that parallelism.tensor_parallel_degree must divide (heads split over tp ranks;
    the vocabulary-parallel embedding and head, the feed-forward columns)."""
    return {
        "n_heads": args.n_heads,
        "n_kv_heads": args.n_kv_heads,
        "ffn_hidden_dim": args.ffn_hidden_dim,
        "vocab_size": args.vocab_size,
    }


def tp_plan(model: Llama) -> dict[str, ParallelStyle]:
    """{fqn: style} of Megatron-style TP with sequence parallelism on token-major activations.

    Between blocks the activations are sequence-sharded [T/tp, D] (`Shard(0)`); attention and the
    feed-forward all-gather them, split heads / hidden columns, and reduce-scatter back to rows.
    The BatchMeta argument of blocks is not a tensor (layout None).
    """
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(sequence_dim=0),
        # Vocabulary-parallel logits stay a DTensor: the loss runs under loss_parallel.
        "output": ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False),
    }
    for name in model.layers:
        plan |= {
            f"layers.{name}.attention_norm": SequenceParallel(sequence_dim=0),
            f"layers.{name}.attention": PrepareModuleInput(
                input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)
            ),
            f"layers.{name}.attention.wq": ColwiseWithAdapter(),
            f"layers.{name}.attention.wk": ColwiseWithAdapter(),
            f"layers.{name}.attention.wv": ColwiseWithAdapter(),
            f"layers.{name}.attention.wo": RowwiseWithAdapter(output_layouts=Shard(0)),
            f"layers.{name}.ffn_norm": SequenceParallel(sequence_dim=0),
            f"layers.{name}.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
            ),
            f"layers.{name}.feed_forward.w1": ColwiseWithAdapter(),
            f"layers.{name}.feed_forward.w3": ColwiseWithAdapter(),
            f"layers.{name}.feed_forward.w2": RowwiseWithAdapter(output_layouts=Shard(0)),
        }
    return plan


def apply_tp(model: Llama, parallel_dims: ParallelDims) -> None:
    """`tp_plan` over the tp mesh (degrees were checked by validate_tensor_parallel at start-up)."""
    tp_mesh = parallel_dims.get_optional_mesh("tp")
    if tp_mesh is None:
        return
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}  # a LoRA run's base
    parallelize_module(model, tp_mesh, present(model, tp_plan(model)))
    # torch's SequenceParallel re-registers the norms' weights as new, trainable parameters.
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)


def apply_fsdp(model: Llama, parallel_dims: ParallelDims, precision: Precision | None = None) -> None:
    """Shard every block, then the root (embedding, final norm and LM head), over the fsdp mesh
    (dp x cp; one rank under mixed precision, whose casting FSDP2 does). TP-sharded parameters
    become 2-D DTensors on (fsdp, tp): FSDP2 shards their local TP shard once more on dim 0."""
    from titan_thd.parallel import fsdp  # lazily: pulls in FSDP2 only where it shards

    fsdp_mesh = fsdp.fsdp_mesh(parallel_dims, precision)
    if fsdp_mesh is None:
        return
    blocks: list[nn.Module] = list(model.layers.values())
    # Under pipelining every microbatch would all-gather again after a reshard.
    fsdp.apply_fsdp(
        model, fsdp_mesh, blocks, precision=precision, reshard_after_forward=not parallel_dims.pp_enabled
    )


def apply_compile(model: nn.Module) -> None:
    """training.compile: regional torch.compile of the SwiGLU activation (docs/dsv4.md §18). Under
    tensor parallelism its inputs are still plain local tensors (ColwiseParallel's local output);
    the norms are left to torch's fused RMSNorm (DTensor inputs under sequence parallelism)."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.act = compiled(swiglu)
