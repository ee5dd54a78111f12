"""Parallelise a DSv4 model: tensor parallel -> expert parallel -> compile -> FSDP, in that fixed
order (context parallelism needs no wrapping: the attention reads BatchMeta.cp, contiguous mode
only; under TP every tp rank exchanges its halo and entries with the CP neighbours of its own tp
coordinate). Tensor and expert parallelism do not combine yet (refused at start-up).

Expert parallelism (docs/design.md §5.2): each rank keeps E / ep routed experts, which FSDP
shards as units of their own over `efsdp`.

Tensor parallelism (docs/design.md §5.1): the mHC streams [T, N, d] are sequence-parallel between
sub-layers (this rank's T/cp/tp rows; mHC and the norms run on them), attention and the MoE are
partial-sum regions over all T/cp rows (titan_thd/parallel/tensor_parallel.py), the embedding and
the LM head are vocabulary-parallel.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from titan_thd.models.compile import compiled
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.block import Block
from titan_thd.models.dsv4.mhc import HyperConnection, HyperHead, hc_post
from titan_thd.models.dsv4.model import DSv4Model
from titan_thd.models.dsv4.moe import Expert, Experts, MoE, swiglu
from titan_thd.models.dsv4.norm import RMSNorm, rms_norm_formula, weighted_rms_norm_formula
from titan_thd.parallel import expert_parallel
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.tensor_parallel import (
    GatherRows,
    ReplicatedFullGrad,
    ReplicatedPartialGrad,
    ShardedLocal,
    collect_replicated_grads,
)

if TYPE_CHECKING:
    from titan_thd.components.precision import Precision
    from titan_thd.config import Parallelism, Training


def parallelize_dsv4(
    model: DSv4Model,
    parallel_dims: ParallelDims,
    *,
    parallelism: Parallelism,
    training: Training,
    precision: Precision | None = None,
) -> DSv4Model:
    """The model (or one pipeline chunk of it) under the layout of `parallel_dims`."""
    apply_tp(model, parallel_dims)
    expert_units = apply_ep(model, parallel_dims)
    if training.compile:
        apply_compile(model)
    apply_fsdp(model, parallel_dims, precision, expert_units)
    return model


def tp_divides(args) -> dict[str, int]:
    """Model sizes that parallelism.tensor_parallel_degree must divide: heads and output groups
    split by whole groups (a group's heads stay on one rank), expert hidden columns, the vocabulary."""
    return {
        "n_heads": args.n_heads,
        "o_groups": args.o_groups,
        "moe_inter_dim": args.moe_inter_dim,
        "vocab_size": args.vocab_size,
    }


def _block_plan(prefix: str, block: nn.Module) -> dict[str, ParallelStyle]:
    attn, ffn = block.attn, block.ffn
    plan: dict[str, ParallelStyle] = {
        # Sequence-parallel rows: mHC and the norms see this rank's rows only.
        f"{prefix}.hc_attn": ReplicatedPartialGrad(),
        f"{prefix}.attn_norm": ReplicatedPartialGrad(),
        f"{prefix}.hc_ffn": ReplicatedPartialGrad(),
        f"{prefix}.ffn_norm": ReplicatedPartialGrad(),
        # Attention on all rows; query heads, sinks and output groups split by whole groups.
        f"{prefix}.attn": GatherRows(shard={"attn_sink": 0}),
        f"{prefix}.attn.wq_a": ReplicatedPartialGrad(),
        f"{prefix}.attn.q_norm": ReplicatedPartialGrad(),
        f"{prefix}.attn.wq_b": ShardedLocal(0),
        f"{prefix}.attn.wkv": ReplicatedPartialGrad(),  # the one shared K=V head
        f"{prefix}.attn.kv_norm": ReplicatedPartialGrad(),
        f"{prefix}.attn.wo_a": ShardedLocal(0),  # [G * o_lora, H * D / G]: whole groups
        f"{prefix}.attn.wo_b": ShardedLocal(1),
        # MoE on all rows; the router is replicated, every expert split on its hidden columns.
        f"{prefix}.ffn": GatherRows(),
        f"{prefix}.ffn.gate": ReplicatedPartialGrad(),
        f"{prefix}.ffn.shared_experts.w1": ShardedLocal(0),
        f"{prefix}.ffn.shared_experts.w3": ShardedLocal(0),
        f"{prefix}.ffn.shared_experts.w2": ShardedLocal(1),
    }
    if attn.compressor is not None:
        plan[f"{prefix}.attn.compressor"] = ReplicatedPartialGrad()
    if attn.indexer is not None:  # detached inputs, taught by an all-reduced teacher
        plan[f"{prefix}.attn.indexer"] = ReplicatedFullGrad()
    for e in range(len(ffn.experts)):
        plan |= {
            f"{prefix}.ffn.experts.{e}.w1": ShardedLocal(0),
            f"{prefix}.ffn.experts.{e}.w3": ShardedLocal(0),
            f"{prefix}.ffn.experts.{e}.w2": ShardedLocal(1),
        }
    return plan


def tp_plan(model: DSv4Model) -> dict[str, ParallelStyle]:
    """{fqn: style} of tensor + sequence parallelism (styles: parallel/tensor_parallel.py)."""
    plan: dict[str, ParallelStyle] = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
        "hc_head": ReplicatedPartialGrad(),
        "norm": ReplicatedPartialGrad(),
        "head": ColwiseParallel(input_layouts=Shard(0), output_layouts=Shard(-1), use_local_output=False),
    }
    for name, block in model.layers.items():
        plan |= _block_plan(f"layers.{name}", block)
    for j, block in enumerate(model.mtp):
        plan |= _block_plan(f"mtp.{j}", block)
        # The MTP input mixing and head run on the sequence-parallel rows too.
        plan |= {f"mtp.{j}.{m}": ReplicatedPartialGrad() for m in ("enorm", "hnorm", "e_proj", "h_proj")}
        plan |= {f"mtp.{j}.{m}": ReplicatedPartialGrad() for m in ("hc_head", "norm")}
    return plan


