"""Initialisation as a function of the seed alone, drawn shard by shard: the same weights on every layout,
and no rank ever holds more than its own shards plus one bounded block.

    init_seeded(model, seed, rules)     # rules: {fqn: InitRule} of every parameter and buffer of the
                                        # model's own; LoRA adapters' from each module's PAIRS

A model built on the meta device, cut into its pipeline stages and sharded (FSDP, TP, EP: DTensors),
then allocated with `to_empty`, is filled here in place. Each tensor is cut along its first dimension
into blocks of at most `BLOCK_BYTES`, a cut that depends on its global shape only; block `i` of tensor
`fqn` is drawn by the model's rule from a generator seeded with (seed, fqn, first row of the block).
A rank draws only the blocks that overlap its rows of the tensor and keeps its slice of them, so a
value never depends on the layout: FSDP and EP ranks (rows split) draw about their share, a TP rank
whose columns are split draws every block of the tensor, one at a time.

`fqn` is the name in the whole model: pipeline stages keep their layers' names, and the wrappers of
activation recomputation, compilation and FSDP1 (`parallel/shards.py`'s `canonical_name`) are not
part of it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Collection, Mapping

import torch
from torch import nn

from titan_thd.parallel.shards import PAIRS, canonical_name, local_box

InitRule = Callable[[torch.Tensor, torch.Generator], None]
"""Fills a block of consecutive rows (first dimension) of a tensor in place from the generator; the
rows of a block must not depend on each other (a draw per element, a constant, a per-row table)."""

BLOCK_BYTES = 64 * 2**20
"""The largest block a rank draws at once (one row at least)."""


def block_rows(shape: torch.Size | tuple[int, ...], element_size: int) -> int:
    """Rows of one block of a tensor of `shape` (a function of the global shape only)."""
    row_bytes = math.prod(shape[1:]) * element_size
    return max(1, BLOCK_BYTES // max(1, row_bytes))


def block_seed(seed: int, fqn: str, row: int) -> int:
    """The generator seed of the block of `fqn` starting at `row` (63 bits of a hash)."""
    digest = hashlib.blake2b(f"{seed}/{fqn}/{row}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


@torch.no_grad()
def init_seeded(
    model: nn.Module, seed: int, rules: Mapping[str, InitRule], skip: Collection[str] = ()
) -> None:
    """Fill every parameter and buffer of `model` (plain tensors or DTensors, on any device) by its rule,
    but those named in `skip` (what a checkpoint read next provides: drawing them would be wasted).
    `rules` are the model's own; the LoRA adapters attached to it follow `adapter_rules`."""
    rules = {**rules, **adapter_rules(model)}
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, t in tensors.items():
        fqn = canonical_name(name)
        if fqn not in rules:
            raise KeyError(f"{fqn}: the model's init rules do not name it")
        if fqn not in skip:
            init_tensor(t, seed, fqn, rules[fqn])


def init_tensor(t: torch.Tensor, seed: int, fqn: str, rule: InitRule) -> None:
    """Fill this rank's part of `t` (global shape `t.shape`) with the blocks of `fqn` that overlap it."""
    local, box = local_box(t)
    offset = tuple(s.start for s in box)
    if local.numel() == 0:
        return
    if t.dim() == 0:
        block = torch.empty((), dtype=t.dtype)
        rule(block, torch.Generator().manual_seed(block_seed(seed, fqn, 0)))
        local.copy_(block)
        return
    shape = tuple(t.shape)
    step = block_rows(shape, t.element_size())
    lo, hi = offset[0], offset[0] + local.shape[0]  # this rank's rows
    others = tuple(slice(o, o + n) for o, n in zip(offset[1:], local.shape[1:], strict=True))
    for start in range(lo - lo % step, hi, step):
        stop = min(start + step, shape[0])
        block = torch.empty((stop - start, *shape[1:]), dtype=t.dtype)
        rule(block, torch.Generator().manual_seed(block_seed(seed, fqn, start)))
        a, b = max(start, lo), min(stop, hi)
        local[a - lo : b - lo].copy_(block[(slice(a - start, b - start), *others)])


def adapter_rules(model: nn.Module) -> dict[str, InitRule]:
    """Rules of the LoRA adapters attached to `model` (each module's `PAIRS`: {base: (A, B)}): A uniform
    in +-1/sqrt(in-features) (PEFT's default, kaiming-uniform with a = sqrt(5)), B zero, so the first
    step is the base model."""

    def uniform(bound: float) -> InitRule:
        return lambda t, g: t.uniform_(-bound, bound, generator=g)

    def zero(t: torch.Tensor, g: torch.Generator) -> None:
        t.zero_()

    rules = {}
    for mname, module in model.named_modules():
        for a_name, b_name in getattr(module, PAIRS, {}).values():
            A = module.get_parameter(a_name)
            rules[canonical_name(f"{mname}.{a_name}")] = uniform(A.shape[-1] ** -0.5)
            rules[canonical_name(f"{mname}.{b_name}")] = zero
    return rules
