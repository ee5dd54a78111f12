"""What a user gives, checked before any process group exists: the config against the world size
and the model, the tokenizer, a Hugging Face folder, the output folders. `check_inputs` is what the
Trainer and `--job.preflight` run first; every failure is a ValueError naming the field, the value
and what is allowed.

Each parallelism keeps its rules in its own module and `check_inputs` calls them in a row, then
the one check of their combinations:

    validate_context_parallel     parallel/context_parallel.py   CP degree, mode, T per rank
    validate_tensor_parallel      parallel/tensor_parallel.py    what tp must divide
    validate_expert_parallel      parallel/expert_parallel.py    ep and the routed experts
    validate_pipeline             pipeline/split.py              schedule, stages, layers
    validate_activation_checkpoint  parallel/activation_checkpoint.py  mode, the model's regions
    ParallelDims                  parallel/parallel_dims.py      the degrees against the world
    validate_combinations         here                           what does not combine (yet)
    microbatch_rule               here (data/rows.py)            every microbatch the data can make
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import typing
from pathlib import Path
from typing import Any, NamedTuple

import torch

from titan_thd.components import hardware, run_settings
from titan_thd.components.checkpoint import CheckpointManager, checkpoint_steps, model_fingerprint
from titan_thd.components.precision import Precision, resolve_precision
from titan_thd.config import Config, Parallelism, coerce, validate
from titan_thd.data.dataloader import DataLayout, OrderedSteps, build_dataloader
from titan_thd.data.rows import RowRule, row_rule
from titan_thd.data.stores import build_stores, check_validation_path
from titan_thd.data.tokenizer import Tokenizer, build_tokenizer
from titan_thd.models import get_model_args, get_model_spec
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


class Inputs(NamedTuple):
    """What `check_inputs` derives from a config that passed."""

    spec: ModelSpec
    tokenizer: Tokenizer
    model_args: Any
    dims: ParallelDims
    stages: list[list[int]] | None
    """Each pipeline stage's layer ids (None without pipeline parallelism)."""
    precision: Precision
    """Master, compute and reduction dtypes on this machine (training.mixed_precision_param = auto resolved)."""
    compile: CompileDecision
    """training.compile on this machine for this run (`auto` resolved)."""


