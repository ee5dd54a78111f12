"""The trainer: one straight-line `__init__` that assembles the parts, one method per loop phase.

    ./run_train.sh --config debug_dense_thd.toml            # torchrun -> main() -> Trainer
    python -m titan_thd.train --help                         # every config field with its doc

Loss (docs/design.md §3.5): every microbatch backpropagates
    (sum of token cross-entropy over its trained tokens + its aux-loss sums) / N
where N is the GLOBAL number of trained tokens of the optimizer step (all microbatches, all data-
and context-parallel ranks), known to every rank from the step's plan. Nothing else divides: FSDP
sums gradients over ranks, so loss and gradients do not depend on the parallel layout. Under
pipeline parallelism (pipeline/) `train_step` hands the microbatches to the schedule:
the last stage backpropagates the same (CE + aux) / N, every other stage its own aux sums / N.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import os
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

from titan_thd import pipeline
from titan_thd.components import hardware
from titan_thd.components.checkpoint import CheckpointError, CheckpointManager, model_fingerprint
from titan_thd.components.loss import cross_entropy_sum, loss_context
from titan_thd.components.lr_scheduler import LRSchedulersContainer
from titan_thd.components.metrics import MetricsLogger, StepTimer, peak_tflops_per_rank, step_metrics
from titan_thd.components.muon import Muon
from titan_thd.components.optimizer import (
    OptimizersContainer,
    build_optimizers,
    clip_grad_norm_,
    default_matrix_params,
)
from titan_thd.components.validation import Validator, build_stores
from titan_thd.config import Config, help_text, load_config, to_toml
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition
from titan_thd.data.dataloader import StepBatch, THDDataLoader, build_dataloader
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.data.token_store import build_token_store
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.inference.evaluation import TrainingEvaluator
from titan_thd.inputs import (
    attention_cost_weight,
    check_inputs,
    env_world_size,
    pipeline_stage_layers,
)
from titan_thd.models.spec import ModelSpec, as_dtype, count_params
from titan_thd.parallel import distributed as dist_utils
from titan_thd.parallel.context_parallel import resolve_mode
from titan_thd.parallel.distributed import DistInfo
from titan_thd.parallel.fsdp import (
    build_on_meta,
    estimate_memory_per_rank,
    largest_unsharded_unit_bytes,
    materialize_sharded,
)
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.tensor_parallel import reduce_replicated_grads

logger = logging.getLogger("titan_thd")


class Trainer:
    # ---- configuration
    cfg: Config
    spec: ModelSpec
    model_args: Any
    # ---- distributed
    dist: DistInfo
    parallel_dims: ParallelDims
    cp: CPContext
    # ---- data
    tokenizer: Tokenizer
    dataloader: THDDataLoader
    validator: Validator | None
    evaluator: TrainingEvaluator | None
    # ---- model and optimisation
    model: nn.Module
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    # ---- runtime
    metrics: MetricsLogger
    checkpointer: CheckpointManager
    peak_tflops: float
    # ---- training state (checkpointed as "train_state")
    step: int
    tokens_seen: int

    def __init__(self, cfg: Config):
        self.cfg = cfg
        t, p = cfg.training, cfg.parallelism

        # Everything a user can get wrong is checked here, before any process group exists.
        fake = cfg.comm.mode == "fake"
        world_size = env_world_size("NGPU" if fake else "WORLD_SIZE")
        self.spec, self.tokenizer, self.model_args, self.parallel_dims = check_inputs(cfg, world_size)
        init_from_hf = self.spec.init_from_hf
        pp_layers = pipeline_stage_layers(cfg, self.model_args)  # None without pipeline parallelism
        self.pp_layers = pp_layers
        self.evaluator = (  # answer accuracy on held-out chat problems (titan_thd/inference/evaluation.py)
            TrainingEvaluator(cfg.evaluation, t.steps, self.tokenizer, t.tokens_per_microbatch)
            if cfg.evaluation.enable
            else None
        )

        self.dist = dist_utils.init_distributed(cfg.comm)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.parallel_dims.build_meshes(self.dist.device.type)
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        self.cp = CPContext(
            size=self.parallel_dims.cp,
            rank=self.parallel_dims.mesh_rank("cp"),
            group=None if cp_mesh is None else cp_mesh.get_group(),
            mode=resolve_mode(p.context_parallel_mode, cfg.model.name, self.spec.cp_mode),  # checked above
            hybrid_threshold=hybrid_threshold(cfg, self.parallel_dims),
        )

        # Offline-packed rows (data.source = packed) are read by the dataloader itself.
        store = val_store = None
        if cfg.data.source != "packed":
            cache_dir = cfg.data.cache_dir or os.path.join(cfg.job.dump_folder, "data_cache")
            # Rank 0 tokenises first; the others then read its cache instead of repeating the work.
            if self.dist.rank != 0:
                dist_utils.barrier()
            store = build_token_store(cfg.data, self.tokenizer, t.seed, cache_dir, progress=self.dist.is_main)
            store, val_store = build_stores(cfg, store, self.tokenizer, cache_dir, progress=self.dist.is_main)
            if self.dist.rank == 0:
                dist_utils.barrier()
        self.dataloader = build_loader(
            cfg,
            store,
            self.parallel_dims,
            self.parallel_dims.mesh_rank("batch"),
            self.spec,
            self.model_args,
            self.tokenizer,
        )
        self.validator = build_validator(
            cfg,
            val_store,
            self.parallel_dims,
            self.parallel_dims.mesh_rank("batch"),
            self.spec,
            self.model_args,
        )

        # Full weights on CPU from the seed, then sharded: the same seed gives the same model on
        # every layout. A fake-PG dry run builds on the meta device (the model may not fit).
        torch.manual_seed(t.seed)
        if fake:
            model = build_on_meta(lambda: self.spec.build(self.model_args))
        else:
            model = self.spec.build(self.model_args)
        if cfg.model.hf_path and fake:
            logger.warning("model.hf_path: not loaded in a fake-process-group dry run (meta weights)")
        elif cfg.model.hf_path:  # full weights, before sharding; ValueError when the architecture differs
            init_from_hf(model, cfg.model.hf_path)
        model.to(as_dtype(t.dtype))
        fingerprint = model_fingerprint([model], model=cfg.model.name, flavor=cfg.model.flavor)
        self.pipeline: pipeline.PipelineSchedule | None = None
        chunks = [model]  # the modules that run forward passes: one per pipeline stage of this rank
        if pp_layers is not None:  # keep this rank's stages only (before sharding them over dp x cp)
            pp_rank, pp = self.parallel_dims.mesh_rank("pp"), self.parallel_dims.pp
            tied_names = pipeline.tied_first_last(cfg.model.name, model)
            model = pipeline.split_model(cfg.model.name, model, pp_layers, pp_rank, pp)
            chunks = pipeline.chunk_views(cfg.model.name, model, pp_layers, pp_rank, pp)
        self.param_count = count_params(model)  # before expert parallelism drops the others' experts
        if self.spec.parallelize is not None:  # each chunk is sharded as a model of its own
            chunks = [self.spec.parallelize(chunk, self.parallel_dims, p) for chunk in chunks]
            model = chunks[0] if len(chunks) == 1 else model
        if t.compile:  # regional: swaps compiled element-wise functions into the modules (docs/dsv4.md §18)
            assert self.spec.compile is not None, cfg.model.name
            for chunk in chunks:
                self.spec.compile(chunk)
        if fake:
            materialize_sharded(model)
        self.model = model.to(self.dist.device).train()
        if pp_layers is not None:
            tied_group = pipeline.tied_groups(self.parallel_dims) if tied_names else None
            on_end = pp_rank in (0, pp - 1)
            self.pipeline = pipeline.PipelineSchedule(
                chunks,
                pp_rank,
                pp,
                self.parallel_dims.get_mesh("pp").get_group(),
                p.pipeline_parallel_schedule,
                pipeline.boundary_shape(self.model_args, t.tokens_per_microbatch // self.parallel_dims.cp),
                as_dtype(t.dtype),
                self.dist.device,
                tied=[q for n in tied_names for q in getattr(self.model, n).parameters()] if on_end else [],
                tied_group=tied_group if on_end else None,
            )

        self.optimizers = build_optimizers([self.model], cfg.optimizer, self.spec)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, cfg.lr_scheduler, t.steps)

        self.step, self.tokens_seen = 0, 0
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model_parts=[self.model],
            optimizers=self.optimizers.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self, "dataloader": self.dataloader},
            fingerprint=fingerprint,
        )
        # Only one rank writes metrics; it measures the MFU peak while the others wait.
        self.peak_tflops = 0.0
        if self.dist.is_main:
            self.peak_tflops = peak_tflops_per_rank(
                cfg.metrics, as_dtype(t.dtype), self.dist.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
        dist_utils.barrier()
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, enabled=self.dist.is_main)
        self._recent_step_times: collections.deque[float] = collections.deque(maxlen=10)
        self.timer = StepTimer(self.dist.device)
        self._log_header()

    # ------------------------------------------------------------------ checkpointed state
    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.tokens_seen = int(state["step"]), int(state["tokens_seen"])

    # ------------------------------------------------------------------ loop phases
    def next_step_batch(self) -> StepBatch:
        step_batch = next(self.dataloader)
        # Data step s feeds optimizer step s + 1 (self.step counts completed steps).
        assert step_batch.step == self.step, (step_batch.step, self.step)
        return step_batch

    def forward_backward(
        self, microbatch: PackedBatch, num_trained: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of one microbatch; returns its (CE sum, aux sums), detached.

        `num_trained` is the global trained-token count of the step (the only divisor).
        """
        inp = self.local_inputs(microbatch)
        with loss_context(self.parallel_dims.tp_enabled):
            out = self.model(inp.tokens, inp.meta)
            ce = cross_entropy_sum(out.logits, inp.labels, inp.loss_mask)
            loss = (ce + sum(out.aux_losses.values(), torch.zeros((), device=ce.device))) / num_trained
            loss.backward()
        return ce.detach(), {k: v.detach() for k, v in out.aux_losses.items()}

    def local_inputs(self, microbatch: PackedBatch) -> pipeline.StageInput:
        """This rank's rows of a microbatch and their BatchMeta (every rank builds its own)."""
        local = (
            partition(microbatch, self.cp.size, self.cp.rank, self.cp.mode, self.cp.hybrid_threshold)
            if self.cp.enabled
            else microbatch
        )
        meta = BatchMeta.from_batch(local, cp=self.cp, full=microbatch, device=self.dist.device)
        dev = self.dist.device
        return pipeline.StageInput(meta.tokens, meta, local.labels.to(dev), local.loss_mask.to(dev))

    def train_step(self, step_batch: StepBatch) -> dict[str, float]:
        """One optimizer step over the microbatches of `step_batch`; returns the global losses."""
        self.optimizers.zero_grad()
        num_trained = max(1, step_batch.trained_tokens)
        ce_sum = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        aux_sums: dict[str, torch.Tensor] = {}
        with self.timer.phase("forward_backward"):
            if self.pipeline is not None:  # sums over all stages; the schedule runs every microbatch
                inputs = [self.local_inputs(mb) for mb in step_batch.microbatches]
                ce_sum, aux_sums = self.pipeline.step(inputs, num_trained)
            else:
                for microbatch in step_batch.microbatches:
                    ce, aux = self.forward_backward(microbatch, num_trained)
                    ce_sum += ce
                    for k, v in aux.items():
                        aux_sums[k] = aux_sums.get(k, 0) + v.double()
                reduce_replicated_grads(self.model)  # TP: parameters used on each rank's rows / heads
        with self.timer.phase("comm"):
            grad_norm = self.clip_gradients()
            # The other data/context-parallel ranks hold the rest of the step's token sums.
            loss_mesh = self.parallel_dims.get_optional_mesh("loss")
            losses = {"loss": dist_utils.dist_sum(ce_sum, loss_mesh) / num_trained}
            losses |= {k: dist_utils.dist_sum(v, loss_mesh) / num_trained for k, v in aux_sums.items()}
            result = {"grad_norm": float(grad_norm)} | {k: float(v) for k, v in losses.items()}
        # Global values, the same on every rank: all ranks stop here together, and a bad step
        # never reaches the weights, the optimizer state or a checkpoint. (A fake-process-group dry
        # run computes on garbage collectives: its numbers mean nothing.)
        if not self.dist.fake and not all(math.isfinite(v) for v in result.values()):
            raise FloatingPointError(
                f"step {self.step}: not finite: "
                + ", ".join(f"{k} = {v}" for k, v in result.items())
                + ". Stopped before the optimizer step: neither the weights nor a checkpoint hold this "
                "step (the newest checkpoint is the last good state); lower optimizer.lr or check the data"
            )
        lr = self.lr_schedulers.current_lr
        with self.timer.phase("optimizer"):
            self.optimizers.step()
            self.lr_schedulers.step()
            after_step = self.spec.after_optimizer_step
            if after_step is not None:
                after_step(self.model, None if loss_mesh is None else loss_mesh.get_group())
        return result | {"lr": lr}

    def clip_gradients(self) -> torch.Tensor:
        """Clip to training.max_norm over the whole model; returns the global norm before clipping."""
        ep_mesh = self.parallel_dims.get_optional_mesh("ep")  # experts: each counted on its own rank
        ep_group = None if ep_mesh is None else ep_mesh.get_group()
        if self.pipeline is None:
            return clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm, ep_group=ep_group)
        return clip_grad_norm_(  # over every stage; the tied copies count once
            self.pipeline.norm_params(),
            self.cfg.training.max_norm,
            pp_group=self.pipeline.group,
            also_scale=[q for q in self.pipeline.tied if not self.pipeline.is_first],
            ep_group=ep_group,
        )

    def log(
        self, step_batch: StepBatch, result: dict[str, float], step_time: float, wall_time: float
    ) -> None:
        val = {k: v for k, v in result.items() if k.startswith("val/")}
        aux = {k: v for k, v in result.items() if k not in ("loss", "grad_norm", "lr", *val)}
        record = (
            step_metrics(
                step=self.step,
                loss=result["loss"],
                grad_norm=result["grad_norm"],
                lr=result["lr"],
                step_time=step_time,
                wall_time=wall_time,
                tokens_real=step_batch.real_tokens,
                tokens_trained=step_batch.trained_tokens,
                tokens_slots=step_batch.slot_tokens,
                flops=self.spec.flops_per_step(self.model_args, step_batch.doc_lengths),
                num_microbatches=step_batch.num_microbatches,
                imbalance=step_batch.imbalance,
                world_size=self.dist.world_size,
                peak_tflops=self.peak_tflops,
                aux_losses=aux,
                phase_times=self.timer.pop(),
            )
            | val
        )
        self.metrics.log(record, last_step=self.cfg.training.steps)
        self._recent_step_times.append(step_time)
        last = self.cfg.training.steps
        if self.dist.is_main and self.step < last and self.metrics.should_print(self.step, last):
            logger.info("%s", progress_line(self.step, last, self._recent_step_times))

    def validate(self) -> dict[str, float]:
        """The val/* metrics after this step when it is a validation step, else {} (docs/design.md §3.9)."""
        if self.validator is None or not self.validator.due(self.step):
            return {}
        return self.validator.run(self)

    def train(self) -> None:
        if self.dist.fake and not self._fake_step_fits():
            return
        self.checkpointer.load()  # restores self.step / tokens_seen / the data position
        start = time.perf_counter()
        while self.step < self.cfg.training.steps:
            t0 = time.perf_counter()
            with self.timer.phase("data"):
                step_batch = self.next_step_batch()
            self.step += 1  # counts completed optimizer steps: 1 is the first
            result = self.train_step(step_batch)
            self.tokens_seen += step_batch.real_tokens
            now = time.perf_counter()
            result |= self.validate()
            if self.evaluator is not None and self.evaluator.due(self.step):
                build = lambda: self.spec.build(self.model_args)  # noqa: E731
                result |= self.evaluator.run(self.model, build, self.dist.device)
            self.log(step_batch, result, now - t0, now - start)
            self.checkpointer.save(self.step, force=self.step == self.cfg.training.steps)
            if self.checkpointer.should_stop():
                self.checkpointer.save(self.step, force=True)
                logger.info("stopped by signal after step %d", self.step)
                break

    def close(self) -> None:
        """Flush the metrics and restore the signal handler (the process group stays up: main() ends it)."""
        self.metrics.close()
        self.checkpointer.close()

    # ------------------------------------------------------------------ helpers
    def _fake_step_fits(self) -> bool:
        """A fake-PG step gathers each FSDP unit in full (the fake all-gather copies the local shard
        into every slot); skip the step, with the numbers, when that cannot fit in this machine or
        would take more than 5 minutes."""
        unit = largest_unsharded_unit_bytes(self.model)
        logger.info("dry run: largest unsharded FSDP unit %.2f GiB (one all-gather)", unit / 2**30)
        need = 3 * unit  # the unit's params, grads, workspace
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > free:
            logger.warning(
                "dry run: meshes, sharding and optimizer built; the step is skipped because one FSDP unit "
                "needs about %.1f GiB unsharded and this machine has %.1f GiB free",
                need / 2**30,
                free / 2**30,
            )
            return False
        # With expert parallelism even `flash` fits; its step would then compute for an hour on a CPU.
        tokens = self.cfg.training.tokens_per_microbatch // self.parallel_dims.cp
        flops = self.spec.flops_per_step(self.model_args, [tokens]) / self.parallel_dims.pp
        seconds = flops / (self.peak_tflops * 1e12) if self.peak_tflops > 0 else 0.0
        if seconds > 300:
            logger.warning(
                "dry run: meshes, sharding and optimizer built; the step is skipped because one "
                "microbatch of %d tokens per rank is %.1e FLOPs, about %.0f min at this machine's %.3f TFLOP/s",
                tokens,
                flops,
                seconds / 60,
                self.peak_tflops,
            )
            return False
        return True

    def _log_header(self) -> None:
        if not self.dist.is_main:
            return
        c, d = self.cfg, self.parallel_dims
        logger.info("%s", c.job.description or "titan_thd")
        logger.info(
            "model %s/%s: %s parameters, vocab %d (tokenizer %d), dtype %s",
            c.model.name,
            c.model.flavor,
            f"{self.param_count:,}",
            self.model_args.vocab_size,
            self.tokenizer.vocab_size,
            c.training.dtype,
        )
        muon = c.optimizer.name == "muon"
        muon_params = (self.spec.matrix_params or default_matrix_params)(self.model) if muon else ()
        logger.info(
            "%s",
            estimate_memory_per_rank(
                self.model, d, c.optimizer.name, as_dtype(c.training.dtype), muon_params
            ),
        )
        if self.pipeline is not None:  # every stage's share, built on the meta device
            for line in pipeline.stage_summary(
                lambda: build_on_meta(lambda: self.spec.build(self.model_args)),
                c.model.name,
                self.pp_layers,
                d,
                c.parallelism.pipeline_parallel_schedule,
                self.pipeline.shape,
                as_dtype(c.training.dtype),
                c.optimizer.name,
                self.spec.matrix_params or default_matrix_params,
                pipeline.activations.estimate(
                    self.spec,
                    self.model_args,
                    c.training.tokens_per_microbatch // d.cp,
                    as_dtype(c.training.dtype),
                    narrow_ok=self.dist.fake,  # minutes of CPU for a Flash-sized model
                ),
            ):
                logger.info("%s", line)
        muon_opt = next((o for o in self.optimizers.optimizers if isinstance(o, Muon)), None)
        logger.info(
            "hardware: %s%s",
            hardware.detect(self.dist.device).describe(),
            ""
            if muon_opt is None
            else f"; Muon Newton-Schulz in {str(muon_opt.ns_dtype).removeprefix('torch.')} "
            f"(optimizer.muon_ns_dtype = {c.optimizer.muon_ns_dtype})",
        )
        logger.info(
            "world %d on %s%s: dp %d, cp %d (%s), tp %d, pp %d%s",
            d.world_size,
            self.dist.device,
            " (fake process group)" if self.dist.fake else "",
            d.dp,
            d.cp,
            self.cp.mode,
            d.tp,
            d.pp,
            f", ep {d.ep} (experts sharded over efsdp {d.efsdp_degree})" if d.ep_enabled else "",
        )
        counts = self.dataloader.overlong_counts
        logger.info(
            "data %s %s: %d samples; %d truncated, %d dropped (longer than T = %d); global batch %d",
            c.data.source,
            c.data.path or c.data.mock_config,
            self.dataloader.steps.num_samples,
            counts["truncated"],
            counts["dropped"],
            c.training.tokens_per_microbatch,
            c.training.global_batch_size,
        )
        if self.validator is not None:
            v = c.validation
            logger.info(
                "validation: %d documents (%s) in %d batches, after every %d steps and the last%s",
                self.validator.num_docs,
                f"fraction {v.fraction} held out of the data" if v.fraction else v.path,
                self.validator.num_batches,
                v.freq,
                "; padded forward compared" if v.compare_padded else "",
            )
        if c.training.global_batch_size < d.dp:
            logger.warning(
                "training.global_batch_size = %d samples for %d data-parallel replicas: at least %d "
                "replicas train on padding only every step",
                c.training.global_batch_size,
                d.dp,
                d.dp - c.training.global_batch_size,
            )
        logger.info(
            "MFU peak %.3f TFLOP/s per rank (%s)",
            self.peak_tflops,
            "metrics.peak_tflops" if c.metrics.peak_tflops else "measured matmul peak",
        )


