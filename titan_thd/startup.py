"""Start-up: the config checked against the world size, the model and the machine, and every decision
resolved once into one frozen `Run`, before any process group exists. Nothing after `load_config`
writes the config; everything after start-up reads the `Run` (titan_thd/run.py; tests/test_startup.py
holds both).

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
    check_folders                 here                           the folders the run creates
    resolve (the [lora] section)  lora/resolve.py                targets, the packed base, the base setting

model.hf_path is opened once (models/hf/folder.py `HFFolder`: config.json, the headers, the plan of
every tensor checked against the model built once on the meta device) and the `Run` carries it
(`Run.hf`): the load, the frozen base and the exports read that one folder. What the run reads beyond
the config (data, checkpoint, outputs) is checked by titan_thd/preflight.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from titan_thd.components import hardware, run_settings
from titan_thd.components.precision import resolve_precision
from titan_thd.config import Config, validate
from titan_thd.data.rows import row_rule
from titan_thd.data.stores import check_validation_path
from titan_thd.lora.resolve import resolve as resolve_lora
from titan_thd.models.compile import has_cpp_compiler, resolve_compile
from titan_thd.models.resolve import resolve_model
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.activation_checkpoint import validate_activation_checkpoint
from titan_thd.parallel.context_parallel import (
    default_pad_to_multiple,
    resolve_mode,
    validate_context_parallel,
)
from titan_thd.parallel.distributed import env_device, env_world_size
from titan_thd.parallel.expert_parallel import validate_expert_parallel
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.tensor_parallel import validate_tensor_parallel
from titan_thd.pipeline.split import validate_pipeline
from titan_thd.run import Run


def resolve_run(cfg: Config, world_size: int | None = None) -> Run:
    """`cfg` on `world_size` processes: every check that needs no process group, no data and no weights
    (ValueError naming the field, the value and what is allowed), and every decision they imply.
    `world_size` None: this launch's, torchrun's WORLD_SIZE, or NGPU in a fake-process-group dry run
    (one process stands for them)."""
    validate(cfg)
    fake = cfg.comm.mode == "fake"
    if world_size is None:
        world_size = env_world_size("NGPU" if fake else "WORLD_SIZE")
    spec, flavor, label, tokenizer, model_args, folder = resolve_model(cfg)
    check_folders(cfg)
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
    device = torch.device("cpu") if fake else env_device()
    precision = resolve_precision(
        t.dtype, t.mixed_precision_param, t.mixed_precision_reduce, hardware.detect(device)
    )
    payback = spec.compile.payback_steps if spec.compile is not None else 0
    meta = None
    if folder is not None or cfg.lora.enable:  # names and shapes (no memory): built once
        with torch.device("meta"):
            meta = spec.build(model_args)
    if folder is not None:  # every tensor's plan, checked against the model (headers only)
        folder.sources(model_args, meta)
    released = spec.hf.released if spec.hf is not None else None
    lora, resident = resolve_lora(cfg, spec.lora, meta, label, folder, released)
    settings = run_settings.run_settings(cfg)
    if lora is not None:  # the base the adapters are trained on: a resume needs the same one
        settings[run_settings.BASE] = lora.base
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
        fake=fake,
        precision=precision,
        compile=resolve_compile(t.compile, cfg.model.name, payback, t.steps, device.type),
        lora=lora,
        resident=resident,
        hf=folder,
        meta_model=meta,
        settings=settings,
    )


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
        degree=p.expert_parallel_degree, n_experts=spec.parallel.routed_experts(model_args), model=label
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
    if spec.parallel.te_attention(model_args) and cp > 1:
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


def check_folders(cfg: Config) -> None:
    """ValueError when job.dump_folder (writable), the data cache or the checkpoint folder cannot be a
    folder (each is created when missing): it or a parent is a file."""
    job = cfg.job
    _check_folder("job.dump_folder", job.dump_folder, Path(job.dump_folder), writable=True)
    if cfg.data.source != "packed":
        key = "data.cache_dir" if cfg.data.cache_dir else "job.dump_folder"
        _check_folder(key, cfg.data.cache_dir or job.dump_folder, Path(cfg.data.cache_dir or job.dump_folder))
    if cfg.checkpoint.enable:
        folder = Path(job.dump_folder) / cfg.checkpoint.folder
        _check_folder("checkpoint.folder", cfg.checkpoint.folder, folder)


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
