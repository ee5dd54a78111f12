"""How many rows a microbatch may have: every rule the model and the parallel layout put on them, in one place.

A microbatch's row count depends on its documents (data.trim_padding ends it after the last one), so
the rules must hold for any documents, not only for T = training.tokens_per_microbatch. `row_rule`
derives them once from the layout; start-up checks T with it (`RowRule` refuses an illegal T) and the
packer sizes every microbatch with `RowRule.rows`, so the two cannot disagree:

    multiple   the documents' padding multiple (data.pad_to_multiple), the CP split (contiguous: cp
               rows; zigzag / hybrid: 2 * cp chunks) and sequence-parallel TP (each CP rank's rows in
               tp equal shares): every row count is a multiple of their lcm
    minimum    the smallest local shard the model computes (ModelSpec.parallel.min_tokens_per_cp_rank, e.g.
               dsv4's CP halo) on every CP rank, rounded up to the multiple; at least one multiple,
               so that every CP / TP rank holds a row
    fixed      pipeline parallelism (fixed P2P shapes between stages) or data.trim_padding = false:
               always T rows

    rule = row_rule(T=2048, pad_to_multiple=1, cp=4, cp_mode="contiguous", tp=1, fixed=False,
                    min_tokens_per_cp_rank=128)
    rule.rows(92)   # 512: 4 CP ranks x dsv4's halo of 128, not the 92 rows the documents take
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from titan_thd.parallel.context_parallel import CPMode


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class RowRule:
    """The row counts a microbatch may have under one layout (module docstring); frozen, built by `row_rule`."""

    T: int
    """training.tokens_per_microbatch: the most rows (and the only count when `fixed`)."""
    multiple: int
    """Every row count is a multiple of this."""
    minimum: int
    """Every row count is at least this (a multiple of `multiple`, at most T)."""
    fixed: bool
    """Every microbatch has exactly T rows."""

    def rows(self, used: int) -> int:
        """Rows of a microbatch whose documents take `used` padded tokens (used <= T)."""
        assert 0 <= used <= self.T, (used, self.T)
        if self.fixed:
            return self.T
        return max(self.minimum, _round_up(used, self.multiple))

    def is_legal(self, rows: int) -> bool:
        if self.fixed:
            return rows == self.T
        return rows % self.multiple == 0 and self.minimum <= rows <= self.T

    def with_multiple(self, pad_to_multiple: int) -> RowRule:
        """The rule for documents padded to another multiple (an offline pack's own), T checked again."""
        multiple = math.lcm(self.multiple, pad_to_multiple)
        why = f" (documents padded to multiples of {pad_to_multiple})"
        return _checked(self.T, multiple, _round_up(self.minimum, multiple), self.fixed, why)


def full_rows(T: int) -> RowRule:
    """Every microbatch has exactly T rows (no trimming)."""
    return RowRule(T=T, multiple=1, minimum=T, fixed=True)


def row_rule(
    *,
    T: int,
    pad_to_multiple: int,
    cp: int,
    cp_mode: CPMode,
    tp: int,
    fixed: bool,
    min_tokens_per_cp_rank: int = 1,
    model: str = "the model",
) -> RowRule:
    """The rule of one layout; ValueError (with the numbers) when T itself breaks it."""
    split = 1 if cp == 1 else cp if cp_mode == "contiguous" else 2 * cp
    multiple = math.lcm(pad_to_multiple, split, cp * tp)
    why = ""
    if min_tokens_per_cp_rank > 1 and cp > 1:
        why = f" ({model} needs {min_tokens_per_cp_rank} rows on each of the {cp} CP ranks)"
    # Without CP a model needs no halo: its rows are the whole microbatch.
    minimum = _round_up(cp * min_tokens_per_cp_rank if cp > 1 else 1, multiple)
    return _checked(T, multiple, minimum, fixed, why)


def _checked(T: int, multiple: int, minimum: int, fixed: bool, why: str) -> RowRule:
    if T % multiple or T < minimum:
        raise ValueError(
            f"training.tokens_per_microbatch = {T} cannot hold a microbatch of this layout: its row counts are "
            f"multiples of {multiple} from {minimum}{why}; the smallest valid value is "
            f"{max(minimum, _round_up(T, multiple))}"
        )
    return RowRule(T=T, multiple=multiple, minimum=minimum, fixed=fixed)
