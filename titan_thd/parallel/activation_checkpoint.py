"""Activation recomputation ([activation_checkpoint], docs/design.md §5.5): the front door and its rules.

    mode = "full"        every block of a pipeline stage (and dsv4's MTP block) keeps only its inputs
                         and runs again in the backward
    mode = "selective"   only the named regions of each block (ModelSpec.ac_regions) do
    layers = N           only the first N blocks of each pipeline stage (0 = all)

A model's `apply_ac`, a step of its fixed `parallelize_<model>` sequence, wraps its blocks or regions
with the mechanism of `parallel/recompute.py`; `validate_activation_checkpoint` (called by
`startup.resolve_run`, before any process group) refuses what the model does not have. This module
imports nothing heavy; its mode's choices (`ACMode`) are the config's (config/choices.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


# ============================================================================ start-up rules
def validate_activation_checkpoint(
    *,
    mode: str,
    regions: Sequence[str],
    layers: int,
    model_regions: Mapping[str, str],
    n_layers: int,
    model: str,
) -> None:
    """The [activation_checkpoint] section against the model's regions (before any process group);
    ValueError naming the field, the value and what is allowed."""
    if layers < 0:
        raise ValueError(
            f"activation_checkpoint.layers = {layers}: expected 0 (every block of each pipeline stage) "
            "or the number of leading blocks of each stage to recompute"
        )
    if layers > n_layers:
        raise ValueError(
            f"activation_checkpoint.layers = {layers}: model {model} has {n_layers} layers; use 0 (all) "
            f"or 1..{n_layers}"
        )
    if mode != "selective" and regions:
        raise ValueError(
            f"activation_checkpoint.regions = {list(regions)} with mode = {mode!r}: regions choose what "
            'mode = "selective" recomputes; set mode = "selective" or regions = []'
        )
    if mode == "selective" and not regions:
        raise ValueError(
            'activation_checkpoint.mode = "selective" with no regions: name the regions to recompute; '
            f"model {model} has {_listed(model_regions)}"
        )
    unknown = [r for r in regions if r not in model_regions]
    if unknown:
        raise ValueError(
            f"activation_checkpoint.regions: {unknown} {'is' if len(unknown) == 1 else 'are'} not a region "
            f"of model {model}; its regions: {_listed(model_regions)}"
        )
    if len(set(regions)) != len(regions):
        raise ValueError(f"activation_checkpoint.regions = {list(regions)} names a region twice")


def _listed(model_regions: Mapping[str, str]) -> str:
    return ", ".join(model_regions) if model_regions else 'none (only mode = "full")'


def describe(mode: str, regions: Sequence[str], layers: int, model_regions: Mapping[str, str]) -> str:
    """What is recomputed, for the log header."""
    if mode == "none":
        return "activation checkpointing: none (every activation kept until its backward)"
    which = f"the first {layers} blocks of each pipeline stage" if layers else "every block"
    if mode == "full":
        return (
            f"activation checkpointing: full, {which} (MTP included) keeps only its inputs and is "
            "recomputed in the backward"
        )
    parts = "; ".join(f"{r}: {model_regions[r]}" for r in regions)
    return f"activation checkpointing: selective, in {which}, recomputes {parts}"


def blocks_to_wrap(blocks: Sequence, layers: int) -> list:
    """The stage's blocks that activation_checkpoint.layers selects (0 = all), in forward order."""
    return list(blocks[:layers] if layers else blocks)
