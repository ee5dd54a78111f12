"""The stage split: which layers each pipeline stage runs, and each rank's part of the model.

A model of n layers is cut into S stages of consecutive layers. With 1F1B and GPipe S = pp, one
stage per rank. With Interleaved1F1B S = pp x v: rank r runs the v stages r, r + pp, r + 2pp, ...
(its "virtual stages" or model chunks), so a microbatch visits every rank v times and the pipeline
bubble shrinks by v. The embedding belongs to stage 0 (rank 0), the final norm and head to stage
S - 1 (rank pp - 1).

Each rank keeps one module, `split_model`'s: the full model with the other ranks' layers deleted
(FQNs such as `layers.7` stay, so checkpoints reshard across pipeline layouts). `chunk_views` gives
the module of each of its stages: a shallow view that shares its submodules with that rank module
and holds only the stage's layers, so the views run the forward passes while the rank module owns
the parameters (optimizer, checkpoint).

Nothing here knows a model: which top-level modules sit on the first and last stages, which are
tied and what crosses a stage boundary is the model's `PipelineSpec` (models/spec.py).
"""

from __future__ import annotations

import collections
import copy

from torch import nn

from titan_thd.config import Parallelism
from titan_thd.models.spec import PipelineSpec


# ============================================================================ start-up rules
def parse_stage_layers(text: str) -> list[list[int]]:
    """`0-2|3,4|5` -> [[0, 1, 2], [3, 4], [5]]; ValueError naming the bad part."""
    key = "parallelism.pipeline_parallel_stage_layers"
    stages: list[list[int]] = []
    for i, part in enumerate(text.split("|")):
        ids: list[int] = []
        for item in (x.strip() for x in part.split(",")):
            lo, sep, hi = item.partition("-")
            try:
                ids += list(range(int(lo), int(hi) + 1)) if sep else [int(item)]
            except ValueError:
                raise ValueError(
                    f"{key} = {text!r}: stage {i} has {item!r}, expected layer ids like 0,1 or ranges like 0-3"
                ) from None
        stages.append(ids)
    return stages


def virtual_stages(p: Parallelism) -> int:
    """Pipeline stages per rank: pipeline_parallel_virtual_stages, or its default for the schedule."""
    if p.pipeline_parallel_virtual_stages:
        return p.pipeline_parallel_virtual_stages
    return 2 if p.pipeline_parallel_schedule == "Interleaved1F1B" else 1


def validate_pipeline(
    p: Parallelism, n_layers: int, pipeline: PipelineSpec | None, model: str
) -> list[list[int]] | None:
    """Every pipeline rule of a run, before any process group exists; returns each stage's layer ids
    (None at pp 1). ValueError with the numbers for a split, a schedule or a model that cannot be."""
    if p.pipeline_parallel_layers_per_stage < 0:
        raise ValueError(
            f"parallelism.pipeline_parallel_layers_per_stage: got {p.pipeline_parallel_layers_per_stage}, "
            "expected 0 (an even split) or >= 1"
        )
    v, schedule = p.pipeline_parallel_virtual_stages, p.pipeline_parallel_schedule
    if v < 0 or (v == 1 and schedule == "Interleaved1F1B") or (v > 1 and schedule != "Interleaved1F1B"):
        raise ValueError(
            f"parallelism.pipeline_parallel_virtual_stages = {v} with pipeline_parallel_schedule = "
            f"{schedule}: expected 0 (auto), or >= 2 with Interleaved1F1B only"
        )
    if p.pipeline_parallel_stage_layers and p.pipeline_parallel_layers_per_stage:
        raise ValueError(
            "parallelism.pipeline_parallel_stage_layers and pipeline_parallel_layers_per_stage = "
            f"{p.pipeline_parallel_layers_per_stage} both set the stage split; set one"
        )
    if p.pipeline_parallel_stage_layers:  # its syntax, whatever the degree
        parse_stage_layers(p.pipeline_parallel_stage_layers)
    if p.pipeline_parallel_degree == 1:
        return None
    if pipeline is None:
        raise ValueError(
            f"parallelism.pipeline_parallel_degree = {p.pipeline_parallel_degree}: model {model} has no "
            "pipeline stage split (its ModelSpec has no `pipeline`); use 1"
        )
    return stage_layers(
        n_layers,
        p.pipeline_parallel_degree,
        p.pipeline_parallel_layers_per_stage,
        p.pipeline_parallel_stage_layers,
        virtual_stages(p),
    )