def check_inputs(cfg: Config, world_size: int) -> Inputs:
    """`cfg` on `world_size` processes: every check that needs no process group, no data and no weights
    (ValueError naming the field, the value and what is allowed). An empty model.flavor without
    model.hf_path is set to the family's default flavor, and data.pad_to_multiple = 0 to what the CP
    mode needs."""
    t, p, job = cfg.training, cfg.parallelism, cfg.job
    validate(cfg)
    spec = get_model_spec(cfg.model.name)
    if cfg.model.hf_path and spec.init_from_hf is None:
        raise ValueError(
            f"model.hf_path = {cfg.model.hf_path!r}: model {cfg.model.name} cannot be initialised from a "
            "Hugging Face checkpoint (its ModelSpec has no init_from_hf hook); leave model.hf_path empty"
        )
    # An empty flavor with a checkpoint: the architecture is the checkpoint's config.json (read below,
    # once the folder is known to exist); its args dataclass is the default flavor's.
    from_hf = bool(cfg.model.hf_path) and not cfg.model.flavor
    if from_hf and spec.hf_args is None:
        raise ValueError(
            f"model.flavor is empty: model {cfg.model.name} cannot read its architecture from "
            f"model.hf_path = {cfg.model.hf_path!r}; give model.flavor (one of {', '.join(spec.flavors)})"
        )
    if not cfg.model.flavor and not from_hf:
        # Named from here on (log header, checkpoint fingerprint): a run that leaves it empty resumes
        # one that named the default and the other way round.
        cfg.model.flavor = spec.default_flavor or next(iter(spec.flavors))
    flavor_args = get_model_args(cfg.model.name, cfg.model.flavor)
    label = model_label(cfg)
    if t.compile is True and not torch.cuda.is_available() and not has_cpp_compiler():
        raise ValueError(
            "training.compile = true: torch.compile's CPU backend builds C++ kernels, and no C++ compiler "
            "(g++, c++ or clang++) is on PATH; install one or set training.compile = false"
        )
    _check_folder("job.dump_folder", job.dump_folder, Path(job.dump_folder), writable=True)
    if cfg.data.source != "packed":
        key = "data.cache_dir" if cfg.data.cache_dir else "job.dump_folder"
        _check_folder(key, cfg.data.cache_dir or job.dump_folder, Path(cache_dir(cfg)))
    if cfg.checkpoint.enable:
        folder = Path(job.dump_folder) / cfg.checkpoint.folder
        _check_folder("checkpoint.folder", cfg.checkpoint.folder, folder)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    model_overrides = model_args_table(cfg.model.args, flavor_args, cfg.model.name)
    if cfg.model.hf_path:  # the checkpoint fixes the embedding size
        vocab_size = hf_vocab_size(cfg.model.hf_path, tokenizer.vocab_size)
    else:  # a multiple of 64 rows (matmul-friendly; the extra ids are never seen)
        vocab_size = -(-tokenizer.vocab_size // 64) * 64
    if from_hf:
        flavor_args = spec.hf_args(cfg.model.hf_path)
    model_args = dataclasses.replace(flavor_args, vocab_size=vocab_size, **model_overrides)
    if (
        cfg.model.hf_path and spec.check_hf is not None
    ):  # config.json and the safetensors headers only: before any weight is built or read
        name = "its own config.json" if from_hf else f"model.flavor = {cfg.model.flavor!r}"
        spec.check_hf(model_args, cfg.model.hf_path, name)
    derived = ""
    if cfg.data.pad_to_multiple == 0:  # what the CP mode needs; set here, before anything reads it
        cfg.data.pad_to_multiple = default_pad_to_multiple(p, spec.cp_mode)
        derived = f" (the default for context_parallel_degree {p.context_parallel_degree})"
    if t.tokens_per_microbatch % cfg.data.pad_to_multiple:
        raise ValueError(
            f"training.tokens_per_microbatch = {t.tokens_per_microbatch} is not a multiple of "
            f"data.pad_to_multiple = {cfg.data.pad_to_multiple}{derived}"
        )
    validate_context_parallel(
        degree=p.context_parallel_degree,
        configured_mode=p.context_parallel_mode,
        model=label,
        model_mode=spec.cp_mode,
        tokens_per_microbatch=t.tokens_per_microbatch,
        pad_to_multiple=cfg.data.pad_to_multiple,
        min_tokens_per_rank=spec.min_tokens_per_cp_rank(model_args),
    )
    validate_tensor_parallel(
        degree=p.tensor_parallel_degree,
        divides=spec.tp_divides(model_args),
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
    microbatch_rule(cfg, spec, model_args)  # the microbatches the loader can emit, T the largest of them
    check_validation_path(cfg.validation, cfg.data.source)
    device = torch.device("cpu") if cfg.comm.mode == "fake" else env_device()
    precision = resolve_precision(
        t.dtype, t.mixed_precision_param, t.mixed_precision_reduce, hardware.detect(device)
    )
    payback = spec.compile_payback_steps if spec.compile is not None else 0
    compile_choice = resolve_compile(t.compile, cfg.model.name, payback, t.steps, device.type)
    t.compile = compile_choice.on  # resolved here, like the flavor: what builds the model reads a bool
    return Inputs(spec, tokenizer, model_args, dims, stages, precision, compile_choice)


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


def microbatch_rule(cfg: Config, spec: ModelSpec, model_args: Any) -> RowRule:
    """The row counts every microbatch may have (data/rows.py): start-up refuses a T that breaks the rule,
    the training and validation loaders size every microbatch by it. Needs data.pad_to_multiple resolved
    (check_inputs does that)."""
    p = cfg.parallelism
    return row_rule(
        T=cfg.training.tokens_per_microbatch,
        pad_to_multiple=cfg.data.pad_to_multiple,
        cp=p.context_parallel_degree,
        cp_mode=resolve_mode(p.context_parallel_mode, cfg.model.name, spec.cp_mode),
        tp=p.tensor_parallel_degree,
        # Pipeline stages exchange fixed shapes: every microbatch has T rows.
        fixed=not cfg.data.trim_padding or p.pipeline_parallel_degree > 1,
        min_tokens_per_cp_rank=spec.min_tokens_per_cp_rank(model_args),
        model=f"model {model_label(cfg)}",
    )


def default_pad_to_multiple(p: Parallelism, model_mode: CPMode) -> int:
    """data.pad_to_multiple = 0: 2 * cp where documents are zigzagged (zigzag, and hybrid's long ones),
    else 1 (contiguous CP splits rows, not documents)."""
    mode = model_mode if p.context_parallel_mode == "auto" else p.context_parallel_mode
    return 2 * p.context_parallel_degree if p.context_parallel_degree > 1 and mode != "contiguous" else 1


def model_label(cfg: Config) -> str:
    """How messages name the model: family and flavor, or the checkpoint whose config.json is read."""
    m = cfg.model
    return f"{m.name} {m.flavor}" if m.flavor else f"{m.name} (config.json of {m.hf_path})"


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


def hybrid_threshold(cfg: Config) -> int:
    """The padded length from which hybrid CP splits a document (default T / cp)."""
    p = cfg.parallelism
    return p.hybrid_cp_threshold or cfg.training.tokens_per_microbatch // p.context_parallel_degree


def data_layout(
    cfg: Config, dims: ParallelDims, spec: ModelSpec, model_args: Any, dp_rank: int
) -> DataLayout:
    """How replica `dp_rank` plans and cuts its data under this layout (data/dataloader.py)."""
    t, p = cfg.training, cfg.parallelism
    mode = resolve_mode(p.context_parallel_mode, cfg.model.name, spec.cp_mode)
    return DataLayout(
        dp_rank=dp_rank,
        dp=dims.dp,
        cp=dims.cp,
        rule=microbatch_rule(cfg, spec, model_args),
        global_batch_size=t.global_batch_size,
        seed=t.seed,
        planner=t.planner,
        cost_attention=t.planner_cost_attention or attention_cost_weight(spec, model_args),
        # Interleaved1F1B runs microbatches in groups of pp (its deadlock-free order for any K keeps
        # more of them in flight when K is not a multiple).
        microbatch_group=dims.pp
        if p.pipeline_parallel_schedule == "Interleaved1F1B" and dims.pp > 1
        else None,
        hybrid_threshold=hybrid_threshold(cfg) if mode == "hybrid" else 0,
    )


def cache_dir(cfg: Config) -> str:
    """Where tokenised datasets are cached (data.cache_dir, default <dump_folder>/data_cache)."""
    return cfg.data.cache_dir or os.path.join(cfg.job.dump_folder, "data_cache")


def preflight(cfg: Config) -> None:
    """Read what a run of NGPU processes (env, default 1) would read before its first step, in this one
    process and without a process group: the configuration and layout, the tokenizer, the data (tokenised
    into the cache that the run then reuses), the Hugging Face config, the checkpoint to resume.
    run_train.sh runs it before torchrun, so that an input error is one line and not torchrun's failure
    report."""
    inputs = check_inputs(cfg, env_world_size("NGPU"))
    layout = data_layout(cfg, inputs.dims, inputs.spec, inputs.model_args, dp_rank=0)
    store = None
    if cfg.data.source != "packed":
        store, val_store = build_stores(
            cfg.data, cfg.validation, inputs.tokenizer, cfg.training.seed, cache_dir(cfg), progress=True
        )
        if val_store is not None:
            OrderedSteps(
                val_store.view(layout.T, cfg.data.overlong), layout, pad_to_multiple=cfg.data.pad_to_multiple
            )
    build_dataloader(dataclasses.replace(cfg.data, num_workers=0), store, layout, inputs.tokenizer)
    if cfg.checkpoint.enable:  # the fingerprint has global shapes: a model on the meta device has them
        model = build_on_meta(lambda: inputs.spec.build(inputs.model_args))
        checkpointer = CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model=model,
            optimizer=None,
            lr_schedulers=[],
            states={},
            fingerprint=model_fingerprint([model], model=cfg.model.name, flavor=cfg.model.flavor),
            settings=run_settings.run_settings(cfg),
            layout=run_settings.run_layout(inputs.dims, cfg.training.steps),
        )
        checkpointer.check_resumable()
    check_outputs(cfg)
    logger.info("preflight: inputs of a %d-process run are fine", inputs.dims.world_size)


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
