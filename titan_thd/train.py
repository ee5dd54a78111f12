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
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_thd import exits
from titan_thd.components.checkpoint import CheckpointManager
from titan_thd.components.checkpoint_folder import model_fingerprint
from titan_thd.components.lr_scheduler import LRSchedulersContainer
from titan_thd.components.metrics import (
    MetricsLogger,
    StepTimer,
    peak_tflops_per_rank,
    progress_line,
    step_record,
)
from titan_thd.components.optimizer import OptimizersContainer, build_optimizers, clip_grad_norm_
from titan_thd.components.progress import Progress
from titan_thd.components.run_header import header_lines
from titan_thd.components.run_settings import run_layout
from titan_thd.components.signals import StopSignal
from titan_thd.components.validation import Validator
from titan_thd.config import help_text, load_config, to_toml
from titan_thd.data.batch_meta import BatchMeta, CPContext
from titan_thd.data.cp_partition import partition
from titan_thd.data.dataloader import OrderedSteps, StepBatch, THDDataLoader, build_dataloader
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.data.stores import build_stores
from titan_thd.inference.evaluation import TrainingEvaluator
from titan_thd.lora.targets import trained_keys
from titan_thd.memory.dry_run import fake_step_fits, materialize, plan_with_activations
from titan_thd.memory.host import refuse_beyond_host
from titan_thd.memory.live import available_host_bytes, log_peak_rss
from titan_thd.memory.plan import MemoryPlan, plan_memory
from titan_thd.models.compile import CompileClock
from titan_thd.models.hf.base import init_base
from titan_thd.models.hf.tokenizer import write_tokenizer
from titan_thd.parallel import distributed as dist_utils
from titan_thd.parallel.distributed import DistInfo, env_world_size
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.pipeline.runner import LazyInputs, LocalRunner, build
from titan_thd.pipeline.schedule import PipelineSchedule, StageInput
from titan_thd.preflight import check_outputs, preflight
from titan_thd.run import Run
from titan_thd.startup import resolve_run

logger = logging.getLogger("titan_thd")


