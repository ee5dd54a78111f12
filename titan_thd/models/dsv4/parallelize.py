"""Parallelise a DSv4 model, in a fixed order: expert parallelism, then FSDP per block (routed
experts of an expert-parallel run as units of their own over `efsdp`, docs/design.md §5.1).
Context parallelism needs no wrapping; tensor parallelism is not implemented for dsv4."""

from __future__ import annotations

from torch import nn

from titan_thd.config import Parallelism
from titan_thd.models.dsv4.model import DSv4Model
from titan_thd.models.dsv4.moe import MoE
from titan_thd.parallel.expert_parallel import apply_ep
from titan_thd.parallel.parallel_dims import ParallelDims


def parallelize_dsv4(
    model: DSv4Model, parallel_dims: ParallelDims, parallelism_cfg: Parallelism
) -> DSv4Model:
    if parallel_dims.tp > 1:
        raise NotImplementedError(
            f"parallelism.tensor_parallel_degree = {parallel_dims.tp}: tensor parallelism for dsv4 is not "
            "implemented; use 1"
        )
    moes = [m for m in model.modules() if isinstance(m, MoE)]
    expert_units = []
    if parallel_dims.ep_enabled:
        apply_ep(moes, parallel_dims.get_mesh("ep").get_group())
        # Sharded even over one rank (ep = dp x cp): their blocks' FSDP must leave them out.
        efsdp_mesh = parallel_dims.get_mesh("efsdp")
        expert_units = [(m.experts, efsdp_mesh) for m in moes]
    # Context parallelism needs no wrapping: the attention reads BatchMeta.cp (contiguous mode only).
    fsdp_mesh = parallel_dims.get_optional_mesh("fsdp")
    if fsdp_mesh is None:
        return model
    from titan_thd.parallel import fsdp  # lazily: pulls in FSDP2 only for multi-process runs

    blocks: list[nn.Module] = list(model.layers.values()) + list(model.mtp or ())
    fsdp.apply_fsdp(
        model,
        fsdp_mesh,
        blocks,
        reshard_after_forward=not parallel_dims.pp_enabled,
        other_units=expert_units,
    )
    return model
