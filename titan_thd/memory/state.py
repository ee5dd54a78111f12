"""Parameter, gradient and optimizer-state bytes per rank, and the byte formatter of every memory line.

`estimate_memory_per_rank` counts one rank's share of a model: a full, a sharded (DTensor shapes are
global) or a meta-built one, as FSDP (over dp x cp), expert parallelism and, on a sharded model,
tensor parallelism cut it; under pipeline parallelism also what FSDP keeps unsharded for the stage
between microbatches (docs/design.md §5.6). `largest_unsharded_unit_bytes` reads a model FSDP has
already wrapped (what one all-gather materialises). Activations are memory/activations.py's.

A LoRA run's frozen base kept as released (`lora.base_dtype = "released"`, models/packed_weight.py) is
counted at its stored bytes (`ResidentBytes`: codes + scales of this rank's boxes), never in the
master dtype: FSDP and CP replicate it, TP and EP cut it as the parameter, it has no gradient, no
optimizer state and no gathered copy. `resident_boxes` finds those boxes on a built model (its
`PackedWeight`s) or on a meta one (the run's {key: Format}).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from titan_thd.components.precision import Precision
from titan_thd.models.hf.quant import Format
from titan_thd.models.packed_weight import packed_weights
from titan_thd.parallel.parallel_dims import EP_TP_DIMS, ParallelDims
from titan_thd.parallel.shards import canonical_name


def size(n_bytes: float) -> str:
    """Bytes for a memory line: GiB from 1 GiB on, else MiB."""
    return f"{n_bytes / 2**30:.2f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


_size = size  # (MemoryEstimate.__str__ has a `size` of its own)


def largest_unsharded_unit_bytes(model: nn.Module) -> int:
    """Bytes of the largest FSDP unit's full (unsharded) parameters: what one all-gather of a
    forward or backward materialises on a rank, whatever the fsdp degree (its tp share under TP,
    its own experts under EP), in the dtype the unit gathers in (its mixed-precision compute dtype)."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] or [model]
    nested = {u: [v for v in u.modules() if v is not u and isinstance(v, FSDPModule)] for u in units}
    largest = 0
    for unit in units:
        inner = {id(p) for v in nested[unit] for p in v.parameters()}
        own = [p for p in unit.parameters() if id(p) not in inner]
        gathered = unit._get_fsdp_state()._mp_policy.param_dtype if isinstance(unit, FSDPModule) else None
        # A DTensor's global shape, less its tp / ep split (an FSDP all-gather stops at them).
        largest = max(
            largest,
            sum(math.prod(_model_parallel_shape(p)) * (gathered or p.dtype).itemsize for p in own),
        )
    return largest


@dataclass(frozen=True)
class ResidentBytes:
    """One rank's frozen base kept as released (models/packed_weight.py): its codes and scales as stored."""

    codes: int = 0
    """FP8 codes (1 B per value) and packed FP4 codes (0.5 B per value)."""
    scales: int = 0
    """Their scales (one per block, edge blocks whole)."""
    values: int = 0
    """Values the boxes stand for (this rank's share of the weights)."""
    by_kind: tuple[tuple[str, int], ...] = ()
    """(format kind, codes + scales bytes) per kind, sorted: ("fp4", ...), ("fp8", ...)."""

    @property
    def total(self) -> int:
        return self.codes + self.scales

    def describe(self) -> str:
        """`codes 23.1 GiB + scales 0.8 GiB; fp4 17.4 GiB, fp8 6.5 GiB`: the parts of the header lines."""
        kinds = ", ".join(f"{kind} {size(n)}" for kind, n in self.by_kind)
        return f"codes {size(self.codes)} + scales {size(self.scales)}; {kinds}"


