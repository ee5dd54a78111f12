"""Start-up: the config checked against the world size, the model and the machine, and every decision
resolved once into one frozen `Run`, before any process group exists. Nothing after `load_config`
writes the config; everything after start-up reads the `Run` (tests/test_startup.py holds both).

    run = resolve_run(cfg, world_size)      # ValueError naming the field, the value and the fix
    run.flavor, run.cp_mode, run.pad_to_multiple, run.rule, run.layout(dp_rank), run.compile, ...

Each parallelism keeps its rules in its own module and `resolve_run` calls them in a row, then
the one check of their combinations:

    validate_context_parallel     parallel/context_parallel.py   CP degree, mode, T per rank
    validate_tensor_parallel      parallel/tensor_parallel.py    what tp must divide
    validate_expert_parallel      parallel/expert_parallel.py    ep and the routed experts
    validate_pipeline             pipeline/split.py              schedule, stages, layers
    validate_activation_checkpoint  parallel/activation_checkpoint.py  mode, the model's regions
    ParallelDims                  parallel/parallel_dims.py      the degrees against the world
    validate_combinations         here                           what does not combine (yet)
    row_rule                      data/rows.py                   every microbatch the data can make

`preflight` (--job.preflight, run by run_train.sh before torchrun) resolves the run in one process
and reads what the ranks would read before their first step.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from titan_thd.components import hardware, run_settings
from titan_thd.components.checkpoint import CheckpointManager
from titan_thd.components.checkpoint_folder import checkpoint_steps, model_fingerprint
from titan_thd.components.optimizer import default_matrix_params
from titan_thd.components.precision import Precision, resolve_precision
from titan_thd.config import Config, coerce, validate
from titan_thd.data.dataloader import DataLayout, OrderedSteps, build_dataloader
from titan_thd.data.rows import RowRule, row_rule
from titan_thd.data.stores import build_stores, check_validation_path
from titan_thd.data.tokenizer import Tokenizer, build_tokenizer
from titan_thd.memory.plan import MemoryPlan, plan_memory
from titan_thd.models import get_model_args, get_model_spec, hf
from titan_thd.models.compile import CompileDecision, has_cpp_compiler, resolve_compile
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.activation_checkpoint import validate_activation_checkpoint
from titan_thd.parallel.context_parallel import CPMode, resolve_mode, validate_context_parallel
from titan_thd.parallel.distributed import env_device
from titan_thd.parallel.expert_parallel import validate_expert_parallel
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.tensor_parallel import validate_tensor_parallel
from titan_thd.pipeline.split import validate_pipeline

logger = logging.getLogger("titan_thd")


def hf_vocab_size(path: str, tokenizer_vocab: int) -> int:
    """`vocab_size` of a Hugging Face checkpoint's config.json (it must cover the tokenizer's ids)."""
    folder, cfg_file = Path(path), Path(path) / "config.json"
    if not folder.is_dir():
        raise ValueError(f"model.hf_path = {path!r}: the folder does not exist (or is not a folder)")
    try:
        vocab = json.loads(cfg_file.read_text(encoding="utf-8"))["vocab_size"]
    except FileNotFoundError:
        raise ValueError(f"model.hf_path = {path!r}: {cfg_file} does not exist") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"model.hf_path: {cfg_file}: invalid JSON: {e}") from None
    except (KeyError, TypeError):
        raise ValueError(f"model.hf_path: {cfg_file} has no vocab_size") from None
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise ValueError(f"model.hf_path: {cfg_file}: vocab_size = {vocab!r}, expected a positive integer")
    if vocab < tokenizer_vocab:
        raise ValueError(
            f"model.hf_path: {cfg_file} has vocab_size = {vocab}, fewer rows than the tokenizer's "
            f"{tokenizer_vocab} ids (data.tokenizer must be the checkpoint's tokenizer)"
        )
    return vocab


def env_world_size(name: str) -> int:
    value = os.environ.get(name, "1")
    try:
        world_size = int(value)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ValueError(f"environment variable {name} = {value!r}: expected a positive integer (processes)")
    return world_size


def _check_folder(key: str, value: str, folder: Path, writable: bool = False) -> None:
    """ValueError when `folder` (created when missing) cannot be one: it or a parent is not a folder."""
    for p in (folder, *folder.absolute().parents):
        if not p.exists():
            continue
        if not p.is_dir():
            raise ValueError(f"{key} = {value!r}: {p} exists and is not a folder")
        if writable and not os.access(p, os.W_OK | os.X_OK):
            raise ValueError(f"{key} = {value!r}: {p} is not writable")
        return


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
    device: torch.device
    """This process's device type (cpu on a fake-process-group dry run)."""
    precision: Precision
    """Master, compute and reduction dtypes on this machine (training.mixed_precision_param = auto resolved)."""
    compile: CompileDecision
    """training.compile on this machine for this run (`auto` resolved)."""

    @functools.cached_property
    def memory(self) -> MemoryPlan:
        """Every pipeline rank's memory (memory/plan.py): computed on first use, once (it measures the
        activations of one microbatch: the ranks that print or check it read it)."""
        c = self.cfg
        return plan_memory(
            self.spec,
            self.model_args,
            self.dims,
            self.stages,
            c.parallelism.pipeline_parallel_schedule,
            self.precision,
            c.optimizer.name,
            self.spec.matrix_params or default_matrix_params,
            ac=c.activation_checkpoint,
            tokens=self.tokens_per_rank,
            narrow_ok=self.fake,  # minutes of CPU for a Flash-sized model
            loads_checkpoint=bool(c.model.hf_path) and not self.fake,
        )

    @property
    def fake(self) -> bool:
        """A fake-process-group dry run (comm.mode = fake): shapes and memory, no real collectives."""
        return self.cfg.comm.mode == "fake"

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
            cost_attention=t.planner_cost_attention or attention_cost_weight(self.spec, self.model_args),
            # Interleaved1F1B runs microbatches in groups of pp (its deadlock-free order for any K keeps
            # more of them in flight when K is not a multiple).
            microbatch_group=self.dims.pp
            if p.pipeline_parallel_schedule == "Interleaved1F1B" and self.dims.pp > 1
            else None,
            hybrid_threshold=self.hybrid_threshold if self.cp_mode == "hybrid" else 0,
            pad_to_multiple=self.pad_to_multiple,
        )