def progress_line(step: int, last_step: int, recent_step_times: collections.abc.Sequence[float]) -> str:
    """`step 20/40 (50%), 3.10 s/step (last 10), ETA 1m02s`: steps left x the recent mean step time."""
    per_step = sum(recent_step_times) / max(1, len(recent_step_times))
    eta = round((last_step - step) * per_step)
    hours, rest = divmod(eta, 3600)
    clock = f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
    return (
        f"progress: step {step}/{last_step} ({100 * step / last_step:.0f}%), {per_step:.2f} s/step "
        f"(last {len(recent_step_times)}), ETA {clock}"
    )


def hybrid_threshold(cfg: Config, dims: ParallelDims) -> int:
    """The padded length from which hybrid CP splits a document (default T / cp)."""
    return cfg.parallelism.hybrid_cp_threshold or cfg.training.tokens_per_microbatch // dims.cp


def rows_multiple(cfg: Config, dims: ParallelDims) -> int:
    """What a trimmed microbatch's rows are a multiple of (packer.microbatch_rows); 0 = full T rows."""
    if not cfg.data.trim_padding or dims.pp > 1:
        return 0
    # Every CP rank gets rows / cp of them, which sequence-parallel TP splits tp ways.
    return math.lcm(cfg.data.pad_to_multiple, dims.cp * dims.tp)


