"""Context parallelism: the front door. Its rules live here (docs/design.md §3.3).

A CP group of `cp` ranks splits every microbatch's T rows; a model computes exactly under one
split, which its `ModelSpec.parallel.cp_mode` declares (llama: zigzag, dsv4: contiguous), and
`parallelism.context_parallel_mode = "auto"` (the default) follows it.

    mode = validate_context_parallel(degree=..., configured_mode=..., model=..., ...)  # start-up
    check_layout(cp=..., mode=..., T=...)                   # the same rules for one microbatch

The mechanisms sit where their layer is, all of them below this rule book or beside it:
    data/cp_partition.py        `partition`: this rank's rows of a PackedBatch (zigzag | contiguous)
    data/batch_meta.py          `CPContext` (size, rank, group, mode), carried by `BatchMeta.cp`
    parallel/cp_comm.py         differentiable all-gather and left-halo exchange
    ops/cp_attention.py         zigzag causal attention (llama)
    models/dsv4/context_parallel.py   halo and compressed-entry exchange (dsv4, docs/dsv4.md §9.2)
A model needs no wrapping for CP: its layers read `meta.cp`.

This module imports nothing from titan_thd but the config's choices (config/choices.py, a leaf), so data
and models can all use `CPMode`.
"""

from __future__ import annotations

from typing import Literal, get_args

from titan_thd.config.choices import CPConfigMode

CPMode = Literal["zigzag", "contiguous", "hybrid"]
"""zigzag: rank r takes chunks r and 2cp-1-r of every document (balances causal attention);
contiguous: rank r takes rows [r*T/cp, (r+1)*T/cp) (a contiguous left context from one neighbour);
hybrid: documents shorter than a threshold stay whole on one rank, only longer ones are zigzagged
(Megatron's hybrid / dynamic context parallelism; a model that computes zigzag computes it too)."""
CP_MODES: tuple[CPMode, ...] = get_args(CPMode)
CONFIG_CHOICES: tuple[str, ...] = get_args(CPConfigMode)
assert CONFIG_CHOICES == ("auto", *CP_MODES)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def resolve_mode(configured_mode: str, model: str, model_mode: CPMode) -> CPMode:
    """The mode to run: the model's for "auto"; an explicit other mode is a ValueError."""
    if configured_mode not in CONFIG_CHOICES:
        raise ValueError(
            f"parallelism.context_parallel_mode: got {configured_mode!r}, expected one of {', '.join(CONFIG_CHOICES)}"
        )
    if configured_mode == "hybrid" and model_mode == "zigzag":
        return "hybrid"  # zigzag for the long documents, whole short ones: exact wherever zigzag is
    if configured_mode != "auto" and configured_mode != model_mode:
        raise ValueError(
            f"parallelism.context_parallel_mode = {configured_mode}: model {model} computes only {model_mode} "
            f"exactly{' (and hybrid)' if model_mode == 'zigzag' else ''}; use {model_mode} or auto (the default)"
        )
    return model_mode if configured_mode == "auto" else configured_mode  # type: ignore[return-value]


def default_pad_to_multiple(cp_degree: int, cp_mode: CPMode) -> int:
    """data.pad_to_multiple = 0: 2 * cp where documents are zigzagged (zigzag, and hybrid's long ones),
    else 1 (contiguous CP splits rows, not documents)."""
    return 2 * cp_degree if cp_degree > 1 and cp_mode != "contiguous" else 1


def check_layout(
    *,
    cp: int,
    mode: CPMode,
    T: int,
    min_tokens_per_rank: int = 1,
    where: str = "T",
    model: str = "",
    why: str = "",
) -> None:
    """T rows split over cp ranks in `mode`: divisibility and the smallest local shard.

    `where` names T in the message (the config field at start-up, a model inside a forward);
    `model` and `why` say who needs `min_tokens_per_rank` rows and why.
    """
    if cp == 1:
        return
    need = cp if mode == "contiguous" else 2 * cp
    if T % need:
        raise ValueError(
            f"{where} = {T} is not divisible by {need} ({mode} CP with degree {cp}); the smallest valid "
            f"value above it is {_round_up(T, need)}"
        )
    if T // cp < min_tokens_per_rank:
        raise ValueError(
            f"{where} = {T} / context_parallel_degree = {cp} leaves {T // cp} tokens per CP rank; "
            f"{model or 'the model'} needs at least {min_tokens_per_rank}{why}"
        )


def validate_context_parallel(
    *,
    degree: int,
    configured_mode: str,
    model: str,
    model_mode: CPMode,
    tokens_per_microbatch: int,
    pad_to_multiple: int,
    min_tokens_per_rank: int,
) -> CPMode:
    """Every CP rule of a run, before any process group exists; returns the mode to run.

    `degree` is positive and `tokens_per_microbatch` a multiple of `pad_to_multiple` (startup.resolve_run);
    `model` names the model in messages (e.g. "dsv4 tiny").
    """
    mode = resolve_mode(configured_mode, model, model_mode)
    check_layout(
        cp=degree,
        mode=mode,
        T=tokens_per_microbatch,
        min_tokens_per_rank=min_tokens_per_rank,
        where="training.tokens_per_microbatch",
        model=f"model {model}",
    )
    if degree > 1 and mode != "contiguous" and pad_to_multiple % (2 * degree):
        raise ValueError(
            f"{mode} CP with degree {degree} cuts every document{' it splits' if mode == 'hybrid' else ''} into "
            f"{2 * degree} chunks: "
            f"data.pad_to_multiple = {pad_to_multiple} must be a multiple of {2 * degree}"
        )
    return mode