def apply_tp(model: DSv4Model, parallel_dims: ParallelDims) -> None:
    """`tp_plan` over the tp mesh (degrees were checked by validate_tensor_parallel at start-up)."""
    tp_mesh = parallel_dims.get_optional_mesh("tp")
    if tp_mesh is None:
        return
    bad = {k: v for k, v in tp_divides(model.args).items() if v % parallel_dims.tp}
    if bad:  # the trainer refuses these at start-up; direct callers get the same rule here
        raise ValueError(f"tensor parallel degree {parallel_dims.tp} does not divide dsv4 {bad}")
    parallelize_module(model, tp_mesh, tp_plan(model))
    for module in model.modules():
        if isinstance(module, Attention):  # the indexer-KL teacher sums its head mass over tp
            module.tp_group = tp_mesh.get_group()
    collect_replicated_grads(model, tp_mesh.get_group())


def apply_ep(model: DSv4Model, parallel_dims: ParallelDims) -> list[tuple[nn.Module, object]]:
    """Keep this rank's routed experts (parallel/expert_parallel.py); returns the FSDP units they
    form over `efsdp` (sharded even over one rank, so their blocks' FSDP leaves them out)."""
    if not parallel_dims.ep_enabled:
        return []
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_parallel.apply_ep(moes, parallel_dims.get_mesh("ep").get_group())
    efsdp_mesh = parallel_dims.get_mesh("efsdp")
    return [(m.experts, efsdp_mesh) for m in moes]


def routed_expert_params(model: nn.Module) -> list[str]:
    """ModelSpec.expert_params: the parameters `apply_ep` splits over the ep ranks."""
    return [
        f"{name}.experts.{p}"
        for name, m in model.named_modules()
        if isinstance(m, MoE)
        for p, _ in m.experts.named_parameters()
    ]


def apply_fsdp(
    model: DSv4Model,
    parallel_dims: ParallelDims,
    precision: Precision | None = None,
    expert_units: list[tuple[nn.Module, object]] = (),
) -> None:
    """FSDP per block (MTP blocks included), then the root, over the fsdp mesh (dp x cp; one rank
    under mixed precision, whose casting FSDP2 does). Under mixed precision the mHC modules are
    units of their own that compute in the master dtype: the reference keeps their parameters in
    float32 and the Sinkhorn's logits come from them (docs/design.md §5.4)."""
    from titan_thd.parallel import fsdp  # lazily: pulls in FSDP2 only where it shards

    fsdp_mesh = fsdp.fsdp_mesh(parallel_dims, precision)
    if fsdp_mesh is None:
        return
    blocks: list[nn.Module] = list(model.layers.values()) + list(model.mtp or ())
    # The mHC collapse returns a view (bmm(...)[:, 0]); FSDP2 warns that an in-place op on it would
    # skip its hook. Nothing modifies it in place (the norms and hc_post are out of place).
    warnings.filterwarnings("ignore", r"FSDP2-wrapped module \(FSDPHyper(Connection|Head)\) returned a view")
    fsdp.apply_fsdp(
        model,
        fsdp_mesh,
        blocks,
        precision=precision,
        reshard_after_forward=not parallel_dims.pp_enabled,
        other_units=list(expert_units),
        master_dtype_units=[m for m in model.modules() if isinstance(m, (HyperConnection, HyperHead))],
    )


def apply_compile(model: nn.Module) -> None:
    """training.compile: regional torch.compile of the element-wise chains (docs/dsv4.md §18) — the
    mHC update, every RMSNorm and the clamped SwiGLU of the experts. Works on any stage or shard of
    the model (the compiled functions see plain local tensors), before or after `parallelize_dsv4`."""
    for module in model.modules():
        if isinstance(module, Block):
            module.hc_post = compiled(hc_post)
        elif isinstance(module, RMSNorm):
            module.fn = compiled(weighted_rms_norm_formula)  # inductor fuses the plain formula
        elif isinstance(module, Attention):
            module.head_norm = compiled(rms_norm_formula)
        elif isinstance(module, (Expert, Experts)):
            module.act = compiled(swiglu)
