"""Parallelise a Llama model: tensor parallel -> context parallel -> FSDP, in that fixed order."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from titan_thd.config import Parallelism
from titan_thd.models.llama.model import Llama
from titan_thd.parallel.parallel_dims import ParallelDims


def parallelize_llama(model: Llama, parallel_dims: ParallelDims, parallelism_cfg: Parallelism) -> Llama:
    """Apply the parallelisms of `parallel_dims` (the degrees in `parallelism_cfg` are already in it)."""
    apply_tp(model, parallel_dims)
    # Context parallelism needs no wrapping: the attention op reads the CP group, rank and mode
    # from BatchMeta.cp (titan_thd/parallel/context_parallel.py).
    apply_fsdp(model, parallel_dims)
    return model


def tp_plan(model: Llama) -> dict[str, ParallelStyle]:
    """{fqn: style} of Megatron-style TP with sequence parallelism on token-major activations.

    Between blocks the activations are sequence-sharded [T/tp, D] (`Shard(0)`); attention and the
    feed-forward all-gather them, split heads / hidden columns, and reduce-scatter back to rows.
    The BatchMeta argument of blocks is not a tensor (layout None).
    """
    plan: dict[str, ParallelStyle] = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "norm": SequenceParallel(sequence_dim=0),
        "output": ColwiseParallel(input_layouts=Shard(0), output_layouts=Replicate()),
    }
    for name in model.layers:
        plan |= {
            f"layers.{name}.attention_norm": SequenceParallel(sequence_dim=0),
            f"layers.{name}.attention": PrepareModuleInput(
                input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(), None)
            ),
            f"layers.{name}.attention.wq": ColwiseParallel(),
            f"layers.{name}.attention.wk": ColwiseParallel(),
            f"layers.{name}.attention.wv": ColwiseParallel(),
            f"layers.{name}.attention.wo": RowwiseParallel(output_layouts=Shard(0)),
            f"layers.{name}.ffn_norm": SequenceParallel(sequence_dim=0),
            f"layers.{name}.feed_forward": PrepareModuleInput(
                input_layouts=(Shard(0),), desired_input_layouts=(Replicate(),)
            ),
            f"layers.{name}.feed_forward.w1": ColwiseParallel(),
            f"layers.{name}.feed_forward.w3": ColwiseParallel(),
            f"layers.{name}.feed_forward.w2": RowwiseParallel(output_layouts=Shard(0)),
        }
    return plan


def apply_tp(model: Llama, parallel_dims: ParallelDims) -> None:
    if parallel_dims.tp > 1:
        raise NotImplementedError(
            f"parallelism.tensor_parallel_degree = {parallel_dims.tp}: tensor parallelism for llama "
            "is added by the TP issue (the plan is `tp_plan`); use 1"
        )


def apply_fsdp(model: Llama, parallel_dims: ParallelDims) -> None:
    """Shard every block, then the root (embedding, final norm and LM head), over the fsdp mesh."""
    fsdp_mesh = parallel_dims.get_optional_mesh("fsdp")
    if fsdp_mesh is None:
        return
    from titan_thd.parallel import fsdp  # lazily: pulls in FSDP2 only for multi-process runs

    blocks: list[nn.Module] = list(model.layers.values())
    # Under pipelining every microbatch would all-gather again after a reshard.
    fsdp.apply_fsdp(model, fsdp_mesh, blocks, reshard_after_forward=not parallel_dims.pp_enabled)
