"""Parallelise a DSv4 model: tensor parallel -> expert parallel -> compile -> activation
recomputation -> FSDP, in that fixed order (context parallelism needs no wrapping: the attention reads
BatchMeta.cp, contiguous mode only; under TP every tp rank exchanges its halo and entries with the CP
neighbours of its own tp coordinate).

Activation recomputation (docs/design.md §5.5, docs/dsv4.md §20): `full` checkpoints every block and
the MTP block; `selective` the regions of `AC_REGIONS`, none of which holds a routing decision or a
collective (router, indexer selection, dispatch and the CP exchanges stay outside them).

Expert parallelism (docs/design.md §5.2): the stacked routed experts [E, out, in] become DTensors
sharded over `ep` on the expert dimension; FSDP shards them as units of their own over `efsdp` on
their output dimension (dim 1), so every rank holds a share of every local expert. With tensor
parallelism too, each expert stays split on its hidden columns over tp (expert tensor parallelism =
tp: a 2-D (ep, tp) DTensor) and FSDP shards the model-width dimension instead (w1 / w3 [E, F, d] on
d, w2 [E, d, F] on d), so no dimension is split twice.

Tensor parallelism (docs/design.md §5.1): the mHC streams [T, N, d] are sequence-parallel between
sub-layers (this rank's T/cp/tp rows; mHC and the norms run on them), attention and the MoE are
partial-sum regions over all T/cp rows (titan_thd/parallel/tensor_parallel.py), the embedding and
the LM head are vocabulary-parallel.
"""

from __future__ import annotations

import warnings

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from titan_thd.components.precision import Precision
from titan_thd.config import ActivationCheckpoint
from titan_thd.models.compile import compiled
from titan_thd.models.dsv4.attention import Attention
from titan_thd.models.dsv4.block import Block
from titan_thd.models.dsv4.mhc import HyperConnection, HyperHead, hc_post_formula
from titan_thd.models.dsv4.model import DSv4Model
from titan_thd.models.dsv4.moe import Expert, Experts, MoE, swiglu
from titan_thd.models.dsv4.norm import RMSNorm, rms_norm_formula, weighted_rms_norm_formula
from titan_thd.parallel import expert_parallel
from titan_thd.parallel.activation_checkpoint import blocks_to_wrap
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.recompute import checkpoint_blocks, checkpoint_module, checkpointed
from titan_thd.parallel.tensor_parallel import (
    GatherRows,
    ReplicatedFullGrad,
    ReplicatedPartialGrad,
    ShardedLocal,
    collect_replicated_grads,
    present,
)


def parallelize_dsv4(
    model: DSv4Model,
    parallel_dims: ParallelDims,
    *,
    compile: bool = False,
    ac: ActivationCheckpoint,
    precision: Precision | None = None,
) -> DSv4Model:
    """The model (or one pipeline chunk of it) under the layout of `parallel_dims`."""
    apply_tp(model, parallel_dims)
    expert_units = apply_ep(model, parallel_dims)
    if compile:  # training.compile as start-up resolved it
        apply_compile(model)
    # After the compile: it swaps in the compiled forms of the functions the regions wrap.
    apply_ac(model, ac)
    apply_fsdp(model, parallel_dims, precision, expert_units)
    return model


AC_REGIONS = {
    "mhc": "the hyper-connection maps of attention and MoE (normalised projection, sigmoids, Sinkhorn, "
    "stream collapse)",
    "indexer": "the lightning indexer's differentiable scores of its KL loss (CSA layers; the top-k "
    "selection is kept)",
    "attn_up_proj": "the query up-projection, head norm and RoPE, and the K=V projection, norm and RoPE",
    "moe_act": "the clamped SwiGLU of the routed and the shared experts",
    "experts": "the routed experts (after routing and dispatch)",
    "norms": "every RMSNorm of the block",
}
"""ModelSpec.ac_regions: activation_checkpoint.regions this model recomputes (mode = selective)."""


def _wrap_region(block: Block, region: str) -> None:
    attn, ffn = block.attn, block.ffn
    if region == "mhc":
        checkpoint_module(block.hc_attn)
        checkpoint_module(block.hc_ffn)
    elif region == "indexer":
        if attn.indexer is not None:
            attn.indexer.scores = checkpointed(attn.indexer.scores)
    elif region == "attn_up_proj":
        attn.up_proj = checkpointed(attn.up_proj)
    elif region == "moe_act":
        for expert in (ffn.experts, ffn.shared_experts):
            expert.act = checkpointed(expert.act)
    elif region == "experts":
        checkpoint_module(ffn.experts)
    else:
        assert region == "norms", region  # validate_activation_checkpoint refused the others
        for norm in [m for m in block.modules() if isinstance(m, RMSNorm)]:
            checkpoint_module(norm)