def resolve_run(cfg: Config, world_size: int) -> Run:
    """`cfg` on `world_size` processes: every check that needs no process group, no data and no weights
    (ValueError naming the field, the value and what is allowed), and every decision they imply."""
    validate(cfg)
    spec, flavor, label, tokenizer, model_args = _resolve_model(cfg)
    _check_folders(cfg)
    t, p = cfg.training, cfg.parallelism
    if t.compile is True and not torch.cuda.is_available() and not has_cpp_compiler():
        raise ValueError(
            "training.compile = true: torch.compile's CPU backend builds C++ kernels, and no C++ compiler "
            "(g++, c++ or clang++) is on PATH; install one or set training.compile = false"
        )
    cp_mode = resolve_mode(p.context_parallel_mode, label, spec.parallel.cp_mode)
    pad, derived = cfg.data.pad_to_multiple, ""
    if pad == 0:  # what the CP mode needs
        pad = default_pad_to_multiple(p.context_parallel_degree, cp_mode)
        derived = f" (the default for context_parallel_degree {p.context_parallel_degree})"
    if t.tokens_per_microbatch % pad:
        raise ValueError(
            f"training.tokens_per_microbatch = {t.tokens_per_microbatch} is not a multiple of "
            f"data.pad_to_multiple = {pad}{derived}"
        )
    stages = _check_parallelism(cfg, spec, model_args, label, pad)
    try:
        dims = ParallelDims.from_config(p, world_size)
    except ValueError as e:
        raise ValueError(
            f"parallelism (data_parallel_replicate_degree {p.data_parallel_replicate_degree}, "
            f"data_parallel_shard_degree {p.data_parallel_shard_degree}, context_parallel_degree "
            f"{p.context_parallel_degree}, tensor_parallel_degree {p.tensor_parallel_degree}, "
            f"pipeline_parallel_degree {p.pipeline_parallel_degree}, expert_parallel_degree "
            f"{p.expert_parallel_degree}) does not fit {world_size} processes: {e}"
        ) from None
    rule = row_rule(  # the microbatches the loader can emit, T the largest of them
        T=t.tokens_per_microbatch,
        pad_to_multiple=pad,
        cp=p.context_parallel_degree,
        cp_mode=cp_mode,
        tp=p.tensor_parallel_degree,
        # Pipeline stages exchange fixed shapes: every microbatch has T rows.
        fixed=not cfg.data.trim_padding or p.pipeline_parallel_degree > 1,
        min_tokens_per_cp_rank=spec.parallel.min_tokens_per_cp_rank(model_args),
        model=f"model {label}",
    )
    check_validation_path(cfg.validation, cfg.data.source)
    device = torch.device("cpu") if cfg.comm.mode == "fake" else env_device()
    precision = resolve_precision(
        t.dtype, t.mixed_precision_param, t.mixed_precision_reduce, hardware.detect(device)
    )
    payback = spec.compile.payback_steps if spec.compile is not None else 0
    return Run(
        cfg=cfg,
        spec=spec,
        flavor=flavor,
        model_label=label,
        model_args=model_args,
        tokenizer=tokenizer,
        dims=dims,
        stages=stages,
        cp_mode=cp_mode,
        hybrid_threshold=p.hybrid_cp_threshold or t.tokens_per_microbatch // p.context_parallel_degree,
        pad_to_multiple=pad,
        rule=rule,
        cache_dir=cfg.data.cache_dir or os.path.join(cfg.job.dump_folder, "data_cache"),
        device=device,
        precision=precision,
        compile=resolve_compile(t.compile, cfg.model.name, payback, t.steps, device.type),
    )


