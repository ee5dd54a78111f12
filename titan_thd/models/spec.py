"""ModelSpec: what the trainer needs to know about a model family, in one small record.

Every model family (`titan_thd/models/<name>/__init__.py`) exposes `spec = ModelSpec(...)`; the
trainer looks it up by `model.name` through `titan_thd.models.get_model_spec`.

Model contract (docs/design.md §3.4):
    model = spec.build(args)            # full weights on CPU, initialised from the current RNG state
    out = model(tokens_T, meta)         # tokens: [T_local] int64, meta: BatchMeta
    out.logits                          # [T_local, V] float
    out.aux_losses                      # {"name": scalar} SUMS over this rank's rows, coefficients
                                        # already applied; the trainer divides them, like the main
                                        # cross-entropy sum, by the global trained-token count.
Initialisation is a function of the seed only (never of the parallel layout): the trainer builds
the model on the meta device, shards it, allocates this rank's shards and calls
`model.init_weights(seed, skip)` (parallel/seeded_init.py), which fills them block by block, all but the
tensors in `skip` (those a Hugging Face folder read next provides).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.distributed import ProcessGroup

from titan_thd.models.decoding import Decoder
from titan_thd.models.hf.adapter import HFAdapter
from titan_thd.models.projection import LoRATargets
from titan_thd.parallel.context_parallel import CPMode


class ModelOutput(NamedTuple):
    logits: torch.Tensor
    """[T_local, V] logits of this rank's rows."""
    aux_losses: dict[str, torch.Tensor]
    """Extra loss terms as sums over this rank's rows (coefficients applied)."""


@dataclass(frozen=True)
class PipelineSpec:
    """How a model is cut into pipeline stages (titan_thd/pipeline/split.py). The model keeps its
    transformer blocks in an `nn.ModuleDict` named `layers` (keys "0", "1", ...); a stage runs
    consecutive blocks, and the top-level modules named here sit on the first / last stage only."""

    first: tuple[str, ...]
    """Top-level modules of the first stage only (the embedding)."""
    last: tuple[str, ...]
    """Top-level modules of the last stage only (final norm, LM head, MTP)."""
    boundary_shape: Callable[[Any, int], tuple[int, ...]]
    """(args, local rows) -> shape of the tensor one stage sends the next (the residual stream)."""
    tied: Callable[[nn.Module], tuple[str, ...]] = field(default=lambda model: ())
    """full model -> modules of `first` that the last stage runs too (dsv4's MTP reads the embedding):
    both ends hold a copy, whose gradients are summed."""


@dataclass(frozen=True)
class ParallelSpec:
    """What the parallel layouts need to know about a model (startup.resolve_run checks a layout
    against it before any process group exists; titan_thd/parallel/)."""

    cp_mode: CPMode
    """The context-parallel split the model computes exactly (parallelism.context_parallel_mode = auto
    follows it; another mode is refused): see titan_thd/parallel/context_parallel.py."""
    min_tokens_per_cp_rank: Callable[[Any], int] = field(default=lambda args: 1)
    """args -> smallest local shard (T / cp) the model supports, e.g. its CP halo width."""
    tp_divides: Callable[[Any], dict[str, int]] = field(default=lambda args: {})
    """args -> {size name: size} that parallelism.tensor_parallel_degree must divide (heads, groups)."""
    expert_params: Callable[[nn.Module], list[str]] = field(default=lambda model: [])
    """model -> names of the parameters expert parallelism places (each on 1 / ep of the ranks): the
    memory estimate of a model not yet split (the pipeline stage lines) counts their unsharded copies."""
    routed_experts: Callable[[Any], int] = field(default=lambda args: 0)
    """args -> how many routed experts expert parallelism splits over its ranks (0 = none:
    parallelism.expert_parallel_degree > 1 is refused)."""
    te_attention: Callable[[Any], bool] = field(default=lambda args: False)
    """args -> whether attention runs in Transformer Engine, which runs without context parallelism
    only (context_parallel_degree > 1 is refused)."""