def build_loader(
    cfg: Config,
    store,
    dims: ParallelDims,
    dp_rank: int,
    spec: ModelSpec,
    model_args: Any,
    tokenizer: Tokenizer,
) -> THDDataLoader:
    """The data loader of replica `dp_rank` (`store`: None for data.source = packed); ValueError when an
    offline pack was made with another tokenizer than data.tokenizer."""
    t = cfg.training
    loader = build_dataloader(
        cfg.data,
        store,
        dp_rank=dp_rank,
        dp_size=dims.dp,
        cp_size=dims.cp,
        tokens_per_microbatch=t.tokens_per_microbatch,
        global_batch_size=t.global_batch_size,
        seed=t.seed,
        planner=t.planner,
        cost_attention=t.planner_cost_attention or attention_cost_weight(spec, model_args),
        # Interleaved1F1B runs microbatches in groups of pp (its deadlock-free order for any K keeps
        # more of them in flight when K is not a multiple).
        microbatch_group=dims.pp if cfg.parallelism.pipeline_parallel_schedule == "Interleaved1F1B" else None,
        tokenizer=tokenizer,
        hybrid_threshold=hybrid_threshold(cfg, dims)
        if cfg.parallelism.context_parallel_mode == "hybrid"
        else 0,
        rows_multiple=rows_multiple(cfg, dims),
    )
    rows = getattr(loader.steps, "rows", None)
    if rows is not None and (rows.vocab_size, rows.pad_id) != (tokenizer.vocab_size, tokenizer.pad_id):
        raise ValueError(
            f"data.path = {cfg.data.path!r} was packed with tokenizer {rows.metadata.get('tokenizer')!r} "
            f"(vocab_size {rows.vocab_size}, pad id {rows.pad_id}), but data.tokenizer = {cfg.data.tokenizer!r} "
            f"has vocab_size {tokenizer.vocab_size}, pad id {tokenizer.pad_id}: repack with this tokenizer"
        )
    return loader