def resident_bytes(boxes: Mapping[str, tuple[Format, tuple[int, ...]]]) -> ResidentBytes:
    """Codes, scales and values of {key: (Format, local shape)} (`resident_boxes`): each box's
    `Format.stored_bytes`, of which `Format.code_shape`'s bytes are codes."""
    codes = scales = values = 0
    kinds: dict[str, int] = {}
    for fmt, shape in boxes.values():
        stored, only_codes = fmt.stored_bytes(shape), math.prod(fmt.code_shape(shape))
        codes, scales, values = codes + only_codes, scales + stored - only_codes, values + math.prod(shape)
        kinds[fmt.kind] = kinds.get(fmt.kind, 0) + stored
    return ResidentBytes(codes, scales, values, tuple(sorted(kinds.items())))


def resident_boxes(
    model: nn.Module,
    parallel_dims: ParallelDims,
    resident: Mapping[str, Format] | None = None,
    expert_params: Collection[str] = (),
) -> dict[str, tuple[Format, tuple[int, ...]]]:
    """{key: (Format, this rank's shape)} of the base kept as released: a built model's `PackedWeight`s
    (their boxes exactly), and the parameters of a meta or sharded model named in `resident` (the
    run's {key: Format}) as TP and EP would cut them: a DTensor's tp / ep share; on a model not yet
    split, routed experts (`expert_params`) 1 / ep of the stack (rank 0's, the largest) and no tp
    split (an upper bound under tp > 1, as every figure of the plan). Never cut by FSDP or CP."""
    out = {key: (w.fmt, w.shape) for key, w in packed_weights(model).items()}
    if not resident:
        return out
    d = parallel_dims
    for name, p in model.named_parameters():
        key = canonical_name(name)
        if key not in resident:
            continue
        if isinstance(p, DTensor):
            shape = _model_parallel_shape(p)
        elif d.ep_enabled and name in expert_params:
            shape = (math.ceil(p.shape[0] / d.ep), *p.shape[1:])
        else:
            shape = tuple(p.shape)
        out[key] = (resident[key], tuple(shape))
    return out


