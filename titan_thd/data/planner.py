"""Microbatch planner: the samples of one global batch -> microbatches of every DP replica.

docs/design.md §3.2. Both policies are pure, deterministic functions of the padded sample
lengths, `dp`, `cp` and `T` (the tokens of one microbatch of one DP replica before the CP split;
Megatron's per-bin capacity C = M * cp). Every rank computes the same plan and reads only its own
samples.

Cost model and `Plan`: titan_thd/data/plan.py (a sample of padded length L costs `L + b * L**2`).

- `dp_balanced`: Megatron's order-preserving next-fit + tail splitting + round-robin
  (docs/thd_reference.md §1.2), with the `i >= 0` fix and a ValueError instead of an empty
  bin for a sample longer than T. Token counts only; it does not balance.
- `balanced` (titan_thd/data/balanced_planner.py): minimises the slowest replica's cost with the
  fewest microbatches K per replica. For K = a lower bound, K + 1, ...: (1) greedy placement, samples by decreasing cost, each on the
  replica with the lowest *projected* final cost (cost now + its missing tokens at the average
  cost per token still to place), best fit inside it; (2) repair of the samples that fit nowhere
  by exact subset-sum re-splits of two microbatches, and where those cannot help, a re-packing of
  the microbatches with room or overflow (else K + 1); (3) local search: exchanges of samples
  (then pairs) between the slowest replica and the others while that lowers the slowest. A
  heuristic (the problem is NP-hard): on tiny inputs it finds the optimal K and comes within a
  few % of the optimal cost (brute force in tests/data/test_planner.py); on batches built to
  have a perfect packing (zero room left) it finds it nearly always; a few ms for 1000 samples
  (benchmarks/bench_planner.py).
"""

from __future__ import annotations

from typing import get_args

import numpy as np

from titan_thd.config.choices import Policy
from titan_thd.data.balanced_planner import plan_balanced
from titan_thd.data.plan import Plan, check_inputs, finish, sample_costs, with_imbalance

__all__ = [
    "POLICIES",
    "Plan",
    "Policy",
    "hybrid_rank_costs",
    "make_plan",
    "plan_balanced",
    "plan_dp_balanced",
    "sample_costs",
]

POLICIES: tuple[str, ...] = get_args(Policy)

_HYBRID_STEPS = 16  # hybrid_refine: accepted changes per plan
_HYBRID_PARTNERS = 2  # and the cheapest replicas it looks at
_HYBRID_MIN_GAIN = 1e-4  # a change must lower the slowest replica by 0.01 % at least


# ============================================================================ dp_balanced
def plan_dp_balanced(
    lengths, dp: int, cp: int, T: int, microbatch_group: int | None = None, cost_attention: float = 0.0
) -> Plan:
    """Megatron's dp_balanced schedule; `cost_attention` only affects the reported costs."""
    lens = check_inputs(lengths, dp, cp, T, "dp_balanced")
    bins: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, length in enumerate(lens.tolist()):
        if current and used + length > T:  # next-fit: close the bin, never look back
            bins.append(current)
            current, used = [], 0
        current.append(i)
        used += length
    bins.append(current)

    multiple = dp * (microbatch_group or 1)
    missing = (-len(bins)) % multiple
    b = len(bins) - 1
    while missing:
        if b < 0:  # upstream asserted `b > 0` and so could never split bin 0
            raise ValueError(
                f"dp_balanced planner: {lens.size} samples fill {len(bins)} microbatches, which cannot be split "
                f"into a multiple of {multiple} (dp = {dp} x microbatch_group = {microbatch_group or 1}): "
                f"{missing} more are needed but no microbatch has two samples left; use a larger global batch"
            )
        if len(bins[b]) > 1:
            bins.append([bins[b].pop()])
            missing -= 1
        else:
            b -= 1
    k = len(bins) // dp
    microbatches = [[bins[m * dp + r] for m in range(k)] for r in range(dp)]
    return finish(microbatches, sample_costs(lens, cost_attention), cp)


def make_plan(
    policy: str,
    lengths,
    dp: int,
    cp: int,
    T: int,
    cost_attention: float,
    microbatch_group: int | None = None,
    hybrid_threshold: int = 0,
) -> Plan:
    """Dispatch on `training.planner`; `hybrid_threshold` > 0: hybrid CP (`hybrid_refine`)."""
    if policy == "balanced":
        plan = plan_balanced(lengths, dp, cp, T, cost_attention, microbatch_group)
    elif policy == "dp_balanced":
        plan = plan_dp_balanced(lengths, dp, cp, T, microbatch_group, cost_attention)
    else:
        raise ValueError(f"training.planner: got {policy!r}, expected one of {', '.join(POLICIES)}")
    if hybrid_threshold and cp > 1:
        lens = np.asarray(lengths, dtype=np.int64)
        plan = hybrid_refine(plan, lens, sample_costs(lens, cost_attention), T, cp, hybrid_threshold)
    return plan


