"""The trainer: one straight-line `__init__` that assembles the parts, one method per loop phase.

    ./run_train.sh --config debug_dense_thd.toml            # torchrun -> main() -> Trainer
    python -m titan_thd.train --help                         # every config field with its doc

Loss (DESIGN.md section 3.5): every microbatch backpropagates
    (sum of token cross-entropy over its trained tokens + its aux-loss sums) / N
where N is the GLOBAL number of trained tokens of the optimizer step (all microbatches, all data-
and context-parallel ranks), known to every rank from the step's plan. Nothing else divides: FSDP
sums gradients over ranks, so loss and gradients do not depend on the parallel layout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_thd.components.checkpoint import CheckpointManager, model_fingerprint
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.components.lr_scheduler import LRSchedulersContainer
from titan_thd.components.metrics import MetricsLogger, peak_tflops_per_rank, step_metrics
from titan_thd.components.optimizer import (
    OptimizersContainer,
    build_optimizers,
    clip_grad_norm_,
    default_matrix_params,
)
from titan_thd.config import Config, help_text, load_config, to_toml, validate
from titan_thd.data.cp_partition import partition
from titan_thd.data.dataloader import StepBatch, THDDataLoader, build_dataloader
from titan_thd.data.packed_batch import PackedBatch
from titan_thd.data.token_store import build_token_store
from titan_thd.data.tokenizer import Tokenizer, build_tokenizer
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.models.batch_meta import BatchMeta, CPContext
from titan_thd.models.spec import ModelSpec, as_dtype, count_params
from titan_thd.parallel import distributed as dist_utils
from titan_thd.parallel.distributed import DistInfo
from titan_thd.parallel.fsdp import (
    build_on_meta,
    estimate_memory_per_rank,
    largest_unsharded_unit_bytes,
    materialize_sharded,
)
from titan_thd.parallel.parallel_dims import ParallelDims

logger = logging.getLogger("titan_thd")

# Model config fields that are not model arguments (every other field of [model] that the
# flavor's args dataclass also has overrides the flavor).
_NOT_MODEL_ARGS = ("name", "flavor", "hf_path")


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
        validate(cfg)
        self.spec = get_model_spec(cfg.model.name)
        flavor_args = get_model_args(cfg.model.name, cfg.model.flavor)
        if p.context_parallel_degree > 1 and p.context_parallel_mode not in self.spec.cp_modes:
            raise ValueError(
                f"parallelism.context_parallel_mode = {p.context_parallel_mode}: model {cfg.model.name} "
                f"computes only {', '.join(self.spec.cp_modes)} exactly"
            )
        init_from_hf = self.spec.hooks.get("init_from_hf")
        if cfg.model.hf_path and init_from_hf is None:
            raise ValueError(
                f"model.hf_path = {cfg.model.hf_path!r}: model {cfg.model.name} cannot be initialised from a "
                "Hugging Face checkpoint (its ModelSpec has no init_from_hf hook); leave model.hf_path empty"
            )
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        model_overrides = {
            f.name: getattr(cfg.model, f.name)
            for f in dataclasses.fields(cfg.model)
            if f.name not in _NOT_MODEL_ARGS and hasattr(flavor_args, f.name)
        }
        if cfg.model.hf_path:  # the checkpoint fixes the embedding size
            vocab_size = hf_vocab_size(cfg.model.hf_path, self.tokenizer.vocab_size)
        else:  # a multiple of 64 rows (matmul-friendly; the extra ids are never seen)
            vocab_size = -(-self.tokenizer.vocab_size // 64) * 64
        self.model_args = dataclasses.replace(flavor_args, vocab_size=vocab_size, **model_overrides)
        local_T = t.tokens_per_microbatch // p.context_parallel_degree
        min_local_T = self.spec.min_tokens_per_cp_rank(self.model_args)
        if local_T < min_local_T:
            raise ValueError(
                f"training.tokens_per_microbatch = {t.tokens_per_microbatch} / context_parallel_degree = "
                f"{p.context_parallel_degree} leaves {local_T} tokens per CP rank; model {cfg.model.name} "
                f"{cfg.model.flavor} needs at least {min_local_T}"
            )
        fake = cfg.comm.mode == "fake"
        world_size = int(os.environ.get("NGPU" if fake else "WORLD_SIZE", "1"))
        self.parallel_dims = ParallelDims.from_config(p, world_size)
        self.parallel_dims.check_implemented()

        self.dist = dist_utils.init_distributed(cfg.comm)
        if t.deterministic:
            torch.use_deterministic_algorithms(True)
        self.parallel_dims.build_meshes(self.dist.device.type)
        cp_mesh = self.parallel_dims.get_optional_mesh("cp")
        self.cp = CPContext(
            size=self.parallel_dims.cp,
            rank=self.parallel_dims.mesh_rank("cp"),
            group=None if cp_mesh is None else cp_mesh.get_group(),
            mode=p.context_parallel_mode,
        )

        store = None  # offline-packed rows (data.source = packed) are read by the dataloader itself
        if cfg.data.source != "packed":
            cache_dir = cfg.data.cache_dir or os.path.join(cfg.job.dump_folder, "data_cache")
            # Rank 0 tokenises first; the others then read its cache instead of repeating the work.
            if self.dist.rank != 0:
                dist_utils.barrier()
            store = build_token_store(cfg.data, self.tokenizer, t.seed, cache_dir, progress=self.dist.is_main)
            if self.dist.rank == 0:
                dist_utils.barrier()
        self.dataloader = build_dataloader(
            cfg.data,
            store,
            dp_rank=self.parallel_dims.mesh_rank("batch"),
            dp_size=self.parallel_dims.dp,
            cp_size=self.parallel_dims.cp,
            tokens_per_microbatch=t.tokens_per_microbatch,
            global_batch_size=t.global_batch_size,
            seed=t.seed,
            planner=t.planner,
            cost_attention=t.planner_cost_attention or attention_cost_weight(self.spec, self.model_args),
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
        if self.spec.parallelize is not None:
            model = self.spec.parallelize(model, self.parallel_dims, p)
        if fake:
            materialize_sharded(model)
        self.model = model.to(self.dist.device).train()

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
            fingerprint=model_fingerprint([self.model], model=cfg.model.name, flavor=cfg.model.flavor),
        )
        # Only one rank writes metrics; it measures the MFU peak while the others wait.
        self.peak_tflops = 0.0
        if self.dist.is_main:
            self.peak_tflops = peak_tflops_per_rank(
                cfg.metrics, as_dtype(t.dtype), self.dist.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            )
        dist_utils.barrier()
        self.metrics = MetricsLogger(cfg.metrics, cfg.job.dump_folder, enabled=self.dist.is_main)
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
        local = (
            partition(microbatch, self.cp.size, self.cp.rank, self.cp.mode) if self.cp.enabled else microbatch
        )
        meta = BatchMeta.from_batch(local, cp=self.cp, full=microbatch, device=self.dist.device)
        out = self.model(local.tokens.to(self.dist.device), meta)
        ce = cross_entropy_sum(
            out.logits, local.labels.to(self.dist.device), local.loss_mask.to(self.dist.device)
        )
        loss = (ce + sum(out.aux_losses.values(), torch.zeros((), device=ce.device))) / num_trained
        loss.backward()
        return ce.detach(), {k: v.detach() for k, v in out.aux_losses.items()}

    def train_step(self, step_batch: StepBatch) -> dict[str, float]:
        """One optimizer step over the microbatches of `step_batch`; returns the global losses."""
        self.optimizers.zero_grad()
        num_trained = max(1, step_batch.trained_tokens)
        ce_sum = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        aux_sums: dict[str, torch.Tensor] = {}
        for microbatch in step_batch.microbatches:
            ce, aux = self.forward_backward(microbatch, num_trained)
            ce_sum += ce
            for k, v in aux.items():
                aux_sums[k] = aux_sums.get(k, 0) + v.double()
        grad_norm = clip_grad_norm_(self.model.parameters(), self.cfg.training.max_norm)
        # The other data/context-parallel ranks hold the rest of the step's token sums.
        loss_mesh = self.parallel_dims.get_optional_mesh("loss")
        losses = {"loss": dist_utils.dist_sum(ce_sum, loss_mesh) / num_trained}
        losses |= {k: dist_utils.dist_sum(v, loss_mesh) / num_trained for k, v in aux_sums.items()}
        result = {"grad_norm": float(grad_norm)} | {k: float(v) for k, v in losses.items()}
        # Global values, the same on every rank: all ranks stop here together, and a bad step
        # never reaches the weights, the optimizer state or a checkpoint.
        if not all(math.isfinite(v) for v in result.values()):
            raise FloatingPointError(
                f"step {self.step}: not finite: "
                + ", ".join(f"{k} = {v}" for k, v in result.items())
                + ". Stopped before the optimizer step: neither the weights nor a checkpoint hold this "
                "step (the newest checkpoint is the last good state); lower optimizer.lr or check the data"
            )
        lr = self.lr_schedulers.current_lr
        self.optimizers.step()
        self.lr_schedulers.step()
        after_step = self.spec.hooks.get("after_optimizer_step")
        if after_step is not None:
            after_step(self.model, None if loss_mesh is None else loss_mesh.get_group())
        return result | {"lr": lr}

    def log(
        self, step_batch: StepBatch, result: dict[str, float], step_time: float, wall_time: float
    ) -> None:
        aux = {k: v for k, v in result.items() if k not in ("loss", "grad_norm", "lr")}
        record = step_metrics(
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
        )
        self.metrics.log(record, last_step=self.cfg.training.steps)

    def train(self) -> None:
        if self.dist.fake and not self._fake_step_fits():
            return
        self.checkpointer.load()  # restores self.step / tokens_seen / the data position
        start = time.perf_counter()
        while self.step < self.cfg.training.steps:
            t0 = time.perf_counter()
            step_batch = self.next_step_batch()
            self.step += 1  # counts completed optimizer steps: 1 is the first
            result = self.train_step(step_batch)
            self.tokens_seen += step_batch.real_tokens
            now = time.perf_counter()
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
        into every slot); skip the step, with the numbers, when that cannot fit in this machine."""
        need = 3 * largest_unsharded_unit_bytes(self.model)  # the unit's params, grads, workspace
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need <= free:
            return True
        logger.warning(
            "dry run: meshes, sharding and optimizer built; the step is skipped because one FSDP unit "
            "needs about %.1f GiB unsharded and this machine has %.1f GiB free",
            need / 2**30,
            free / 2**30,
        )
        return False

    def _log_header(self) -> None:
        if not self.dist.is_main:
            return
        c, d = self.cfg, self.parallel_dims
        logger.info("%s", c.job.description or "titan_thd")
        logger.info(
            "model %s/%s: %s parameters, vocab %d (tokenizer %d), dtype %s",
            c.model.name,
            c.model.flavor,
            f"{count_params(self.model):,}",
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
        logger.info(
            "world %d on %s%s: dp %d, cp %d (%s), tp %d, pp %d",
            d.world_size,
            self.dist.device,
            " (fake process group)" if self.dist.fake else "",
            d.dp,
            d.cp,
            c.parallelism.context_parallel_mode,
            d.tp,
            d.pp,
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


def hf_vocab_size(path: str, tokenizer_vocab: int) -> int:
    """`vocab_size` of a Hugging Face checkpoint's config.json (it must cover the tokenizer's ids)."""
    cfg_file = Path(path) / "config.json"
    try:
        vocab = int(json.loads(cfg_file.read_text())["vocab_size"])
    except FileNotFoundError:
        raise ValueError(f"model.hf_path = {path!r}: {cfg_file} does not exist") from None
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"model.hf_path: {cfg_file} has no integer vocab_size ({e!r})") from None
    if vocab < tokenizer_vocab:
        raise ValueError(
            f"model.hf_path: {cfg_file} has vocab_size = {vocab}, fewer rows than the tokenizer's "
            f"{tokenizer_vocab} ids (data.tokenizer must be the checkpoint's tokenizer)"
        )
    return vocab


def attention_cost_weight(spec: ModelSpec, args: Any) -> float:
    """Planner weight b of sum(len^2) per unit of tokens, read off the model's FLOPs formula.

    flops(L) = a L + b' L^2 for one document of length L; two lengths give a and b', b = b' / a.
    """
    l1, l2 = 1024, 2048
    f1, f2 = spec.flops_per_step(args, [l1]), spec.flops_per_step(args, [l2])
    b = (f2 / l2 - f1 / l1) / (l2 - l1)
    a = f1 / l1 - b * l1
    return max(0.0, b / a)


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
        trainer = Trainer(cfg)
        trainer.train()
        # A rank that finished its last collective may not leave before the others have too:
        # tearing the process group down under a peer's pending receive aborts that peer.
        dist_utils.barrier()
    except ValueError as e:  # user errors: the message says what to fix, a traceback would not
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if trainer is not None:
            trainer.close()
        dist_utils.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
