"""The checks of a loaded configuration that need no process group: `validate(cfg)`.

Value ranges, the Literal choices, and the rules between fields of the same run (precision dtypes,
resume allowances, [validation] and [evaluation] against data and parallelism). The rules that need
the model or the world size (each parallelism's divisibility, T against data.pad_to_multiple) live
in titan_thd/startup.py (`resolve_run`), which also runs before any process group exists.
"""

from __future__ import annotations

from titan_thd.config.resume_keys import ADDED, FIXED, RUN_KEYS
from titan_thd.config.schema import CHOICES
from titan_thd.config.sections import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float64": 8}
"""Bytes per element of the dtypes training.dtype and mixed_precision_param name (components/precision.py
asserts them against torch's)."""


def validate(cfg: Config) -> None:
    """Value checks that need no process group. Raises ValueError naming the field and value."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ValueError(f"{key}: got {value!r}, expected one of {', '.join(allowed)}")

    def positive(key: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(
                f"{key}: got {value}, expected a {'non-negative' if allow_zero else 'positive'} value"
            )

    t, p = cfg.training, cfg.parallelism
    positive("training.steps", t.steps)
    positive("training.global_batch_size", t.global_batch_size)
    positive("training.tokens_per_microbatch", t.tokens_per_microbatch)
    positive("training.max_norm", t.max_norm, allow_zero=True)
    positive("training.planner_cost_attention", t.planner_cost_attention, allow_zero=True)
    if cfg.loss.chunked and not 1 <= cfg.loss.chunk_tokens <= t.tokens_per_microbatch:
        raise ValueError(
            f"loss.chunk_tokens: got {cfg.loss.chunk_tokens}, expected 1..{t.tokens_per_microbatch} "
            "(training.tokens_per_microbatch: a chunk of rows of one microbatch); e.g. 1024, or "
            "loss.chunked = false for the full logits"
        )
    ac = cfg.activation_checkpoint
    if ac.offload and ac.mode != "full":
        raise ValueError(
            f"activation_checkpoint.offload = true with mode = {ac.mode!r}: only full recomputation keeps "
            'nothing but each block\'s inputs, which offload moves to host memory; set mode = "full" or '
            "offload = false"
        )
    positive("memory.host_gib", cfg.memory.host_gib, allow_zero=True)
    positive("memory.ranks_per_node", cfg.memory.ranks_per_node, allow_zero=True)
    validate_precision(t.dtype, t.mixed_precision_param, t.mixed_precision_reduce)
    positive("optimizer.lr", cfg.optimizer.lr)
    positive("optimizer.weight_decay", cfg.optimizer.weight_decay, allow_zero=True)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, allow_zero=True)
    positive("lr_scheduler.total_steps", cfg.lr_scheduler.total_steps, allow_zero=True)
    positive("data.pad_to_multiple", cfg.data.pad_to_multiple, allow_zero=True)
    positive("data.num_workers", cfg.data.num_workers, allow_zero=True)
    positive("data.num_samples", cfg.data.num_samples, allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, allow_zero=True)
    positive("metrics.log_freq", cfg.metrics.log_freq)
    positive("metrics.peak_tflops", cfg.metrics.peak_tflops, allow_zero=True)
    positive("optimizer.eps", cfg.optimizer.eps)
    positive("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
    for key in ("beta1", "beta2", "muon_momentum"):
        value = getattr(cfg.optimizer, key)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"optimizer.{key}: got {value}, expected 0 <= value < 1")
    if cfg.lora.enable:
        positive("lora.rank", cfg.lora.rank)
        positive("lora.alpha", cfg.lora.alpha)
        if cfg.optimizer.name == "muon":
            raise ValueError(
                "optimizer.name = muon with lora.enable = true: adapters train with AdamW (Muon "
                "orthogonalises whole matrices, not a rank-r factor); set optimizer.name = adamw"
            )
    if cfg.lora.base_dtype == "released" and not cfg.lora.enable:
        raise ValueError(
            "lora.base_dtype = 'released' without lora.enable = true: only a frozen base can stay as "
            "released (full fine-tuning updates every weight in the master dtype); set lora.enable = true "
            "or lora.base_dtype = 'master'"
        )
    if not 1 <= cfg.optimizer.muon_ns_steps < 100:
        raise ValueError(f"optimizer.muon_ns_steps: got {cfg.optimizer.muon_ns_steps}, expected 1..99")
    if cfg.checkpoint.load_step < -1:
        raise ValueError(
            f"checkpoint.load_step: got {cfg.checkpoint.load_step}, expected -1 (newest) or a step >= 0"
        )
    _validate_allow_changes(cfg.checkpoint.allow_changes)
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_factor: got {cfg.lr_scheduler.min_lr_factor}, expected 0..1")
    if cfg.checkpoint.keep_latest_k == 1:
        raise ValueError("checkpoint.keep_latest_k: got 1, expected 0 (keep all) or >= 2")
    for key in (
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
    ):
        positive(f"parallelism.{key}", getattr(p, key))
    positive("parallelism.hybrid_cp_threshold", p.hybrid_cp_threshold, allow_zero=True)
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ValueError(
            f"parallelism.data_parallel_shard_degree: got {p.data_parallel_shard_degree}, expected -1 or >= 1"
        )
    # The rules of each parallelism, and T against data.pad_to_multiple, need the model and the world
    # size: titan_thd.startup.resolve_run checks them, still before any process group.
    if cfg.data.source in ("jsonl", "parquet", "packed") and not cfg.data.path:
        raise ValueError(f"data.source = {cfg.data.source} needs data.path")
    _validate_validation(cfg)
    _validate_evaluation(cfg)


def validate_precision(dtype: str, param: str, reduce: str) -> None:
    """The combinations of training.dtype, mixed_precision_param and mixed_precision_reduce that cannot
    be, before anything is built (ValueError with the numbers)."""
    width = DTYPE_BYTES
    if param != "auto" and width[param] > width[dtype]:
        raise ValueError(
            f"training.mixed_precision_param = {param} ({width[param]} bytes) is wider than training.dtype = "
            f"{dtype} ({width[dtype]} bytes), the master weights it is cast from: computing in more bits "
            f"than the weights hold adds nothing. Use mixed_precision_param = {dtype} (or auto), or "
            f"training.dtype = {param} for {param} master weights"
        )
    if reduce == "bfloat16" and param not in ("bfloat16", "auto"):
        raise ValueError(
            f"training.mixed_precision_reduce = bfloat16 with mixed_precision_param = {param}: a bf16 "
            f"reduction rounds {width[param]}-byte gradients to 2 bytes without saving any compute; use "
            "mixed_precision_reduce = float32, or mixed_precision_param = bfloat16"
        )


def _validate_allow_changes(names: tuple[str, ...]) -> None:
    for name in names:
        if name in FIXED:
            raise ValueError(
                f"checkpoint.allow_changes: {name} cannot change on a resume (it places the checkpoint's data "
                "position); start a new run in another job.dump_folder instead"
            )
        if name not in RUN_KEYS + ADDED and not name.startswith("model.args."):
            allowed = [k for k in RUN_KEYS + ADDED if k not in FIXED]
            raise ValueError(
                f"checkpoint.allow_changes: got {name!r}, expected run settings among {', '.join(allowed)}, "
                "model.args.<name>"
            )


def _validate_evaluation(cfg: Config) -> None:
    """[evaluation] checks (evaluation.path is read when the trainer starts)."""
    e, p = cfg.evaluation, cfg.parallelism
    if e.freq < 1:
        raise ValueError(f"evaluation.freq: got {e.freq}, expected a positive number of steps")
    if e.limit < 0:
        raise ValueError(
            f"evaluation.limit: got {e.limit}, expected 0 (all) or a positive number of conversations"
        )
    if e.max_new_tokens < 1:
        raise ValueError(
            f"evaluation.max_new_tokens: got {e.max_new_tokens}, expected a positive number of tokens"
        )
    if e.enable and (p.pipeline_parallel_degree > 1 or p.expert_parallel_degree > 1):
        raise ValueError(
            "evaluation.enable = true needs every rank to gather the whole model: got pipeline_parallel_degree "
            f"{p.pipeline_parallel_degree}, expert_parallel_degree {p.expert_parallel_degree}, expected 1 and 1 "
            "(evaluate the checkpoints with scripts/evaluate.py instead)"
        )


def _validate_validation(cfg: Config) -> None:
    """[validation] checks that need no files (validation.path is checked when it is read)."""
    v = cfg.validation
    if v.freq < 1:
        raise ValueError(f"validation.freq: got {v.freq}, expected a positive number of steps")
    if v.max_batches < 0:
        raise ValueError(f"validation.max_batches: got {v.max_batches}, expected 0 (all) or a positive count")
    if not 0.0 <= v.fraction < 1.0:
        raise ValueError(f"validation.fraction: got {v.fraction}, expected 0 < fraction < 1 (0 = not set)")
    if not v.enable:
        return
    if v.fraction and v.path:
        raise ValueError(
            f"validation.fraction = {v.fraction} and validation.path = {v.path!r} both choose the validation "
            "set; set one"
        )
    if not v.fraction and not v.path:
        raise ValueError(
            "validation.enable = true needs a validation set: validation.fraction (0 < fraction < 1) or "
            "validation.path"
        )
    if cfg.data.source == "packed":
        raise ValueError(
            "validation.enable = true with data.source = packed is not supported yet: offline-packed rows have "
            "no per-document split; validate with data.source = jsonl or parquet"
        )
    if v.path and cfg.data.source == "mock":
        raise ValueError(
            f"validation.path = {v.path!r} with data.source = mock: a validation file needs data.source = jsonl "
            "or parquet; for mock data use validation.fraction"
        )