@dataclass(frozen=True)
class MemoryEstimate:
    """Parameter memory of one rank: the sharded master state, and under pipeline parallelism what
    FSDP keeps unsharded for the whole stage between its microbatches (docs/design.md §5.6)."""

    params: int
    """Parameters held by this rank (its FSDP shards)."""
    param_bytes: int
    """Sharded master weights."""
    grad_bytes: int
    """Sharded gradients (master dtype: FSDP reduce-scatters into them)."""
    optimizer_bytes: int
    stage_params: int = 0
    """Elements FSDP keeps unsharded on this rank between a pipeline stage's microbatches (its
    stage's parameters, this rank's tp share and experts): 0 without pipeline parallelism."""
    stage_param_bytes: int = 0
    """Their gathered copy, in the compute dtype (reshard_after_forward is off under PP)."""
    stage_grad_bytes: int = 0
    """Their gradients accumulated unsharded until the step's last backward, in the reduction dtype."""
    trained_params: int | None = None
    """Of `params`, those that train (None: all); fewer in a LoRA run, whose frozen base has no
    gradient and no optimizer state."""
    resident: ResidentBytes = ResidentBytes()
    """The frozen base kept as released, at its stored bytes (not in `params`: no parameter holds it)."""

    @property
    def frozen_params(self) -> int:
        return 0 if self.trained_params is None else self.params - self.trained_params

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.grad_bytes
            + self.optimizer_bytes
            + self.stage_param_bytes
            + self.stage_grad_bytes
            + self.resident.total
        )

    def per_parameter(self) -> str:
        """Bytes per parameter of the scheme, e.g. `master 4 + grads 4 + optimizer 8 B per parameter;
        per stage parameter between microbatches: compute copy 2 + grads 4 B`."""

        def per(n: int, count: int) -> str:
            return f"{n / max(1, count):.3g}"

        out = (
            f"master {per(self.param_bytes, self.params)} + grads {per(self.grad_bytes, self.params)} + "
            f"optimizer {per(self.optimizer_bytes, self.params)} B per parameter"
        )
        if self.stage_params:
            out += (
                f"; per stage parameter between microbatches: compute copy "
                f"{per(self.stage_param_bytes, self.stage_params)} + grads "
                f"{per(self.stage_grad_bytes, self.stage_params)} B ({self.stage_params:,} unsharded)"
            )
        return out

    def __str__(self) -> str:
        # One unit for the whole line: GiB for real models, MiB for the small ones of tests.
        unit, scale = ("GiB", 1024**3) if self.total_bytes >= 1024**3 else ("MiB", 1024**2)

        def size(n: int) -> str:
            return f"{n / scale:.2f} {unit}"

        stage = (
            f" + stage copy {size(self.stage_param_bytes)} + stage grads {size(self.stage_grad_bytes)}"
            if self.stage_params
            else ""
        )
        if self.resident.values:  # LoRA on a base kept as released: its stored bytes, then the rest
            base = self.param_bytes * self.frozen_params // max(1, self.params)
            return (
                f"{self.params:,} parameters per rank: frozen base {self.frozen_params:,} (no grads, no "
                f"optimizer state) + adapters {self.trained_params:,}, and {self.resident.values:,} base "
                f"values kept as released; estimated memory per rank: base as released "
                f"{_size(self.resident.total)} ({self.resident.describe()}; no gradient, no optimizer "
                f"state, no gathered copy) + other frozen base {_size(base)} (master dtype) + adapters "
                f"{_size(self.param_bytes - base)} + their grads {_size(self.grad_bytes)} + their optimizer "
                f"state {_size(self.optimizer_bytes)}{stage} = {_size(self.total_bytes)} (activations excluded)"
            )
        if self.frozen_params:  # LoRA: the base's master copy, the adapters' copy, grads and state
            base = self.param_bytes * self.frozen_params // self.params
            return (
                f"{self.params:,} parameters per rank: frozen base {self.frozen_params:,} (no grads, no "
                f"optimizer state) + adapters {self.trained_params:,}; estimated memory per rank: base "
                f"{_size(base)} + adapters {_size(self.param_bytes - base)} + their grads "
                f"{_size(self.grad_bytes)} + their optimizer state {_size(self.optimizer_bytes)}{stage} = "
                f"{_size(self.total_bytes)} (activations excluded)"
            )
        return (
            f"{self.params:,} parameters per rank ({self.per_parameter()}); estimated memory per rank: "
            f"params {size(self.param_bytes)} + grads {size(self.grad_bytes)} + optimizer "
            f"{size(self.optimizer_bytes)}{stage} = {size(self.total_bytes)} (activations excluded)"
        )


def local_numel(shape: torch.Size | tuple[int, ...], shards: int, shard_rank: int = 0) -> int:
    """Elements of `shard_rank`'s FSDP shard: dim 0 is cut into ceil(d0 / shards) rows per rank."""
    if len(shape) == 0:
        return 1
    rows = math.ceil(shape[0] / shards)
    local_rows = max(0, min(rows, shape[0] - shard_rank * rows))
    return local_rows * math.prod(shape[1:])


_MODEL_PARALLEL_DIMS = ("tp", "ep", *EP_TP_DIMS)
"""Mesh dimensions that split a parameter for compute (FSDP's all-gather stops at them)."""


def _model_parallel_shape(p: torch.Tensor) -> tuple[int, ...]:
    """Global shape with the tensor- and expert-parallel dimensions cut to rank 0's share (ceil)."""
    shape = list(p.shape)
    names = (p.device_mesh.mesh_dim_names or ()) if isinstance(p, DTensor) else ()
    for i, name in enumerate(names):
        placement = p.placements[i]
        if name in _MODEL_PARALLEL_DIMS and isinstance(placement, Shard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(i))
    return tuple(shape)


def _sharded_numel(p: DTensor) -> int:
    """Elements of the coordinate-0 shard of a DTensor (the largest: torch.chunk's first part),
    every mesh dimension's `Shard(dim)` cutting its dimension in turn."""
    shape = list(p.shape)
    for i, placement in enumerate(p.placements):
        # _StridedShard (FSDP over a TP shard) is no Shard subclass in torch 2.13: the same share.
        if isinstance(placement, Shard | _StridedShard):
            shape[placement.dim] = math.ceil(shape[placement.dim] / p.device_mesh.size(i))
    return math.prod(shape)