def apply_ac(model: DSv4Model, ac: ActivationCheckpoint) -> None:
    """Recompute the first `ac.layers` blocks of this chunk (0 = all; the MTP block comes last), whole
    (`full`) or in the regions `ac.regions` (`selective`); non-reentrant, FQNs unchanged."""
    if ac.mode == "none":
        return
    blocks = blocks_to_wrap([*model.layers.values(), *(model.mtp or ())], ac.layers)
    if ac.mode == "full":
        checkpoint_blocks(blocks, ac.offload)
        return
    for block in blocks:
        for region in ac.regions:
            _wrap_region(block, region)


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
    attn = block.attn
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
        # MoE on all rows; the router is replicated, every expert split on its hidden columns
        # (the stacked routed experts: w1 / w3 [E, F, d] on F, w2 [E, d, F] on F).
        f"{prefix}.ffn": GatherRows(),
        f"{prefix}.ffn.gate": ReplicatedPartialGrad(),
        f"{prefix}.ffn.shared_experts.w1": ShardedLocal(0),
        f"{prefix}.ffn.shared_experts.w3": ShardedLocal(0),
        f"{prefix}.ffn.shared_experts.w2": ShardedLocal(1),
        f"{prefix}.ffn.experts": ShardedLocal({"w1": 1, "w3": 1, "w2": 2}),
    }
    if attn.compressor is not None:
        plan[f"{prefix}.attn.compressor"] = ReplicatedPartialGrad()
    if attn.indexer is not None:  # detached inputs, taught by an all-reduced teacher
        plan[f"{prefix}.attn.indexer"] = ReplicatedFullGrad()
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
    for j, block in enumerate(model.mtp or ()):  # None off the last pipeline stage
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
    parallelize_module(model, tp_mesh, present(model, tp_plan(model)))
    for module in model.modules():
        if isinstance(module, Attention):  # the indexer-KL teacher sums its head mass over tp
            module.tp_group = tp_mesh.get_group()
    collect_replicated_grads(model, tp_mesh.get_group())


EXPERT_FSDP_DIM = 1
"""The dimension FSDP shards the expert-parallel stacks on over `efsdp` (dim 0 is ep's)."""
EXPERT_TP_FSDP_DIMS = {"w1": 2, "w3": 2, "w2": 1, "lora_A_w13": 2, "lora_B_w1": 2, "lora_B_w3": 2}
EXPERT_TP_FSDP_DIMS |= {"lora_A_w2": 1, "lora_B_w2": 1}
"""Under TP x EP: a dimension of each stack that tp does not split (the model width of the experts;
of their LoRA adapters, the one that is not the hidden width)."""


def apply_ep(model: DSv4Model, parallel_dims: ParallelDims) -> list[tuple[nn.Module, object, int]]:
    """Shard the routed experts over `ep` (parallel/expert_parallel.py); returns the FSDP units they
    form over `efsdp` and the dimension it shards (sharded even over one rank, so their blocks'
    FSDP leaves them out)."""
    if not parallel_dims.ep_enabled:
        return []
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    ep_tp = parallel_dims.get_mesh("ep_tp") if parallel_dims.tp_enabled else None
    expert_parallel.apply_ep(moes, parallel_dims.get_mesh("ep"), ep_tp)
    efsdp_mesh = parallel_dims.get_mesh("efsdp")
    if ep_tp is None:
        return [(m.experts, efsdp_mesh, EXPERT_FSDP_DIM) for m in moes]
    units = []
    for m in moes:
        dims = {id(p): EXPERT_TP_FSDP_DIMS[n] for n, p in m.experts.named_parameters(recurse=False)}
        units.append((m.experts, efsdp_mesh, lambda p, dims=dims: dims[id(p)]))
    return units


def routed_expert_params(model: nn.Module) -> list[str]:
    """ModelSpec.parallel.expert_params: the parameters `apply_ep` splits over the ep ranks."""
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
    expert_units: list[tuple[nn.Module, object, int]] = (),
) -> None:
    """FSDP per block (MTP blocks included), then the root, over the fsdp mesh (dp x cp; one rank
    under mixed precision, whose casting FSDP2 does). Under mixed precision the mHC modules are
    units of their own that compute in the master dtype: the reference keeps their parameters in
    float32 and the Sinkhorn's logits come from them (docs/design.md §5.6)."""
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
            module.hc_post = compiled(hc_post_formula)  # inductor fuses the plain formula
        elif isinstance(module, RMSNorm):
            module.fn = compiled(weighted_rms_norm_formula)  # inductor fuses the plain formula
        elif isinstance(module, Attention):
            module.head_norm = compiled(rms_norm_formula)
        elif isinstance(module, (Expert, Experts)):
            module.act = compiled(swiglu)
