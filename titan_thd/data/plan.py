"""A microbatch plan and the cost model both planners share (titan_thd/data/planner.py, docs/design.md §3.2).

Cost model: a sample of padded length L costs `L + b * L**2` (linear work per token plus attention
work, b = `cost_attention`); a microbatch costs the sum over its samples, a replica the sum over
its microbatches. Under CP each of the `cp` ranks of a replica carries cost / cp, which is what
`Plan.replica_costs` reports. `Plan.imbalance` = max / mean replica cost (1.0 = perfect).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass
class Plan:
    microbatches: list[list[list[int]]]
    """[replica][microbatch] -> positions into `lengths` (ascending inside a microbatch)."""
    replica_costs: list[float]
    """Cost carried by each CP rank of each replica (replica cost / cp)."""
    imbalance: float
    """max / mean of `replica_costs` (1.0 = perfect)."""

    @property
    def num_microbatches(self) -> int:
        """Microbatches per replica; identical for every replica."""
        return len(self.microbatches[0])


def sample_costs(lengths: np.ndarray, cost_attention: float) -> np.ndarray:
    """[n] float64 cost `L + b L^2` of each sample."""
    lens = np.asarray(lengths, dtype=np.float64)
    return lens + cost_attention * lens * lens


def attention_cost_weight(flops_per_step: Callable[[Any, Sequence[int]], float], args: Any) -> float:
    """The weight b of sum(len^2) per unit of tokens (training.planner_cost_attention = 0), read off the
    model's FLOPs formula (its ModelSpec.flops_per_step with `args`).

    flops(L) = a L + b' L^2 for one document of length L; two lengths give a and b', b = b' / a.
    """
    l1, l2 = 1024, 2048
    f1, f2 = flops_per_step(args, [l1]), flops_per_step(args, [l2])
    b = (f2 / l2 - f1 / l1) / (l2 - l1)
    a = f1 / l1 - b * l1
    return max(0.0, b / a)


def check_inputs(lengths, dp: int, cp: int, T: int, policy: str) -> np.ndarray:
    lens = np.asarray(lengths, dtype=np.int64)
    for name, value in (("dp", dp), ("cp", cp), ("T", T)):
        if value < 1:
            raise ValueError(f"{policy} planner: {name} = {value}, expected >= 1")
    if lens.ndim != 1 or lens.size == 0:
        raise ValueError(
            f"{policy} planner: expected a non-empty 1-D list of lengths, got shape {lens.shape}"
        )
    if (lens < 0).any():
        bad = int(np.nonzero(lens < 0)[0][0])
        raise ValueError(f"{policy} planner: sample {bad} has negative length {int(lens[bad])}")
    if (lens > T).any():
        bad = int(np.nonzero(lens > T)[0][0])
        raise ValueError(
            f"{policy} planner: sample {bad} has padded length {int(lens[bad])} > T = {T} tokens per microbatch "
            f"(training.tokens_per_microbatch); truncate or drop it (data.overlong) or raise T"
        )
    return lens


def finish(microbatches: list[list[list[int]]], costs: np.ndarray, cp: int) -> Plan:
    replica = [sum(float(costs[i]) for mb in mbs for i in mb) / cp for mbs in microbatches]
    return with_imbalance(microbatches, replica)


def with_imbalance(microbatches: list[list[list[int]]], replica_costs: list[float]) -> Plan:
    mean = sum(replica_costs) / len(replica_costs)
    return Plan(microbatches, replica_costs, max(replica_costs) / mean if mean > 0 else 1.0)