def _has_fsdp_dim(p: DTensor) -> bool:
    """Whether FSDP shards `p` on some mesh dimension (one that is not tp / ep's)."""
    names = p.device_mesh.mesh_dim_names or ()
    return any(i >= len(names) or names[i] not in _MODEL_PARALLEL_DIMS for i in range(p.device_mesh.ndim))


def estimate_memory_per_rank(
    model: nn.Module,
    parallel_dims: ParallelDims,
    optimizer: str = "adamw",
    precision: Precision | torch.dtype = torch.float32,
    muon_params: Collection[str] = (),
    expert_params: Collection[str] = (),
    resident: Mapping[str, Format] | None = None,
) -> MemoryEstimate:
    """Parameter, gradient and optimizer-state bytes on the most loaded rank (fsdp rank 0).

    Works on a full, a sharded (DTensor shapes are global) or a meta model. Master weights,
    gradients and optimizer state (of the trainable parameters only) are in the master dtype (`precision`, or one dtype for all);
    AdamW keeps two states per parameter, Muon one for the parameters named in `muon_params`
    (AdamW for the rest). Under pipeline parallelism pass one stage's module: FSDP then also
    keeps the stage's parameters gathered (compute dtype) and their gradients accumulated
    unsharded (reduction dtype) between microbatches. On a model not yet expert-parallel, the
    `expert_params` (routed experts) are each held by 1 / ep of the ranks. A tensor-parallel shard
    counts its share of the tp-split dimension; activations are excluded. The frozen base kept as
    released (a built model's `PackedWeight`s, or the parameters `resident` names on a meta one) counts
    at its stored bytes (`resident_boxes`), outside the parameters and every FSDP figure.
    """
    if optimizer not in ("adamw", "muon"):
        raise ValueError(f"estimate_memory_per_rank: optimizer {optimizer!r}, expected adamw or muon")
    if isinstance(precision, torch.dtype):  # one dtype for everything: a pure run
        master = compute = reduce = precision
    else:
        master, compute, reduce = precision.master, precision.compute, precision.reduce
    d = parallel_dims
    shards = d.fsdp_degree if d.fsdp_enabled else 1
    params = trained = states = stage = stage_trained = 0
    boxes = resident_boxes(model, d, resident, expert_params)
    for name, p in model.named_parameters():
        if canonical_name(name) in boxes:  # not in FSDP: counted at its stored bytes
            continue
        if isinstance(p, DTensor):
            # A sharded parameter's own placements (expert-parallel experts: ep x efsdp); what FSDP
            # gathers for a pipeline stage is its tp / ep share.
            n = _sharded_numel(p)
            unsharded = math.prod(_model_parallel_shape(p)) if _has_fsdp_dim(p) else 0
        else:
            # An unsharded one as FSDP will cut it, on dim 0 over fsdp; ep x efsdp = dp x cp: an
            # expert's shard is as large as a dense one, its full copy 1 / ep.
            expert = d.ep_enabled and name in expert_params
            n = local_numel(p.shape, shards)
            sharded_by_fsdp = d.fsdp_enabled or compute != master or expert
            unsharded = p.numel() // (d.ep if expert else 1) if sharded_by_fsdp else 0
        params += n
        stage += unsharded if d.pp_enabled else 0
        if p.requires_grad:  # a frozen parameter (a LoRA run's base) has no gradient, no state
            trained += n
            states += n * (1 if optimizer == "muon" and name in muon_params else 2)
            stage_trained += unsharded if d.pp_enabled else 0
    return MemoryEstimate(
        params,
        params * master.itemsize,
        trained * master.itemsize,
        states * master.itemsize,
        stage,
        stage * compute.itemsize,
        stage_trained * reduce.itemsize,
        trained,
        resident_bytes(boxes),
    )
