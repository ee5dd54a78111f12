"""The resolved run: every decision start-up makes (titan_thd/startup.py `resolve_run`), made once and
frozen. What the rest of the program reads instead of the config's raw fields.

    run = resolve_run(cfg, world_size)
    run.flavor, run.cp_mode, run.pad_to_multiple, run.rule, run.layout(dp_rank), run.compile, ...
    plan_memory(run)                      # memory/plan.py: every pipeline rank's memory
    build(model, run, device, init)       # pipeline/runner.py: this rank's part of the model

A module of its own, below start-up: the builders that take the run (memory/, pipeline/) are imported
by start-up's checks, so the record they read cannot live beside those checks (tests/test_imports.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from titan_thd.components.precision import Precision
from titan_thd.config import Config
from titan_thd.data.dataloader import DataLayout
from titan_thd.data.plan import attention_cost_weight
from titan_thd.data.rows import RowRule
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.lora.targets import LoRAPlan, attach, init_adapters
from titan_thd.models.compile import CompileDecision
from titan_thd.models.hf.folder import HFFolder
from titan_thd.models.hf.quant import Format
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.context_parallel import CPMode
from titan_thd.parallel.parallel_dims import ParallelDims


@dataclass(frozen=True)
class Run:
    """Every decision start-up makes, made once: what the rest of the program reads instead of the
    config's raw fields (a field that start-up resolves, e.g. `data.pad_to_multiple = 0`, is read
    from here only). The sections that need no resolving (optimizer, lr_scheduler, checkpoint,
    metrics, ...) are read from `cfg`, which start-up never writes."""

    cfg: Config
    """The configuration as loaded."""
    spec: ModelSpec
    flavor: str
    """model.flavor, or the family's default flavor when empty ("" = the architecture is the config.json
    of model.hf_path)."""
    model_label: str
    """How messages name the model: family and flavor, or the checkpoint whose config.json is read."""
    model_args: Any
    """The flavor's (or config.json's) args with [model.args] and the vocabulary size applied."""
    tokenizer: Tokenizer
    dims: ParallelDims
    stages: list[list[int]] | None
    """Each pipeline stage's layer ids (None without pipeline parallelism)."""
    cp_mode: CPMode
    """parallelism.context_parallel_mode with `auto` resolved to the model's mode."""
    hybrid_threshold: int
    """The padded length from which hybrid CP splits a document (parallelism.hybrid_cp_threshold or T / cp)."""
    pad_to_multiple: int
    """data.pad_to_multiple, 0 resolved to what the CP mode needs."""
    rule: RowRule
    """The row counts every microbatch may have (data/rows.py)."""
    cache_dir: str
    """Where tokenised datasets are cached (data.cache_dir, default <dump_folder>/data_cache)."""
    fake: bool
    """A fake-process-group dry run (comm.mode = fake): shapes and memory, no real collectives."""
    precision: Precision
    """Master, compute and reduction dtypes on this machine (training.mixed_precision_param = auto resolved)."""
    compile: CompileDecision
    """training.compile on this machine for this run (`auto` resolved)."""
    lora: LoRAPlan | None
    """The `[lora]` adapters resolved against the model, with the base setting (lora/resolve.py);
    None = full fine-tuning."""
    resident: dict[str, Format]
    """lora.base_dtype = released: {key: how the folder stores it} of the frozen weights kept as
    released, codes + scales (models/packed_weight.py, planned by lora/resolve.py); empty otherwise."""
    hf: HFFolder | None
    """model.hf_path, opened once at start-up (models/hf/folder.py: config.json, the headers, every
    tensor's plan checked against the model, the fingerprint): what the load, the frozen base and the
    exports read; None without a folder."""
    meta_model: nn.Module | None
    """The model as start-up built it on the meta device, adapters attached (names and shapes: the
    folder's plan and the targets were checked against it); None when start-up needed none. The memory
    plan reads it instead of building another (tests/lora/test_start_up_reads.py counts the builds)."""
    settings: dict[str, Any]
    """What the run trains, stored in checkpoints and run.json (components/run_settings.py), with the
    frozen base's fingerprint under `lora.base` in a LoRA run: a resume against another base is refused."""

    @property
    def after_optimizer_step(self) -> Callable[[nn.Module, Any], None] | None:
        """The family's hook after every optimizer step (dsv4: the router's balancing bias); none in a
        LoRA run, whose base stays exactly what the adapters are served on."""
        return self.spec.after_optimizer_step if self.lora is None else None

    def build_model(self) -> nn.Module:
        """The model as `spec.build` makes it on the current default device (the meta device: shapes
        only), with the LoRA adapters attached and the base frozen; off the meta device the adapters
        are drawn from training.seed, as the trainer draws them."""
        model = self.spec.build(self.model_args)
        if self.lora is not None:
            attach(model, self.lora)
            if next(model.parameters()).device.type != "meta":
                init_adapters(model, self.cfg.training.seed)
        return model

    @property
    def tokens_per_rank(self) -> int:
        """Rows of one microbatch on one context-parallel rank."""
        return self.cfg.training.tokens_per_microbatch // self.dims.cp

    def layout(self, dp_rank: int) -> DataLayout:
        """How replica `dp_rank` plans and cuts its data (data/dataloader.py)."""
        t, p = self.cfg.training, self.cfg.parallelism
        return DataLayout(
            dp_rank=dp_rank,
            dp=self.dims.dp,
            cp=self.dims.cp,
            rule=self.rule,
            global_batch_size=t.global_batch_size,
            seed=t.seed,
            planner=t.planner,
            cost_attention=t.planner_cost_attention
            or attention_cost_weight(self.spec.flops_per_step, self.model_args),
            # Interleaved1F1B runs microbatches in groups of pp (its deadlock-free order for any K keeps
            # more of them in flight when K is not a multiple).
            microbatch_group=self.dims.pp
            if p.pipeline_parallel_schedule == "Interleaved1F1B" and self.dims.pp > 1
            else None,
            hybrid_threshold=self.hybrid_threshold if self.cp_mode == "hybrid" else 0,
            pad_to_multiple=self.pad_to_multiple,
        )