class Trainer:
    # ---- configuration
    run: Run
    """Every decision start-up made (titan_thd/run.py), and `run.cfg`, the configuration as loaded (never
    written): the trainer reads both through `run` and keeps no copy of either."""
    # ---- distributed
    dist: DistInfo
    cp: CPContext
    # ---- data
    dataloader: THDDataLoader
    validator: Validator | None
    evaluator: TrainingEvaluator | None
    # ---- model and optimisation
    model: nn.Module
    """This rank's module (its pipeline stages' layers): owns the parameters."""
    param_count: int
    runner: LocalRunner | PipelineSchedule
    """Runs a step's forward and backward passes (pipeline/runner.py)."""
    optimizers: OptimizersContainer
    lr_schedulers: LRSchedulersContainer
    memory: MemoryPlan | None
    """Every pipeline rank's memory (memory/plan.py), on rank 0 and in a dry run (None elsewhere)."""
    # ---- runtime
    metrics: MetricsLogger
    checkpointer: CheckpointManager
    stop: StopSignal
    stopped: bool
    peak_tflops: float
    compile_clock: CompileClock
    timer: StepTimer
    progress: Progress | None
    """The running step's microbatch count: a line every 30 s of the first step of a process."""
    _recent_step_times: collections.deque[float]
    # ---- training state (checkpointed as "train_state")
    step: int
    tokens_seen: int
    # ---- this invocation (the summary line)
    first_step: int
    train_seconds: float
    last_loss: float | None

    def __init__(self, run: Run):
        # Start-up (startup.resolve_run) checked everything a user can get wrong and made every decision
        # before any process group exists: the trainer reads them from `run`, never from the config.
        self.run, cfg, dims = run, run.cfg, run.dims
        check_outputs(cfg, run.settings)  # a new run does not replace another run's metrics
        self.evaluator = None  # answer accuracy on held-out chat problems (inference/evaluation.py)
        if cfg.evaluation.enable:
            t = cfg.training
            self.evaluator = TrainingEvaluator(
                cfg.evaluation, t.steps, run.tokenizer, t.tokens_per_microbatch, run.spec
            )

        # Mixed precision is FSDP2's casting, on every layout: one process shards over a group of one.
        self.dist = dist_utils.init_distributed(cfg.comm, single_rank_group=run.precision.mixed)
        if cfg.training.deterministic:
            torch.use_deterministic_algorithms(True)
        dims.build_meshes(self.dist.device.type)
        # Every pipeline rank's memory, planned once by rank 0, which logs it and decides the host
        # refusal for all, before anything is allocated; in a dry run every rank sizes its own step
        # (its activations measured after the header: memory/dry_run.py).
        self.memory = plan_memory(run, measure=not run.fake) if self.dist.is_main or run.fake else None
        self._refuse_beyond_host_memory()
        cp_group = None if dims.cp == 1 else dims.get_mesh("cp").get_group()
        self.cp = CPContext(dims.cp, dims.mesh_rank("cp"), cp_group, run.cp_mode, run.hybrid_threshold)

        layout = run.layout(dp_rank=dims.mesh_rank("batch"))
        store, val_store = None, None  # offline packs: the loader reads them
        if cfg.data.source != "packed":  # rank 0 tokenises into the cache first, the others read it
            with dist_utils.rank_zero_first(self.dist.rank):
                t, main = cfg.training, self.dist.is_main
                store, val_store = build_stores(
                    cfg.data, cfg.validation, run.tokenizer, t.seed, run.cache_dir, main
                )
        self.dataloader = build_dataloader(cfg.data, store, layout, run.tokenizer)

        # Built on the meta device (in the master dtype: FSDP casts what it gathers), cut and sharded
        # there; each rank then allocates only its shards, filled from the seed or the checkpoint.
        torch.manual_seed(cfg.training.seed)
        model = build_on_meta(run.build_model).to(run.precision.master)  # + LoRA adapters (lora/)
        if cfg.model.hf_path and run.fake:
            logger.warning("model.hf_path: not loaded in a fake-process-group dry run (meta weights)")
        fingerprint = model_fingerprint([model], model=cfg.model.name, flavor=run.flavor)
        parts = build(model, run, self.dist.device, init=None if run.fake else self._init_weights)
        self.model, self.runner, self.param_count = parts.module, parts.runner, parts.num_params
        self.validator = self._validator(val_store, layout)

        self.optimizers = build_optimizers(self.model, cfg.optimizer, run.spec)
        self.lr_schedulers = LRSchedulersContainer(self.optimizers, cfg.lr_scheduler, cfg.training.steps)

        self.step, self.tokens_seen = 0, 0
        self.first_step, self.train_seconds, self.last_loss = 0, 0.0, None  # this invocation's, for summary()
        self.checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model=self.model,
            optimizer=self.optimizers,
            lr_schedulers=self.lr_schedulers,
            states={"train_state": self, "dataloader": self.dataloader},
            fingerprint=fingerprint,
            settings=run.settings,  # a resume with other settings is refused (run_settings.py)
            layout=run_layout(dims, cfg.training.steps),
            model_keys=None if run.lora is None else trained_keys(self.model),  # not a frozen base
        )
        self.stop = StopSignal(announce=self.dist.is_main)  # SIGTERM, Ctrl-C: installed by train()
        self.stopped = False  # whether a stop signal (to any rank) ended train() early
        # Only one rank writes metrics; it measures the MFU peak while the others wait.
        local, dev = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), self.dist.device
        is_main = self.dist.is_main
        self.peak_tflops = (
            peak_tflops_per_rank(cfg.metrics, run.precision.compute, dev, local) if is_main else 0.0
        )
        dist_utils.barrier()
        self.metrics = MetricsLogger(
            cfg.metrics, cfg.job.dump_folder, enabled=is_main, settings=run.settings, config=to_toml(cfg)
        )
        self._recent_step_times = collections.deque(maxlen=10)
        self.compile_clock = CompileClock()  # the compile seconds of the steps that compiled
        self.timer, self.progress = StepTimer(self.dist.device), None
        if is_main:
            self._log_header()
            if not run.fake:  # the run folder holds the tokenizer it was trained with
                source = None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
                write_tokenizer(run.tokenizer, Path(cfg.job.dump_folder) / "tokenizer", source)

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

    def local_inputs(self, microbatch: PackedBatch) -> StageInput:
        """This rank's rows of a microbatch and their BatchMeta (every rank builds its own)."""
        local = (
            partition(microbatch, self.cp.size, self.cp.rank, self.cp.mode, self.cp.hybrid_threshold)
            if self.cp.enabled
            else microbatch
        )
        meta = BatchMeta.from_batch(local, cp=self.cp, full=microbatch, device=self.dist.device)
        dev = self.dist.device
        return StageInput(meta.tokens, meta, local.labels.to(dev), local.loss_mask.to(dev))

    def train_step(self, step_batch: StepBatch) -> dict[str, float]:
        """One optimizer step over the microbatches of `step_batch`; returns the global losses."""
        self.optimizers.zero_grad()
        num_trained = max(1, step_batch.trained_tokens)
        with self.timer.phase("forward_backward"):  # sums over this rank's rows (every stage's)
            inputs = LazyInputs(step_batch.microbatches, self.local_inputs, self.progress)
            ce_sum, aux_sums = self.runner.step(inputs, num_trained)
        with self.timer.phase("comm"):
            grad_norm = self.clip_gradients()
            # The other data/context-parallel ranks hold the rest of the step's token sums.
            loss_mesh = self.run.dims.get_optional_mesh("loss")
            losses = {"loss": dist_utils.dist_sum(ce_sum, loss_mesh) / num_trained}
            losses |= {k: dist_utils.dist_sum(v, loss_mesh) / num_trained for k, v in aux_sums.items()}
            result = {"grad_norm": float(grad_norm)} | {k: float(v) for k, v in losses.items()}
        # Global values, the same on every rank: all ranks stop here together, and a bad step
        # never reaches the weights, the optimizer state or a checkpoint. (A fake-process-group dry
        # run computes on garbage collectives: its numbers mean nothing.)
        if not self.run.fake:
            exits.check_finite(self.step, result)
        lr = self.lr_schedulers.current_lr
        with self.timer.phase("optimizer"):
            self.optimizers.step()
            self.lr_schedulers.step()
            after_step = self.run.after_optimizer_step
            if after_step is not None:
                after_step(self.model, None if loss_mesh is None else loss_mesh.get_group())
        return result | {"lr": lr}

    def clip_gradients(self) -> torch.Tensor:
        """Clip to training.max_norm over the whole model (every pipeline stage, the tied copies
        counted once); returns the global norm before clipping."""
        return clip_grad_norm_(
            self.runner.norm_params(),
            self.run.cfg.training.max_norm,
            pp_group=self.runner.pp_group,
            also_scale=self.runner.also_scale,
            device=self.dist.device,
        )

    def log(
        self, step_batch: StepBatch, result: dict[str, float], step_time: float, wall_time: float
    ) -> None:
        run = self.run
        flops = run.spec.flops_per_step(run.model_args, step_batch.doc_lengths)
        timing = {"step_time": step_time, "wall_time": wall_time, "phase_times": self.timer.pop()}
        timing |= {"world_size": self.dist.world_size, "peak_tflops": self.peak_tflops}
        record = step_record(self.step, result, step_batch, flops=flops, **timing)
        self.metrics.log(record, last_step=run.cfg.training.steps)
        if run.compile.on and self.dist.is_main and (line := self.compile_clock.line(self.step, step_time)):
            logger.info("%s", line)
        if self.step > self.first_step + 1:  # the first step of a process warms up: not a rate
            self._recent_step_times.append(step_time)
        last = run.cfg.training.steps
        if self.dist.is_main and self.step < last and self.metrics.should_print(self.step, last):
            logger.info("%s", progress_line(self.step, last, self._recent_step_times))

    def validate(self) -> dict[str, float]:
        """The val/* metrics after this step when it is a validation step, else {} (docs/design.md §3.9)."""
        if self.validator is None or not self.validator.due(self.step):
            return {}
        return self.validator.run(self.model, self.step)

    def evaluate(self) -> dict[str, float]:
        if self.evaluator is None or not self.evaluator.due(self.step):
            return {}
        return self.evaluator.run(self.model, self.run.build_model, self.dist.device)

    def train(self) -> None:
        run = self.run
        if run.fake:  # a dry run's step only where its memory fits this machine (memory/dry_run.py)
            self.memory = plan_with_activations(run, log=self.dist.is_main)  # measured after the header
            rank, tokens = self.memory.ranks[run.dims.mesh_rank("pp")], run.tokens_per_rank
            flops = run.spec.flops_per_step(run.model_args, [tokens]) / run.dims.pp
            if not fake_step_fits(rank, tokens, flops, self.peak_tflops):
                return
            materialize(self.model, self.dist.device, self.optimizers)  # its shards, for the step
        self.stop.install()
        self.checkpointer.load()  # restores self.step / tokens_seen / the data position
        if self.dist.device.type == "cpu":  # the model built (and loaded), no step yet
            log_peak_rss("start-up: max RSS per rank", self.dist.is_main)
        self.first_step = self.step  # the summary counts this invocation's steps
        start = time.perf_counter()
        while self.step < run.cfg.training.steps:
            t0 = time.perf_counter()
            with self.timer.phase("data"):
                step_batch = self.next_step_batch()
            self.step += 1  # counts completed optimizer steps: 1 is the first
            first = self.dist.is_main and self.step == self.first_step + 1  # a line after 30 s
            mbs, unit = len(step_batch.microbatches), "microbatches done"
            with Progress(f"step {self.step}", mbs, unit, enabled=first, announce=False) as self.progress:
                result = self.train_step(step_batch)
            self.tokens_seen += step_batch.real_tokens
            now = time.perf_counter()
            self.train_seconds, self.last_loss = now - start, result["loss"]
            result |= self.validate()
            result |= self.evaluate()
            self.log(step_batch, result, now - t0, now - start)
            self.checkpointer.save(self.step, force=self.step == run.cfg.training.steps)
            # Every rank stops after the same step, whichever ranks the signal reached.
            if dist_utils.any_rank(self.stop.requested):
                self.checkpointer.save(self.step, force=True)
                self.stopped = True
                break
        if self.dist.device.type == "cpu":  # on a GPU the allocator's peak is the figure (not printed yet)
            log_peak_rss("peak memory (max RSS) per rank", self.dist.is_main)

    def _refuse_beyond_host_memory(self) -> None:
        """Refuse what this host (CPU ranks) or a node (offload) cannot hold, before it is allocated."""
        cpu, offload = self.dist.device.type == "cpu", self.run.cfg.activation_checkpoint.offload
        if not self.run.fake and (cpu or offload):
            available = available_host_bytes() if self.dist.is_main and cpu else None
            refuse_beyond_host(self.memory, available, self.run, self.dist.is_main)

    def close(self) -> None:
        """Flush the metrics and restore the signal handlers (the process group stays up: main() ends it)."""
        self.metrics.close()
        self.stop.restore()
        if self.dist.single_rank_group:  # the group of one this trainer started (mixed precision)
            dist_utils.destroy()

    def summary(self, argv: list[str]) -> None:
        """The end of a run: what it did and where it is; a stopped run's stop line after it."""
        ckpt = self.checkpointer
        steps = ckpt.complete_steps() if ckpt.enabled else []
        saved = ckpt.step_dir(steps[-1]) if steps else None
        did = {"first_step": self.first_step, "step": self.step, "tokens": self.tokens_seen}
        did |= {"seconds": self.train_seconds, "loss": self.last_loss, "stopped": self.stopped}
        logger.info("%s", exits.summary_line(self.run.cfg, argv, checkpoint=saved, **did))
        if self.stopped:
            logger.info("%s", exits.stopped_line(self.stop.received, self.step, saved, argv, self.run.cfg))

    # ------------------------------------------------------------------ helpers
    def _init_weights(self, model: nn.Module) -> None:
        """This rank's allocated shards: drawn from training.seed, then (model.hf_path: the folder
        start-up opened) read from the checkpoint, only the slices this rank holds (models/hf/base.py)."""
        init_base(model, self.run.hf, self.run.cfg.training.seed)

    def _validator(self, store, layout) -> Validator | None:
        if store is None:
            return None
        c, padded = self.run.cfg, self.run.spec.padded_forward
        batches = OrderedSteps(
            store.view(layout.T, c.data.overlong), layout, pad_to_multiple=layout.pad_to_multiple
        )
        return Validator(
            c.validation,
            batches,
            runner=self.runner,
            prepare=self.local_inputs,
            loss_mesh=self.run.dims.get_optional_mesh("loss"),
            device=self.dist.device,
            last_step=c.training.steps,
            is_main=self.dist.is_main,
            padded_forward=(lambda t, n: padded(self.model, t, n)) if c.validation.compare_padded else None,
            pad_id=self.run.tokenizer.pad_id,
        )

    def _log_header(self) -> None:
        run = self.run
        for line in header_lines(
            run.cfg,
            flavor=run.flavor,
            dims=run.dims,
            cp_mode=self.cp.mode,
            device=self.dist.device,
            fake=run.fake,
            num_params=self.param_count,
            model_args=run.model_args,
            tokenizer=run.tokenizer,
            optimizers=self.optimizers.optimizers,
            precision=run.precision,
            compile_line=run.compile.describe(),
            loader=self.dataloader,
            validator=self.validator,
            state_line=self.memory.state_line(),
            stage_lines=self.memory.stage_lines(),
            ac_regions=run.spec.ac_regions,
            peak_tflops=self.peak_tflops,
            lora_line="" if run.lora is None else run.lora.describe(self.model),
        ):
            (logger.warning if line.startswith("warning: ") else logger.info)(
                "%s", line.removeprefix("warning: ")
            )


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
        if cfg.job.preflight:  # run_train.sh, before torchrun: NGPU processes to come
            preflight(resolve_run(cfg, env_world_size("NGPU")))
            return 0
        trainer = Trainer(resolve_run(cfg))  # this launch's processes
        trainer.train()
        # The ranks leave together: a rank's exit closes its connections, and gloo can fail an
        # operation that a slower peer still has to post with it.
        dist_utils.barrier()
        if trainer.dist.is_main:
            trainer.summary(argv)
    except KeyboardInterrupt:  # Ctrl-C before the training loop, whose handler stops after a step
        return exits.report("stopped by Ctrl-C before the first step: nothing to save", exits.INTERRUPTED)
    except Exception as e:
        code = exits.failure_code(e)
        if code is None:
            raise  # a bug: its traceback
        return code
    finally:
        if trainer is not None:
            trainer.close()
        dist_utils.destroy()
    return 0


if __name__ == "__main__":
    exits.run_main(main)