# ============================================================================ stage split
def stage_layers(
    n_layers: int, pp: int, layers_per_stage: int = 0, explicit: str = "", virtual: int = 1
) -> list[list[int]]:
    """Layer ids of each of the pp x `virtual` stages (stage s runs on rank s % pp); ValueError
    (one line, with the numbers) for a split that cannot be."""
    key = "parallelism.pipeline_parallel"
    n_stages = pp * virtual
    what = f"pipeline_parallel_degree = {pp}" + (
        f" x virtual_stages {virtual} = {n_stages}" if virtual > 1 else ""
    )
    if explicit:
        stages = parse_stage_layers(explicit)
        flat = [i for s in stages for i in s]
        counts = collections.Counter(flat)
        if len(stages) != n_stages:
            raise ValueError(f"{key}_stage_layers = {explicit!r} has {len(stages)} stages, {what}")
        if empty := [i for i, s in enumerate(stages) if not s]:
            raise ValueError(f"{key}_stage_layers = {explicit!r}: stage {empty[0]} has no layers")
        if bad := sorted(i for i in counts if not 0 <= i < n_layers):
            raise ValueError(
                f"{key}_stage_layers = {explicit!r}: layer {bad[0]} does not exist (0..{n_layers - 1})"
            )
        if repeated := sorted(i for i, c in counts.items() if c > 1):
            raise ValueError(f"{key}_stage_layers = {explicit!r} repeats layer(s) {repeated}")
        if missing := sorted(set(range(n_layers)) - set(flat)):
            raise ValueError(f"{key}_stage_layers = {explicit!r} misses layer(s) {missing} of {n_layers}")
        if flat != sorted(flat):
            raise ValueError(f"{key}_stage_layers = {explicit!r}: layers must run in order across stages")
        return stages
    if n_stages > n_layers:
        degree = f"{key}_degree = {pp}" + (f" x {key}_virtual_stages = {virtual}" if virtual > 1 else "")
        raise ValueError(f"{degree}: more stages ({n_stages}) than the model's {n_layers} layers")
    if layers_per_stage:
        if layers_per_stage * n_stages != n_layers:
            raise ValueError(
                f"{key}_layers_per_stage = {layers_per_stage} x {n_stages} stages = "
                f"{layers_per_stage * n_stages}, but the model has {n_layers} layers"
            )
        sizes = [layers_per_stage] * n_stages
    else:  # even, the remainder on the first stages
        sizes = [n_layers // n_stages + (s < n_layers % n_stages) for s in range(n_stages)]
    starts = [sum(sizes[:s]) for s in range(n_stages)]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]


def split_model(
    pipeline: PipelineSpec,
    model: nn.Module,
    layers: list[list[int]],
    rank: int,
    pp: int = 0,
    tied: tuple[str, ...] = (),
) -> nn.Module:
    """This rank's part of a full model, in place: the layers of its stages (rank, rank + pp, ...)
    stay, the others are deleted, and the first / last stage's top-level modules are set to None
    where they do not belong (`tied` ones, `pipeline.tied` of the full model, stay on the last stage
    too). `pp` defaults to one stage per rank."""
    pp = pp or len(layers)
    keep = {str(i) for s in range(rank, len(layers), pp) for i in layers[s]}
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    _drop_end_modules(pipeline, model, first=rank == 0, last=rank == pp - 1, tied=tied)
    return model


def chunk_views(
    pipeline: PipelineSpec,
    rank_model: nn.Module,
    layers: list[list[int]],
    rank: int,
    pp: int,
    tied: tuple[str, ...] = (),
) -> list[nn.Module]:
    """The module of each of this rank's stages (rank, rank + pp, ...), in order: views that share
    `rank_model`'s submodules (so its parameters) and hold only their stage's layers. With one stage
    per rank the only view is `rank_model` itself."""
    stages = range(rank, len(layers), pp)
    if len(stages) == 1:
        return [rank_model]
    views = []
    for s in stages:
        view = _view(rank_model)
        view.layers = nn.ModuleDict({str(i): rank_model.layers[str(i)] for i in layers[s]})
        _drop_end_modules(pipeline, view, first=s == 0, last=s == len(layers) - 1, tied=tied)
        views.append(view)
    return views


def _view(model: nn.Module) -> nn.Module:
    """A shallow copy that shares `model`'s submodules but has dicts of its own (children, hooks, ...),
    so that setting a child on the copy leaves `model` as it is."""
    view = copy.copy(model)
    for key, value in vars(model).items():
        if isinstance(value, dict):
            setattr(view, key, type(value)(value))
    return view


def _drop_end_modules(
    pipeline: PipelineSpec, model: nn.Module, first: bool, last: bool, tied: tuple[str, ...]
) -> None:
    if not first:
        for name in pipeline.first:
            if not (last and name in tied):
                setattr(model, name, None)
    if not last:
        for name in pipeline.last:
            setattr(model, name, None)


def rank_part(
    pipeline: PipelineSpec,
    full: nn.Module,
    layers: list[list[int]],
    rank: int,
    pp: int,
    tied: tuple[str, ...],
) -> nn.Module:
    """`split_model`'s part of `rank` as a view of `full` (same submodules, same FQNs), leaving `full`
    whole: every rank's part from one (meta) build, for the memory plan (memory/plan.py)."""
    part = _view(full)
    part.layers = nn.ModuleDict(full.layers)
    return split_model(pipeline, part, layers, rank, pp, tied)
