"""Each rank's memory, decided once at start-up: `plan_memory(run) -> MemoryPlan`.

    plan = plan_memory(run)  # the resolved run (titan_thd/run.py)
    plan.ranks[r]            # pipeline rank r's figures (one entry without pipeline parallelism)
    plan.host_bytes(4)       # what 4 ranks on one host need at once (the host-memory refusal)

A pure function of resolved values: it builds the model on the meta device (no memory, any size)
and, for the activations, measures one microbatch on a model of its own (memory/activations.py);
no process group, no built model. Per pipeline rank (docs/design.md §5.3, §5.6):
- the sharded state: parameters, gradients and optimizer state in the master dtype (memory/state.py);
- under pipeline parallelism the unsharded stage copy FSDP keeps between microbatches;
- the activations in flight: the schedule's microbatches in flight x the saved bytes of one;
- the backward transient: one block's recomputation, or the loss gradient (loss.chunked: one chunk's)
  on the last stage;
- the start-up peak (`startup_peak_bytes`) and the largest FSDP unit (one all-gather);
- activation_checkpoint.offload: the recomputed blocks' inputs in host memory, per rank and per node
  (`node_host`; the refusal: memory/host.py).
Counted before tensor parallelism's split (the meta model is not tensor-parallel): under tp > 1 the
figures are upper bounds, and the lines say so.

A LoRA run whose frozen base stays as released (`run.resident`, models/packed_weight.py) counts that base at
its stored bytes per rank (codes + scales of the boxes TP / EP give it; FSDP and CP replicate it), and
its transients: the dequantisation of one matrix (`Format.dense_bytes`, models/hf/quant.py: its codes looked up and scaled,
in the compute dtype) and the largest FSDP all-gather, both in the rank's total;
its `parts_lines` list every part.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Collection

import torch
from torch import nn

from titan_thd.components.chunked_loss import loss_chunk
from titan_thd.components.optimizer import default_matrix_params
from titan_thd.components.precision import Precision
from titan_thd.memory import activations
from titan_thd.memory.live import available_host_bytes
from titan_thd.memory.state import (
    MemoryEstimate,
    estimate_memory_per_rank,
    local_numel,
    resident_boxes,
    size,
)
from titan_thd.models.hf.quant import Format
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.seeded_init import BLOCK_BYTES
from titan_thd.parallel.shards import canonical_name
from titan_thd.pipeline.schedule import max_in_flight
from titan_thd.pipeline.split import rank_part
from titan_thd.run import Run


def startup_peak_bytes(
    shard_params: int, master: torch.dtype, largest_tensor: int, largest_slice_bytes: int
) -> int:
    """The most one rank holds while the model is built: the model is built on the meta device, and
    each rank allocates only its own shards (master dtype) and fills them one block of rows at a time
    (parallel/seeded_init.py: at most `BLOCK_BYTES`, at most the largest tensor, `largest_tensor`
    elements); reading model.hf_path adds one tensor's slice in flight (`largest_slice_bytes`: its
    read bytes and its float32 dequantised copy, 0 without a checkpoint). Parameters only (buffers are
    small); the optimizer state comes at the first step."""
    block = min(BLOCK_BYTES, largest_tensor * master.itemsize)
    return shard_params * master.itemsize + block + largest_slice_bytes


def dequant_transient(
    boxes: dict[str, tuple[Format, tuple[int, ...]]], compute: torch.dtype
) -> tuple[int, str]:
    """(bytes, `key [rows, cols] in <dtype>`) of the largest dequantisation of a base kept as released
    (`Format.dense_bytes`): one use is one 2-D weight, or one expert's matrix of a stack ([E, O, I]:
    `base_grouped` dequantises expert by expert); (0, "") without such a base."""
    if not boxes:
        return 0, ""
    key, (fmt, shape) = max(boxes.items(), key=lambda kv: kv[1][0].dense_bytes(kv[1][1], compute))
    dtype = str(compute).removeprefix("torch.")
    return fmt.dense_bytes(shape, compute), f"{key} {list(shape[-2:])} in {dtype}"


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One pipeline rank's figures (every rank of that pipeline rank holds the same)."""

    rank: int
    """Pipeline rank (0 without pipeline parallelism)."""
    layers: str
    """Its stages' layers, e.g. `0-3, 8-11`."""
    params: int
    """Parameters of its part of the model, unsharded."""
    state: MemoryEstimate
    """Sharded state (params + grads + optimizer) and the unsharded stage copy (memory/state.py)."""
    in_flight: int | None
    """Most microbatches whose saved activations it keeps at once; None under GPipe (all K of a
    step: known per step only; the totals count one, a lower bound)."""
    saved_bytes: float | None
    """Saved activations of one microbatch of its largest chunk; None: not measured (a model too
    large to measure outside a dry run; the totals count none)."""
    backward_bytes: float
    """The backward's largest transient: one block's recomputation, or the loss gradient."""
    largest_unit_bytes: int
    """Its largest FSDP unit's full parameters in the dtype they are gathered in (one all-gather)."""
    startup_bytes: int
    """Peak while the model is built (`startup_peak_bytes`)."""
    dequant_bytes: int = 0
    """A base kept as released: its largest dequantisation (`dequant_transient`); 0 otherwise."""
    dequant_of: str = ""
    """The matrix it dequantises, `key [rows, cols] in <compute dtype>` (`dequant_transient`)."""
    gather_bytes: int = 0
    """A base kept as released: the largest FSDP all-gather, held with the dequantisation inside a
    block (0 without FSDP, where nothing is gathered, and in every other run: those plans count no
    all-gather, as before)."""
    offloaded_bytes: float = 0.0
    """activation_checkpoint.offload: the recomputed blocks' inputs in host memory, every microbatch
    in flight (not in the device figures above); 0 otherwise."""

    @property
    def state_bytes(self) -> int:
        """Sharded parameters, gradients and optimizer state (master dtype)."""
        return self.state.param_bytes + self.state.grad_bytes + self.state.optimizer_bytes

    @property
    def stage_copy_bytes(self) -> int:
        """What FSDP keeps unsharded for the stage between microbatches (0 without pipeline parallelism)."""
        return self.state.stage_param_bytes + self.state.stage_grad_bytes

    @property
    def activation_bytes(self) -> float:
        """Activations in flight plus the backward transient."""
        return (self.in_flight or 1) * (self.saved_bytes or 0.0) + self.backward_bytes

    @property
    def transient_bytes(self) -> int:
        """A base kept as released: its dequantisation and one FSDP all-gather; 0 otherwise."""
        return self.dequant_bytes + self.gather_bytes

    @property
    def steady_bytes(self) -> float:
        """During training: state, stage copy, activations (and a resident base's transient)."""
        return self.state.total_bytes + self.activation_bytes + self.transient_bytes

    @property
    def total_bytes(self) -> float:
        """The rank's peak: the larger of start-up and training."""
        return max(self.startup_bytes, self.steady_bytes)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Every pipeline rank's memory (`ranks`), and where the ranks sit (mesh axes, pp outermost)."""

    ranks: tuple[RankMemory, ...]
    world_size: int
    tokens: int
    """Tokens of one microbatch per context-parallel rank (what the activations were measured at)."""
    tp: int
    """Tensor-parallel degree (the figures are counted before its split)."""
    schedule: str | None
    """The pipeline schedule (None without pipeline parallelism)."""
    boundary: tuple[int, ...] | None
    """Shape of one microbatch's stage-boundary input (None without pipeline parallelism)."""
    boundary_bytes: float
    acts: activations.ActivationMemory | None
    node: tuple[int, float, str] = (1, 0.0, "")
    """(ranks per node, a node's host bytes, where that figure comes from): `node_host`."""

    @property
    def per_rank_total(self) -> float:
        """The largest pipeline rank's peak."""
        return max(r.total_bytes for r in self.ranks)

    def host_ranks(self, local_ranks: int) -> list[tuple[int, int]]:
        """(pipeline rank, how many of its ranks) on the fullest host of `local_ranks` consecutive
        global ranks (pp is the outermost mesh axis: global rank g is pipeline rank g // (world / pp))."""
        per_pp = max(1, self.world_size // len(self.ranks))
        hosts = [
            range(h * local_ranks, (h + 1) * local_ranks)
            for h in range(max(1, self.world_size // local_ranks))
        ]

        def counts(host: range) -> list[tuple[int, int]]:
            pps = [(g // per_pp) % len(self.ranks) for g in host]
            return [(r, pps.count(r)) for r in sorted(set(pps))]

        return max((counts(h) for h in hosts), key=lambda c: sum(n * self.ranks[r].total_bytes for r, n in c))

    def host_bytes(self, local_ranks: int) -> float:
        """What the fullest host needs at once: its ranks' peaks (start-up included) summed, with
        what offload keeps in host memory (on a CPU the device is the host)."""
        return sum(
            n * (self.ranks[r].total_bytes + self.ranks[r].offloaded_bytes)
            for r, n in self.host_ranks(local_ranks)
        )

    def offloaded_node_bytes(self, ranks_per_node: int) -> float:
        """activation_checkpoint.offload: what the fullest node's ranks keep in its host memory."""
        return sum(n * self.ranks[r].offloaded_bytes for r, n in self.host_ranks(ranks_per_node))

    def offload_line(self) -> str:
        """The host-memory line of activation_checkpoint.offload ("" without it): per rank and per node."""
        if not any(r.offloaded_bytes for r in self.ranks):
            return ""
        ranks_per_node, node_bytes, source = self.node
        r = max(self.ranks, key=lambda r: r.offloaded_bytes)
        n = "K" if r.in_flight is None else str(r.in_flight)
        per_mb = r.offloaded_bytes / (r.in_flight or 1)
        return (
            f"host memory (activation_checkpoint.offload, not in the device figures): the recomputed "
            f"blocks' inputs, per rank <= {n} x {size(per_mb)} = {size(r.offloaded_bytes)}; per node of "
            f"{ranks_per_node} ranks {size(self.offloaded_node_bytes(ranks_per_node))} of its "
            f"{size(node_bytes)} ({source})"
        )

    def state_line(self) -> str:
        """The header's parameter-memory line (pipeline rank 0's; every rank's under `stage_lines`)."""
        return str(self.ranks[0].state) + self._tp_note()

    def stage_lines(self) -> list[str]:
        """The header's activation lines: one per pipeline rank, or the one stage's."""
        if self.schedule is None:
            r, acts = self.ranks[0], self.acts
            if acts is None:
                return [*self.parts_lines(), self.startup_line()]
            other = r.state.total_bytes + r.transient_bytes
            summary = (
                activations.summary(
                    acts, self.tokens, other, "the state, the base as released and its transients"
                )
                if r.transient_bytes
                else activations.summary(acts, self.tokens, other)
            )
            return [summary, *self._offload_lines(), *self.parts_lines(), self.startup_line()]
        mib = self.boundary_bytes / 2**20
        lines = []
        for r in self.ranks:
            n = "K" if r.in_flight is None else str(r.in_flight)
            flight = f"<= {n} x {mib:.2f} MiB" + ("" if n == "K" else f" = {int(n) * mib:.2f} MiB")
            line = (
                f"pp rank {r.rank}: layers {r.layers}, {r.params:,} parameters; {r.state}{self._tp_note()}; "
                f"in-flight microbatch inputs {flight} (boundary {list(self.boundary or ())}, {self.schedule})"
            )
            lines.append(line + ("; " + _saved(r) if r.saved_bytes is not None else ""))
        return [*lines, *self._offload_lines(), *self.parts_lines(), self.startup_line()]

    def activation_lines(self) -> list[str]:
        """The lines of activations measured after the header (a dry run, memory/dry_run.py): the one
        stage's, or each pipeline rank's saved activations, and the peaks."""
        if self.schedule is None:
            return self.stage_lines()
        saved = [f"pp rank {r.rank}: {_saved(r)}" for r in self.ranks if r.saved_bytes is not None]
        return [*saved, *self._offload_lines(), *self.parts_lines(), self.startup_line()]

    def parts_lines(self) -> list[str]:
        """A base kept as released: one line per pipeline rank with every part of its peak (every rank
        of that pipeline rank holds the same, fsdp rank 0 the most); [] otherwise."""
        if not any(r.state.resident.values for r in self.ranks):
            return []
        lines = []
        for r in self.ranks:
            st, n = r.state, self.world_size // len(self.ranks)
            base = st.param_bytes * st.frozen_params // max(1, st.params)
            stage = f" + stage copy {size(r.stage_copy_bytes)}" if r.stage_copy_bytes else ""
            saved = "not measured" if r.saved_bytes is None else size(r.activation_bytes - r.backward_bytes)
            flight = "" if r.in_flight in (None, 1) else f"{r.in_flight} microbatches "
            lines.append(
                f"pp rank {r.rank} (each of its {n} ranks): base codes {size(st.resident.codes)} + scales "
                f"{size(st.resident.scales)} + other frozen base {size(base)} + adapters "
                f"{size(st.param_bytes - base)} + their grads {size(st.grad_bytes)} + their optimizer state "
                f"{size(st.optimizer_bytes)}{stage} + saved activations {flight}{saved} + backward transient "
                f"{size(r.backward_bytes)} + dequantisation {size(r.dequant_bytes)} (of {r.dequant_of}) + "
                f"largest FSDP all-gather {size(r.gather_bytes)} = {size(r.steady_bytes)}" + self._tp_note()
            )
        return lines

    def startup_line(self) -> str:
        r = max(self.ranks, key=lambda r: r.startup_bytes)
        return (
            f"start-up peak per rank {size(r.startup_bytes)} (its shards, built on the meta device and "
            f"filled block by block); peak per rank max(start-up, training) {size(self.per_rank_total)}"
            + (" (activations not included)" if self.acts is None else "")
        )

    def _offload_lines(self) -> list[str]:
        return [line] if (line := self.offload_line()) else []

    def _tp_note(self) -> str:
        return f" (before the tp {self.tp} split)" if self.tp > 1 else ""


def _saved(r: RankMemory) -> str:
    """A pipeline rank's activations in flight, its backward transient and its total."""
    n = "K" if r.in_flight is None else str(r.in_flight)
    line = f"saved activations <= {n} x {size(r.saved_bytes or 0.0)}"
    if r.backward_bytes:
        line += f" + backward transient {size(r.backward_bytes)}"
    if r.in_flight is not None:
        line += f" = {size(r.activation_bytes)}; total {size(r.steady_bytes)}"
    return line


def plan_memory(run: Run, measure: bool = True) -> MemoryPlan:
    """Every pipeline rank's `RankMemory` (one without pipeline parallelism) for the run's model, layout
    (`run.stages`: each stage's layer ids, None at pp 1), dtypes and optimizer (Muon's parameters:
    `spec.matrix_params`); its activations measured on one microbatch of `run.tokens_per_rank` tokens
    under activation_checkpoint (in a dry run a model too large to measure whole is measured on narrowed
    copies: minutes of CPU); with model.hf_path (read at start-up unless a dry run), one tensor's slice
    in flight (`startup_peak_bytes`). A function of the run alone: called once, by the ranks that
    print or check it. `measure` False: the state alone, in a fraction of a second (a dry run prints
    its header before it measures the activations: memory/dry_run.py)."""
    spec, model_args, dims, stages, precision = run.spec, run.model_args, run.dims, run.stages, run.precision
    schedule, optimizer = run.cfg.parallelism.pipeline_parallel_schedule, run.cfg.optimizer.name
    matrix_params = spec.matrix_params or default_matrix_params
    loads_checkpoint = bool(run.cfg.model.hf_path) and not run.fake
    tokens, ac = run.tokens_per_rank, run.cfg.activation_checkpoint
    acts = (
        activations.activation_memory(
            spec, model_args, tokens, precision.compute, ac, run.fake, run.lora, loss_chunk(run.cfg.loss)
        )
        if measure
        else None
    )
    full = run.meta_model  # with its LoRA adapters: the frozen base has no grads, no state
    if full is None:
        with torch.device("meta"):
            full = run.build_model()
    layers = stages if stages is not None else [[int(k) for k in full.layers]]
    pp = len(layers) if stages is None else dims.pp
    boundary = None
    if stages is not None:
        assert spec.pipeline is not None  # validate_pipeline refused pp > 1 without a stage split
        # Under tensor parallelism the boundary carries this tp rank's sequence-parallel rows.
        boundary = tuple(spec.pipeline.boundary_shape(model_args, tokens // dims.tp))
    tied = spec.pipeline.tied(full) if stages is not None and spec.pipeline is not None else ()
    shards = dims.fsdp_degree if dims.fsdp_enabled else 1
    ranks = []
    for rank in range(pp):
        part = full if stages is None else rank_part(spec.pipeline, full, layers, rank, pp, tied)
        muon = matrix_params(part) if optimizer == "muon" else ()
        experts = spec.parallel.expert_params(part)
        state = estimate_memory_per_rank(part, dims, optimizer, precision, muon, experts, run.resident)
        boxes = resident_boxes(part, dims, run.resident, experts)
        dequant, dequant_of = dequant_transient(boxes, precision.compute)
        # What FSDP shards, the seeded init fills and the load dequantises: the base kept as
        # released is none of these (its codes are read as stored).
        sharded = [p for n, p in part.named_parameters() if canonical_name(n) not in boxes]
        unit = largest_unit_bytes(part, dims, precision, experts, set(boxes))
        gathers = bool(boxes) and (dims.fsdp_enabled or precision.mixed)  # else no copy is gathered
        chunks = range(rank, len(layers), pp)
        in_flight: int | None = 1
        if stages is not None:
            virtual = len(layers) // pp
            k = 4 * pp * virtual  # beyond this K the 1F1B-type schedules keep no more in flight
            in_flight = None if schedule == "GPipe" else max_in_flight(schedule, pp, virtual, rank, k)
        saved, back, offloaded = None, 0.0, 0.0
        if acts is not None:  # the rank's largest chunk, once per in-flight (chunk, microbatch)
            per_chunk = [
                acts.stage([str(i) for i in layers[s]], s == 0, s == len(layers) - 1) for s in chunks
            ]
            saved, back = max(c for c, _ in per_chunk), max(b for _, b in per_chunk)
            # offload: every chunk's blocks of every microbatch in flight wait in host memory
            host = max(acts.host([str(i) for i in layers[s]], s == len(layers) - 1) for s in chunks)
            offloaded = (in_flight or 1) * host
        ranks.append(
            RankMemory(
                rank=rank,
                layers=", ".join(f"{layers[s][0]}-{layers[s][-1]}" for s in chunks),
                params=sum(p.numel() for p in part.parameters()),
                state=state,
                in_flight=in_flight,
                saved_bytes=saved,
                backward_bytes=back,
                largest_unit_bytes=unit,
                startup_bytes=startup_peak_bytes(
                    state.params,
                    precision.master,
                    max(p.numel() for p in sharded),
                    # the largest FSDP shard of one tensor, read and dequantised to float32
                    2 * 4 * max(local_numel(p.shape, shards) for p in sharded) if loads_checkpoint else 0,
                )
                # the base kept as released, read whole before the first step; its largest box read
                # in flight (a stack of experts is read expert by expert, then stacked)
                + state.resident.total
                + (
                    max((f.stored_bytes(shape) for f, shape in boxes.values()), default=0)
                    if loads_checkpoint
                    else 0
                ),
                dequant_bytes=dequant,
                dequant_of=dequant_of,
                gather_bytes=unit if gathers else 0,
                offloaded_bytes=offloaded,
            )
        )
    return MemoryPlan(
        node=node_host(run),
        ranks=tuple(ranks),
        world_size=dims.world_size,
        tokens=tokens,
        tp=dims.tp,
        schedule=schedule if stages is not None else None,
        boundary=boundary,
        boundary_bytes=math.prod(boundary) * precision.compute.itemsize if boundary else 0.0,
        acts=acts,
    )


def largest_unit_bytes(
    part: nn.Module,
    dims: ParallelDims,
    precision: Precision,
    experts: Collection[str],
    resident: Collection[str] = (),
) -> int:
    """The largest FSDP unit of a rank's (unsharded, meta) part as the model's `parallelize` cuts it:
    each block of `part.layers`, under expert parallelism its routed experts apart (1 / ep of them
    gathered), and the root (the rest), gathered in the compute dtype; without FSDP (one rank, no
    mixed precision: parallel/fsdp.py fsdp_mesh) the whole part is one. An upper bound: the small
    master-dtype units inside a block (dsv4's mHC) are counted in it. The keys in `resident` (a base
    kept as released: FSDP ignores it) are in no unit."""
    params = [(n, p) for n, p in part.named_parameters() if canonical_name(n) not in resident]
    if not (dims.fsdp_enabled or precision.mixed):
        return sum(p.numel() * precision.master.itemsize for _, p in params)
    expert_names = set(experts) if dims.ep_enabled else set()
    units: dict[str, int] = {}
    for name, p in params:
        top, _, rest = name.partition(".")
        unit = f"layers.{rest.partition('.')[0]}" if top == "layers" else ""
        if name in expert_names:
            units[unit + " experts"] = units.get(unit + " experts", 0) + p.numel() // dims.ep
        else:
            units[unit] = units.get(unit, 0) + p.numel()
    return max(units.values(), default=0) * precision.compute.itemsize


def node_host(run: Run) -> tuple[int, float, str]:
    """(ranks per node, a node's host memory in bytes, its source): memory.ranks_per_node or
    LOCAL_WORLD_SIZE (a dry run: min(world, 8)); memory.host_gib or this machine's available memory."""
    m = run.cfg.memory
    local = os.environ.get("LOCAL_WORLD_SIZE")
    ranks = m.ranks_per_node or (int(local) if local and not run.fake else min(run.dims.world_size, 8))
    if m.host_gib:
        return ranks, m.host_gib * 2**30, "memory.host_gib"
    return ranks, float(available_host_bytes()), "this machine's available memory"