@dataclass(frozen=True)
class CompileSpec:
    """training.compile for a model: regional torch.compile of its element-wise chains."""

    apply: Callable[[nn.Module], None]
    """(model chunk) -> None: compiles the model's regions in place (titan_thd/models/compile.py);
    the family's `parallelize` calls it (before FSDP) when training.compile is on."""
    payback_steps: int = 0
    """training.compile = auto compiles (on a CPU with a C++ compiler) from this many training.steps on:
    the first step's compile time over the steady saving per step measured for this model (0 = never:
    not measured faster)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    flavors: dict[str, Any]
    """flavor name -> model args dataclass (must have `vocab_size`)."""
    build: Callable[[Any], nn.Module]
    """args -> model with initialised full weights (call under a seeded RNG); the model keeps the
    args as `model.args`."""
    flops_per_step: Callable[[Any, Sequence[int]], float]
    """(args, real document lengths of a step) -> forward+backward FLOPs of those documents."""
    parallel: ParallelSpec
    """What the parallel layouts need to know: the CP split, TP divisors, expert parameters."""
    default_flavor: str = ""
    """The flavor of an empty `model.flavor` without a checkpoint to read the architecture from
    ("" = the first of `flavors`)."""
    parallelize: Callable[..., nn.Module] | None = None
    """(model chunk, dims, *, compile, ac, precision) -> model: the model's fixed sequence `apply_tp`,
    `apply_ep`, `apply_compile` (when `compile`: training.compile as start-up resolved it),
    `apply_ac` (`ac`: the run's activation_checkpoint section), `apply_fsdp` on one pipeline chunk (or
    the whole model), `dims` the run's ParallelDims; CP needs no wrapping (the layers read
    BatchMeta.cp). `precision` (components/precision.py) is the run's resolved dtypes: under mixed
    precision FSDP applies on every layout. None = one process only."""
    ac_regions: Mapping[str, str] = field(default_factory=dict)
    """Region name -> what it recomputes, for activation_checkpoint.mode = selective (the model's
    `apply_ac` wraps them); empty = only mode = full (docs/design.md §5.5)."""
    pipeline: PipelineSpec | None = None
    """How the model splits into pipeline stages; None = parallelism.pipeline_parallel_degree > 1 is
    refused."""
    matrix_params: Callable[[nn.Module], list[str]] | None = None
    """model -> names of the parameters that Muon updates (the rest go to AdamW); None = every 2-D
    weight except embeddings and the LM head."""
    # Optional trainer hooks: typed fields, so a misspelt hook is a TypeError when the spec is built.
    hf: HFAdapter | None = None
    """The family's Hugging Face format (models/hf/adapter.py): tensor names and config.json both ways,
    transformers' module names. models/hf/ loads (`model.hf_path`, scripts/convert_hf.py to-dcp) and
    exports (to-hf) through it. None = no Hugging Face folder is read or written."""
    padded_forward: Callable[[nn.Module, torch.Tensor, list[int]], torch.Tensor] | None = None
    """(model, tokens_BS, lengths_B) -> logits_BSV of a padded batch: row b holds one document in its
    first lengths_B[b] columns, the rest is padding (its logits are ignored). A code path of its own,
    not the packed call (validation.compare_padded compares the two); None = that switch is refused."""
    decoder: Callable[[nn.Module, torch.device], Decoder] | None = None
    """(whole model in eval mode, device) -> its cached decoder (models/decoding.py `Decoder`: a
    packed prefill that fills per-layer caches, then one row per sequence per step), for
    inference/generate.py; None = generation recomputes the model's packed forward over every whole
    sequence at each step (`RecomputeDecoder`: O(length) per token, nothing needed beyond the
    training forward), and `--decoder cache` is refused."""
    narrow: Callable[[Any, int], tuple[Any, list[int]]] | None = None
    """(args, f) -> (args with every width / f and one layer per kind, the narrowed model's layer
    for every layer of args); ValueError when a width does not divide. Lets the activation memory of a
    model too large to build here be measured (memory/activations.py); None = always measured whole."""
    after_optimizer_step: Callable[[nn.Module, ProcessGroup | None], None] | None = None
    """(model, loss_group) -> None after every optimizer step; loss_group is the dp x cp group that
    sums the step's token losses (None on one rank), e.g. dsv4's router-bias update."""
    compile: CompileSpec | None = None
    """training.compile's regional compile and when `auto` turns it on; None = training.compile = true
    is refused at start-up."""
    lora: LoRATargets | None = None
    """The projections `[lora]` may adapt, by exact path inside a block, and their groups
    (models/projection.py: each a projection; lora/targets.py resolves them); None = lora.enable =
    true is refused."""


def build_initialised(make: Callable[[], nn.Module]) -> nn.Module:
    """`make()` with weights drawn by its `init_weights()` from the current RNG, on CPU.

    The module is constructed on the meta device first, so no throw-away default initialisation
    runs. Under `with torch.device("meta")` (fake-process-group dry runs) it stays on meta: shapes
    only, initialised later shard by shard.
    """
    on_meta = torch.get_default_device().type == "meta"
    with torch.device("meta"):
        model = make()
    if not on_meta:
        model.to_empty(device="cpu")
        model.init_weights()
    return model


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def as_dtype(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}[name]