def _resolve_model(cfg: Config) -> tuple[ModelSpec, str, str, Tokenizer, Any]:
    """(spec, flavor, label, tokenizer, model args) of the configured model; a checkpoint's config.json
    and safetensors headers are read (never its weights)."""
    m = cfg.model
    spec = get_model_spec(m.name)
    if m.hf_path and (spec.hf is None or not spec.hf.initialises):
        raise ValueError(
            f"model.hf_path = {m.hf_path!r}: model {m.name} cannot be initialised from a "
            "Hugging Face checkpoint (its ModelSpec has no init_from_hf hook); leave model.hf_path empty"
        )
    # An empty flavor with a checkpoint: the architecture is the checkpoint's config.json (read below,
    # once the folder is known to exist); its args dataclass is the default flavor's.
    from_hf = bool(m.hf_path) and not m.flavor
    if from_hf and spec.hf is None:
        raise ValueError(
            f"model.flavor is empty: model {m.name} cannot read its architecture from "
            f"model.hf_path = {m.hf_path!r}; give model.flavor (one of {', '.join(spec.flavors)})"
        )
    # Named from here on (log header, checkpoint fingerprint): a run that leaves it empty resumes
    # one that named the default and the other way round.
    flavor = m.flavor or ("" if from_hf else spec.default_flavor or next(iter(spec.flavors)))
    label = model_label(m.name, flavor, m.hf_path)
    base_args = get_model_args(m.name, flavor)  # "": the default flavor's dataclass, replaced below
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    overrides = model_args_table(m.args, base_args, m.name)
    if m.hf_path:  # the checkpoint fixes the embedding size
        vocab_size = hf_vocab_size(m.hf_path, tokenizer.vocab_size)
    else:  # a multiple of 64 rows (matmul-friendly; the extra ids are never seen)
        vocab_size = -(-tokenizer.vocab_size // 64) * 64
    if from_hf:
        base_args = hf.folder_args(spec, m.hf_path)
    model_args = dataclasses.replace(base_args, vocab_size=vocab_size, **overrides)
    if m.hf_path and spec.hf is not None:  # config.json and the safetensors headers only
        hf.check(spec,
            model_args, m.hf_path, "its own config.json" if from_hf else f"model.flavor = {flavor!r}"
        )
    return spec, flavor, label, tokenizer, model_args


def _check_folders(cfg: Config) -> None:
    job = cfg.job
    _check_folder("job.dump_folder", job.dump_folder, Path(job.dump_folder), writable=True)
    if cfg.data.source != "packed":
        key = "data.cache_dir" if cfg.data.cache_dir else "job.dump_folder"
        _check_folder(key, cfg.data.cache_dir or job.dump_folder, Path(cfg.data.cache_dir or job.dump_folder))
    if cfg.checkpoint.enable:
        folder = Path(job.dump_folder) / cfg.checkpoint.folder
        _check_folder("checkpoint.folder", cfg.checkpoint.folder, folder)


def _check_parallelism(
    cfg: Config, spec: ModelSpec, model_args: Any, label: str, pad_to_multiple: int
) -> list[list[int]] | None:
    """Each parallelism's own rules, then their combinations; returns the pipeline stages."""
    t, p = cfg.training, cfg.parallelism
    validate_context_parallel(
        degree=p.context_parallel_degree,
        configured_mode=p.context_parallel_mode,
        model=label,
        model_mode=spec.parallel.cp_mode,
        tokens_per_microbatch=t.tokens_per_microbatch,
        pad_to_multiple=pad_to_multiple,
        min_tokens_per_rank=spec.parallel.min_tokens_per_cp_rank(model_args),
    )
    validate_tensor_parallel(
        degree=p.tensor_parallel_degree,
        divides=spec.parallel.tp_divides(model_args),
        tokens_per_cp_rank=t.tokens_per_microbatch // p.context_parallel_degree,
        model=label,
    )
    validate_expert_parallel(
        degree=p.expert_parallel_degree, n_experts=getattr(model_args, "n_experts", None), model=label
    )
    stages = validate_pipeline(p, model_args.n_layers, spec.pipeline, label)
    ac = cfg.activation_checkpoint
    validate_activation_checkpoint(
        mode=ac.mode,
        regions=ac.regions,
        layers=ac.layers,
        model_regions=spec.ac_regions,
        n_layers=model_args.n_layers,
        model=label,
    )
    validate_combinations(cfg, spec, model_args)
    return stages


def validate_combinations(cfg: Config, spec: ModelSpec, model_args: Any) -> None:
    """What each parallelism's own rules accept but the combination cannot run (yet), and the
    switches a model must opt into (from the degrees alone: before they are fitted to the world)."""
    p = cfg.parallelism
    pp, cp = p.pipeline_parallel_degree, p.context_parallel_degree
    if getattr(model_args, "attention_backend", "native") == "te" and cp > 1:
        raise ValueError(
            f"model.args.attention_backend = te with context_parallel_degree = {cp}: Transformer Engine "
            "attention runs without context parallelism only; use attention_backend = native or cp 1"
        )
    if cfg.activation_checkpoint.mode != "none" and spec.parallelize is None:
        raise ValueError(
            f"activation_checkpoint.mode = {cfg.activation_checkpoint.mode!r}: model {cfg.model.name} has no "
            'parallelize (which applies the recomputation); set mode = "none"'
        )
    if cfg.training.compile is True and spec.compile is None:
        raise ValueError(
            f"training.compile = true: model {cfg.model.name} has no compile hook; set it to false"
        )
    v = cfg.validation
    if v.enable and v.compare_padded:
        if spec.padded_forward is None:
            raise ValueError(
                f"validation.compare_padded = true: model {cfg.model.name} has no padded forward"
            )
        if cp > 1 or pp > 1:
            raise ValueError(
                "validation.compare_padded = true needs whole documents on one rank: got "
                f"context_parallel_degree {cp}, pipeline_parallel_degree {pp}, expected 1 and 1"
            )


def default_pad_to_multiple(cp_degree: int, cp_mode: CPMode) -> int:
    """data.pad_to_multiple = 0: 2 * cp where documents are zigzagged (zigzag, and hybrid's long ones),
    else 1 (contiguous CP splits rows, not documents)."""
    return 2 * cp_degree if cp_degree > 1 and cp_mode != "contiguous" else 1


def model_label(name: str, flavor: str, hf_path: str) -> str:
    """How messages name the model: family and flavor, or the checkpoint whose config.json is read."""
    return f"{name} {flavor}" if flavor else f"{name} (config.json of {hf_path})"


def model_args_table(table: dict[str, Any], flavor_args: Any, model: str) -> dict[str, Any]:
    """[model.args] as typed overrides of the flavor's args dataclass; ValueError for a name the model
    does not have (with its list) or a value of the wrong type."""
    hints = typing.get_type_hints(type(flavor_args))
    own = [f.name for f in dataclasses.fields(flavor_args) if f.name != "vocab_size"]
    out = {}
    for name, value in table.items():
        if name == "vocab_size":
            raise ValueError(
                "model.args.vocab_size: the vocabulary is the tokenizer's (rounded up to a multiple of 64) or "
                "the Hugging Face checkpoint's; remove it"
            )
        if name not in own:
            raise ValueError(
                f"model.args.{name}: model {model} has no such setting; its settings: {', '.join(own)}"
            )
        out[name] = coerce(f"model.args.{name}", value, hints[name], from_cli=isinstance(value, str))
    return out


def preflight(cfg: Config) -> None:
    """Read what a run of NGPU processes (env, default 1) would read before its first step, in this one
    process and without a process group: the configuration and layout, the tokenizer, the data (tokenised
    into the cache that the run then reuses), the Hugging Face config, the checkpoint to resume.
    run_train.sh runs it before torchrun, so that an input error is one line and not torchrun's failure
    report."""
    run = resolve_run(cfg, env_world_size("NGPU"))
    layout = run.layout(dp_rank=0)
    store = None
    if cfg.data.source != "packed":
        store, val_store = build_stores(
            cfg.data, cfg.validation, run.tokenizer, cfg.training.seed, run.cache_dir, progress=True
        )
        if val_store is not None:
            OrderedSteps(
                val_store.view(layout.T, cfg.data.overlong), layout, pad_to_multiple=run.pad_to_multiple
            )
    build_dataloader(dataclasses.replace(cfg.data, num_workers=0), store, layout, run.tokenizer)
    if cfg.checkpoint.enable:  # the fingerprint has global shapes: a model on the meta device has them
        model = build_on_meta(lambda: run.spec.build(run.model_args))
        checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model=model,
            optimizer=None,
            lr_schedulers=[],
            states={},
            fingerprint=model_fingerprint([model], model=cfg.model.name, flavor=run.flavor),
            settings=run_settings.run_settings(cfg),
            layout=run_settings.run_layout(run.dims, cfg.training.steps),
        )
        checkpointer.check_resumable()
    check_outputs(cfg)
    logger.info("preflight: inputs of a %d-process run are fine", run.dims.world_size)


def check_outputs(cfg: Config) -> None:
    """ValueError when a new run would replace another run's metrics in job.dump_folder
    (components/run_settings.py check_run_folder)."""
    checkpoints = checkpoint_steps(Path(cfg.job.dump_folder) / cfg.checkpoint.folder)
    run_settings.check_run_folder(cfg, checkpoints)


def attention_cost_weight(spec: ModelSpec, args: Any) -> float:
    """Planner weight b of sum(len^2) per unit of tokens, read off the model's FLOPs formula.

    flops(L) = a L + b' L^2 for one document of length L; two lengths give a and b', b = b' / a.
    """
    l1, l2 = 1024, 2048
    f1, f2 = spec.flops_per_step(args, [l1]), spec.flops_per_step(args, [l2])
    b = (f2 / l2 - f1 / l1) / (l2 - l1)
    a = f1 / l1 - b * l1
    return max(0.0, b / a)