def build_validator(
    cfg: Config, store, dims: ParallelDims, dp_rank: int, spec: ModelSpec, model_args: Any
) -> Validator | None:
    """The validation loop of replica `dp_rank` (None without a validation set)."""
    if store is None:
        return None
    cost = cfg.training.planner_cost_attention or attention_cost_weight(spec, model_args)
    return Validator(
        cfg,
        store,
        dp_rank=dp_rank,
        dp_size=dims.dp,
        cp_size=dims.cp,
        cost_attention=cost,
        rows_multiple=rows_multiple(cfg, dims),
    )


def preflight(cfg: Config) -> None:
    """Read what a run of NGPU processes (env, default 1) would read before its first step, in this one
    process and without a process group: the configuration and layout, the tokenizer, the data (tokenised
    into the cache that the run then reuses), the Hugging Face config, the checkpoint to resume.
    run_train.sh runs it before torchrun, so that an input error is one line and not torchrun's failure
    report."""
    spec, tokenizer, model_args, dims = check_inputs(cfg, env_world_size("NGPU"))
    store = None
    if cfg.data.source != "packed":
        cache_dir = cfg.data.cache_dir or os.path.join(cfg.job.dump_folder, "data_cache")
        store = build_token_store(cfg.data, tokenizer, cfg.training.seed, cache_dir, progress=True)
        store, val_store = build_stores(cfg, store, tokenizer, cache_dir, progress=True)
        build_validator(cfg, val_store, dims, 0, spec, model_args)
    one_process = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, num_workers=0))
    build_loader(one_process, store, dims, 0, spec, model_args, tokenizer)
    if cfg.checkpoint.enable:  # the fingerprint has global shapes: a model on the meta device has them
        model = build_on_meta(lambda: spec.build(model_args))
        checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model_parts=[model],
            optimizers=[],
            lr_schedulers=[],
            states={},
            fingerprint=model_fingerprint([model], model=cfg.model.name, flavor=cfg.model.flavor),
        )
        try:
            checkpointer.check_resumable()
        finally:
            checkpointer.close()
    logger.info("preflight: inputs of a %d-process run are fine", dims.world_size)