# ============================================================================ hybrid CP
def hybrid_rank_costs(lens: list[int], costs: list[float], T: int, cp: int, threshold: int) -> list[float]:
    """What each CP rank of one microbatch carries under hybrid CP (data/cp_partition.py): every split
    document cost / cp, every whole one its full cost on the rank `hybrid_layout` puts it on."""
    from titan_thd.data.cp_partition import hybrid_layout  # torch-side module; the planner is numpy

    if not lens:
        return [0.0] * cp
    padded = [*lens, T - sum(lens)]  # the trailing padding document (real length 0)
    layout = hybrid_layout([*lens, 0], padded, cp, threshold)
    shared = sum(costs[i] for i in layout.split) / cp
    return [shared + sum(costs[i] for i in docs) for docs in layout.whole]


def hybrid_refine(plan: Plan, lens: np.ndarray, costs: np.ndarray, T: int, cp: int, threshold: int) -> Plan:
    """The plan with the replicas balanced by what hybrid CP really costs them.

    Under hybrid CP a microbatch takes as long as its most loaded CP rank, and a short document sits
    whole on one rank, so a replica's cost is the sum over its microbatches of the largest rank cost
    (`hybrid_rank_costs`), not its total / cp. Local search on that cost: a document of the slowest
    replica moves to another microbatch (its own replica's or one of the cheapest replicas') with
    room, or (when no move helps) two documents swap, whenever that lowers the slowest of the two
    replicas involved below the old maximum; the best such change each time, ties to the first
    found (deterministic). `replica_costs` and `imbalance` report the hybrid costs. Rows of a CP rank are T / cp whatever the placement, so a move only
    needs the microbatch's token total to fit T."""
    mbs = [[list(mb) for mb in replica] for replica in plan.microbatches]
    memo: dict[tuple[int, ...], float] = {}

    def mb_cost(mb: list[int]) -> float:
        key = tuple(mb)
        if key not in memo:
            ls, cs = [int(lens[i]) for i in mb], [float(costs[i]) for i in mb]
            memo[key] = max(hybrid_rank_costs(ls, cs, T, cp, threshold))
        return memo[key]

    cost = [[mb_cost(mb) for mb in replica] for replica in mbs]

    def best_change(r: int, swaps: bool, totals: list[float]):
        """The change that lowers the slowest replica r the most (None if none lowers it)."""
        best, bar = None, totals[r] * (1 - _HYBRID_MIN_GAIN)
        partners = sorted(range(len(mbs)), key=lambda q: (totals[q], q))[:_HYBRID_PARTNERS]
        for q in dict.fromkeys([r, *partners]):
            for a, mb_a in enumerate(mbs[r]):
                free_a = T - int(lens[mb_a].sum())
                for b, mb_b in enumerate(mbs[q]):
                    if q == r and a == b:
                        continue
                    free_b = T - int(lens[mb_b].sum())
                    for i in mb_a:
                        for j in mb_b if swaps else [None]:
                            n_j = 0 if j is None else int(lens[j])
                            if int(lens[i]) > free_b + n_j or n_j > free_a + int(lens[i]):
                                continue
                            new_a = sorted([k for k in mb_a if k != i] + ([] if j is None else [j]))
                            ca = mb_cost(new_a)
                            if q != r and totals[r] - cost[r][a] + ca >= bar:
                                continue  # r does not get faster: no need to price the other side
                            new_b = sorted([k for k in mb_b if k != j] + [i])
                            cb = mb_cost(new_b)
                            if q == r:
                                worst = totals[r] - cost[r][a] - cost[r][b] + ca + cb
                            else:
                                worst = max(totals[r] - cost[r][a] + ca, totals[q] - cost[q][b] + cb)
                            if worst < bar and (best is None or worst < best[0]):
                                best = (worst, q, a, b, new_a, new_b, ca, cb)
        return best

    for _ in range(_HYBRID_STEPS):
        totals = [sum(c) for c in cost]
        r = int(np.argmax(totals))
        best = best_change(r, False, totals) or best_change(r, True, totals)  # moves before swaps
        if best is None:
            break
        _, q, a, b, new_a, new_b, ca, cb = best
        mbs[r][a], mbs[q][b], cost[r][a], cost[q][b] = new_a, new_b, ca, cb
    for replica in mbs:
        replica.sort(key=lambda mb: (not mb, mb[0] if mb else 0))
    return with_imbalance(mbs, [sum(mb_cost(mb) for mb in replica) for replica in mbs])
