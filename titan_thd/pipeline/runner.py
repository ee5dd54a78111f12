"""The front door of the model's execution: one `build` for every layout, one runner interface.

    parts = build(model, run, device, init)                      # run: titan_thd/run.py
    ce_sum, aux_sums = parts.runner.step(inputs, num_trained)   # forward + backward of a step
    ce_sum = parts.runner.forward_only(inputs)                   # validation
    clip_grad_norm_(parts.runner.norm_params(), ..., pp_group=parts.runner.pp_group,
                    also_scale=parts.runner.also_scale)

`build` cuts the model into this rank's pipeline stages when `run.stages` is given (split.py; the model's
`PipelineSpec` says what sits where), runs the model's `parallelize` on each chunk (TP, EP, compile,
activation recomputation, FSDP: its own fixed sequence; so `activation_checkpoint.layers` counts the
blocks of each stage) and returns the rank's module (which owns the parameters: optimizer,
checkpoint) with a runner: the `PipelineSchedule` (schedule.py), or without pipeline parallelism a
`LocalRunner` with the same three methods, so that the trainer and validation have one code path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from titan_thd.components.chunked_loss import loss_chunk
from titan_thd.components.loss import cross_entropy_sum, loss_context
from titan_thd.components.progress import Progress
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.models import packed_weight
from titan_thd.models.spec import count_params
from titan_thd.parallel.tensor_parallel import reduce_replicated_grads
from titan_thd.pipeline.schedule import PipelineSchedule, StageInput, tied_groups
from titan_thd.pipeline.split import chunk_views, split_model
from titan_thd.run import Run


class LocalRunner:
    """The model of a rank without pipeline parallelism, behind the schedule's interface."""

    pp_group = None
    """No other pipeline stages to add gradient norms from."""
    also_scale: tuple[nn.Parameter, ...] = ()
    """No stage copies of tied weights to clip without counting them."""

    def __init__(self, model: nn.Module, tensor_parallel: bool, device: torch.device, loss_chunk: int = 0):
        self.model, self.tensor_parallel, self.device = model, tensor_parallel, device
        self.loss_kwargs = {"loss_chunk": loss_chunk} if loss_chunk else {}
        """loss.chunked: the loss's rows per chunk, passed to the model (none: the full logits; a model
        family without chunked heads is never passed it)."""

    def step(
        self, inputs: Sequence[StageInput], num_trained: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of every microbatch, one after the other; each backpropagates
        (CE sum + aux sums) / num_trained. Returns this rank's CE sum and aux sums (detached)."""
        ce_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        aux_sums: dict[str, torch.Tensor] = {}
        for inp in inputs:
            with loss_context(self.tensor_parallel):  # must cover the backward too
                out = self.model(inp.tokens, inp.meta, **self.loss_kwargs)
                ce = cross_entropy_sum(out.logits, inp.labels, inp.loss_mask)
                aux = sum(out.aux_losses.values(), torch.zeros((), device=ce.device))
                ((ce + aux) / num_trained).backward()
            ce_sum += ce.detach()
            for k, v in out.aux_losses.items():
                aux_sums[k] = aux_sums.get(k, 0) + v.detach().double()
        reduce_replicated_grads(self.model)  # TP: parameters used on each rank's rows / heads
        return ce_sum, aux_sums

    @torch.no_grad()
    def forward_only(self, inputs: Sequence[StageInput]) -> torch.Tensor:
        """The CE sum of this rank's rows of the microbatches (no backward: validation)."""
        ce = torch.zeros((), dtype=torch.float64, device=self.device)
        for inp in inputs:
            with loss_context(self.tensor_parallel):
                out = self.model(inp.tokens, inp.meta, **self.loss_kwargs)
                ce += cross_entropy_sum(out.logits, inp.labels, inp.loss_mask).double()
        return ce

    def norm_params(self) -> list[nn.Parameter]:
        return list(self.model.parameters())


class LazyInputs(Sequence):
    """The StageInputs of microbatches, built when read and not kept: a runner that visits each
    microbatch once holds the metadata (and the per-microbatch plans cached in it) of one at a time.
    `progress` (the first step's, components/progress.py) counts microbatches 0..i-1 done when i is read."""

    def __init__(
        self,
        microbatches: Sequence[PackedBatch],
        prepare: Callable[[PackedBatch], StageInput],
        progress: Progress | None = None,
    ):
        self.microbatches, self.prepare, self.progress = microbatches, prepare, progress

    def __len__(self) -> int:
        return len(self.microbatches)

    def __getitem__(self, i):  # type: ignore[override]
        assert isinstance(i, int), "LazyInputs is read one microbatch at a time"
        while self.progress is not None and self.progress.count < i:  # read again by a later chunk: once
            self.progress.advance()
        return self.prepare(self.microbatches[i])


@dataclass
class ModelParts:
    module: nn.Module
    """This rank's module: it owns the parameters (optimizer, checkpoint); under pipeline
    parallelism the model with the other ranks' layers removed, whose chunks the schedule runs."""
    runner: LocalRunner | PipelineSchedule
    num_params: int
    """Parameters of this rank's stages (global shapes: sharded parameters count in full)."""


def build(
    model: nn.Module, run: Run, device: torch.device, init: Callable[[nn.Module], None] | None
) -> ModelParts:
    """This rank's part of the meta-device `model` under the run's layout (`run.stages`: each pipeline
    stage's layer ids, None without pipeline parallelism; the pipeline schedule, compile, activation
    recomputation and dtypes: the run's), allocated on `device` and filled by `init` (None: left on the
    meta device, a fake-process-group dry run, which fills it only for a step that fits this machine:
    memory/dry_run.py), with its runner; the stages exchange activations and their gradients in the
    compute dtype. Every rank must call it (process groups of tied weights are created collectively)."""
    spec, dims, stages, precision = run.spec, run.dims, run.stages, run.precision
    chunks, tied = [model], ()
    packed_weight.mark(model, run.resident)  # a base kept as released stays out of FSDP
    if stages is not None:  # keep this rank's stages only (before sharding them over dp x cp)
        assert spec.pipeline is not None, spec.name  # validate_pipeline refused it at start-up
        pp_rank, pp = dims.mesh_rank("pp"), dims.pp
        tied = spec.pipeline.tied(model)
        model = split_model(spec.pipeline, model, stages, pp_rank, pp, tied)
        chunks = chunk_views(spec.pipeline, model, stages, pp_rank, pp, tied)
    num_params = count_params(model)
    if spec.parallelize is not None:  # each chunk is sharded as a model of its own
        ac, on = run.cfg.activation_checkpoint, run.compile.on
        chunks = [spec.parallelize(c, dims, compile=on, ac=ac, precision=precision) for c in chunks]
    # Still on the meta device: each weight kept as released becomes its codes' box (checked on blocks).
    packed_weight.swap(model, run.resident)
    # Only now is memory allocated: this rank's shards of its stages, on its device.
    if init is not None:
        model.to_empty(device=device)
        init(model)
    model = model.train()
    chunk = loss_chunk(run.cfg.loss)
    if stages is None:
        return ModelParts(model, LocalRunner(model, dims.tp_enabled, device, chunk), num_params)
    on_end = pp_rank in (0, pp - 1)
    tied_group = tied_groups(dims) if tied else None
    runner = PipelineSchedule(
        chunks,
        pp_rank,
        pp,
        dims.get_mesh("pp").get_group(),
        run.cfg.parallelism.pipeline_parallel_schedule,
        # Under tensor parallelism the boundary carries this tp rank's sequence-parallel rows.
        spec.pipeline.boundary_shape(run.model_args, run.tokens_per_rank // dims.tp),
        precision.compute,
        device,
        tied=[q for n in tied for q in getattr(model, n).parameters()] if on_end else [],
        tied_group=tied_group if on_end else None,
        tensor_parallel=dims.tp_enabled,
        loss_chunk=chunk,
    )
    return ModelParts(model, runner, num_params)