# What bad input raises (a wrong value, a missing or unreadable file): main() prints it as one
# `error:` line and exits with 2; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
# What stops a run that started well: a save that failed on some rank (full disk), a non-finite
# loss or gradient. The messages say what was kept; exit code 1.
RUN_FAILURES = (CheckpointError, FloatingPointError)
DEBUG_ENV = "TITAN_THD_DEBUG"
"""Environment variable: `TITAN_THD_DEBUG=1` shows the traceback of user errors too."""


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m titan_thd.train` (what run_train.sh launches on every rank)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    logging.basicConfig(level=logging.INFO, format="[titan_thd] %(asctime)s %(message)s", datefmt="%H:%M:%S")
    # torchdata's StatefulDataLoader calls a deprecated torch hook on every start: noise, not news.
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    trainer = None
    try:
        cfg = load_config(argv)
        if cfg.job.print_config:
            print(to_toml(cfg))
            return 0
        if cfg.job.preflight:
            preflight(cfg)
            return 0
        trainer = Trainer(cfg)
        trainer.train()
        # A rank that finished its last collective may not leave before the others have too:
        # tearing the process group down under a peer's pending receive aborts that peer.
        dist_utils.barrier()
    except USER_ERRORS as e:  # the message says what to fix, a traceback would not
        if debug_enabled():
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RUN_FAILURES as e:  # the run itself failed (a save, a diverging step): said in one line too
        if debug_enabled():
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if trainer is not None:
            trainer.close()
        dist_utils.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
