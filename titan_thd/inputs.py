"""What a user gives, checked before any process group exists: the config against the world size
and the model (parallel degrees, context / tensor / expert / pipeline rules), the tokenizer, a Hugging
Face folder, the output folders. `check_inputs` is what the Trainer and `--job.preflight` run first;
every failure is a ValueError naming the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from titan_thd import pipeline
from titan_thd.components.validation import check_path
from titan_thd.config import Config, Parallelism, validate, virtual_stages
from titan_thd.data.rows import RowRule, row_rule
from titan_thd.data.tokenizer import Tokenizer, build_tokenizer
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.models.spec import ModelSpec
from titan_thd.parallel.context_parallel import CPMode, resolve_mode, validate_context_parallel
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.parallel.tensor_parallel import validate_tensor_parallel

# Model config fields that are not model arguments (every other field of [model] that the
# flavor's args dataclass also has overrides the flavor).
_NOT_MODEL_ARGS = ("name", "flavor", "hf_path")


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


def check_inputs(cfg: Config, world_size: int) -> tuple[ModelSpec, Tokenizer, Any, ParallelDims]:
    """(spec, tokenizer, model args, parallel dims) of `cfg` on `world_size` processes: every check that
    needs no process group, no data and no weights (ValueError naming the field, the value and what is
    allowed). An empty model.flavor without model.hf_path is set to the family's default flavor, and
    data.pad_to_multiple = 0 to what the CP mode needs."""
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
    if t.compile and not torch.cuda.is_available() and not any(map(shutil.which, ("g++", "c++", "clang++"))):
        raise ValueError(
            "training.compile = true: torch.compile's CPU backend builds C++ kernels, and no C++ compiler "
            "(g++, c++ or clang++) is on PATH; install one or set training.compile = false"
        )
    _check_folder("job.dump_folder", job.dump_folder, Path(job.dump_folder), writable=True)
    if cfg.data.source != "packed":
        key = "data.cache_dir" if cfg.data.cache_dir else "job.dump_folder"
        cache_dir = cfg.data.cache_dir or os.path.join(job.dump_folder, "data_cache")
        _check_folder(key, cfg.data.cache_dir or job.dump_folder, Path(cache_dir))
    if cfg.checkpoint.enable:
        folder = Path(job.dump_folder) / cfg.checkpoint.folder
        _check_folder("checkpoint.folder", cfg.checkpoint.folder, folder)
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    knobs = [f for f in dataclasses.fields(cfg.model) if f.name not in _NOT_MODEL_ARGS]
    model_overrides = {f.name: getattr(cfg.model, f.name) for f in knobs if hasattr(flavor_args, f.name)}
    # A knob of another model family would otherwise be accepted and silently do nothing.
    foreign = [f for f in knobs if f.name not in model_overrides and getattr(cfg.model, f.name) != f.default]
    if foreign:
        own = ", ".join(f.name for f in knobs if f.name in model_overrides) or "none"
        raise ValueError(
            f"model.{foreign[0].name} = {getattr(cfg.model, foreign[0].name)!r}: model {cfg.model.name} has no "
            f"such setting (its [model] settings: {own}); remove it or use the default {foreign[0].default!r}"
        )
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
    microbatch_rule(cfg, spec, model_args)  # the microbatches the loader can emit, T the largest of them
    try:
        dims = ParallelDims.from_config(p, world_size)
    except ValueError as e:
        raise ValueError(
            f"parallelism (data_parallel_shard_degree {p.data_parallel_shard_degree}, context_parallel_degree "
            f"{p.context_parallel_degree}, tensor_parallel_degree {p.tensor_parallel_degree}, "
            f"pipeline_parallel_degree {p.pipeline_parallel_degree}, expert_parallel_degree "
            f"{p.expert_parallel_degree}) does not fit {world_size} processes: {e}"
        ) from None
    dims.check_implemented()
    check_expert_parallel(p.expert_parallel_degree, model_args, label)
    pipeline_stage_layers(cfg, model_args)
    check_path(cfg)
    if cfg.validation.enable and cfg.validation.compare_padded and spec.padded_forward is None:
        raise ValueError(f"validation.compare_padded = true: model {cfg.model.name} has no padded forward")
    return spec, tokenizer, model_args, dims


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


def check_expert_parallel(ep: int, model_args: Any, model: str) -> None:
    """ep must split the model's routed experts evenly (dp x cp is ParallelDims' check)."""
    if ep == 1:
        return
    n_experts = getattr(model_args, "n_experts", None)
    if n_experts is None:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep}: model {model} has no routed experts; use 1"
        )
    if n_experts % ep:
        raise ValueError(
            f"parallelism.expert_parallel_degree = {ep} does not divide model {model}'s n_experts = "
            f"{n_experts} (every rank holds n_experts / ep experts)"
        )


def pipeline_stage_layers(cfg: Config, model_args: Any) -> list[list[int]] | None:
    """Each pipeline stage's layer ids (ValueError for a split the model cannot have); None at pp 1."""
    p = cfg.parallelism
    if p.pipeline_parallel_degree == 1:
        return None
    return pipeline.stage_layers(
        model_args.n_layers,
        p.pipeline_parallel_degree,
        p.pipeline_parallel_layers_per_stage,
        p.pipeline_parallel_stage_layers,
        virtual_stages(p),
    )


def attention_cost_weight(spec: ModelSpec, args: Any) -> float:
    """Planner weight b of sum(len^2) per unit of tokens, read off the model's FLOPs formula.

    flops(L) = a L + b' L^2 for one document of length L; two lengths give a and b', b = b' / a.
    """
    l1, l2 = 1024, 2048
    f1, f2 = spec.flops_per_step(args, [l1]), spec.flops_per_step(args, [l2])
    b = (f2 / l2 - f1 / l1) / (l2 - l1)
    a = f1 / l1 - b * l1
    return max(0.0, b / a)
