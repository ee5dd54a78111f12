"""Microbatch planner: the samples of one global batch -> microbatches of every DP replica.

docs/design.md §3.2. Both policies are pure, deterministic functions of the padded sample
lengths, `dp`, `cp` and `T` (the tokens of one microbatch of one DP replica before the CP split;
Megatron's per-bin capacity C = M * cp). Every rank computes the same plan and reads only its own
samples.

Cost model: a sample of padded length L costs `L + b * L**2` (linear work per token plus attention
work, b = `cost_attention`); a microbatch costs the sum over its samples, a replica the sum over
its microbatches. Under CP each of the `cp` ranks of a replica carries cost / cp, which is what
`Plan.replica_costs` reports. `Plan.imbalance` = max / mean replica cost (1.0 = perfect).

- `dp_balanced`: Megatron's order-preserving next-fit + tail splitting + round-robin
  (docs/thd_reference.md §1.2), with the `i >= 0` fix and a ValueError instead of an empty
  bin for a sample longer than T. Token counts only; it does not balance.
- `balanced`: minimises the slowest replica's cost with the fewest microbatches K per replica.
  For K = a lower bound, K + 1, ...: (1) greedy placement, samples by decreasing cost, each on the
  replica with the lowest *projected* final cost (cost now + its missing tokens at the average
  cost per token still to place), best fit inside it; (2) repair of the samples that fit nowhere
  by exact subset-sum re-splits of two microbatches, and where those cannot help, a re-packing of
  the microbatches with room or overflow (else K + 1); (3) local search: exchanges of samples
  (then pairs) between the slowest replica and the others while that lowers the slowest. A
  heuristic (the problem is NP-hard): on tiny inputs it finds the optimal K and comes within a
  few % of the optimal cost (brute force in tests/data/test_planner.py); on batches built to
  have a perfect packing (zero room left) it finds it nearly always; a few ms for 1000 samples
  (scripts/bench_planner.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

Policy = Literal["balanced", "dp_balanced"]
"""Values of training.planner."""
POLICIES: tuple[str, ...] = get_args(Policy)

# Local-search limits; each accepted step strictly lowers the sorted cost vector, so these only
# bound the time on pathological inputs.
_MAX_SEARCH_STEPS = 128
_SEARCH_PARTNERS = 4  # swap partners: the cheapest few replicas
_ANCHORS = 16  # group exchanges: only groups with one of r's 16 costliest samples
_WINDOW = 4  # group exchanges: partner groups looked at on each side of a length
_GOOD_ENOUGH = 1e-3  # stop once the slowest replica is within 0.1 % of the mean
_MIN_GAIN = 1e-4  # or once the best exchange lowers it by less than 0.01 %
_HYBRID_STEPS = 16  # hybrid_refine: accepted changes per plan
_HYBRID_PARTNERS = 2  # and the cheapest replicas it looks at


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


def _check_inputs(lengths, dp: int, cp: int, T: int, policy: str) -> np.ndarray:
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


def _finish(microbatches: list[list[list[int]]], costs: np.ndarray, cp: int) -> Plan:
    replica = [sum(float(costs[i]) for mb in mbs for i in mb) / cp for mbs in microbatches]
    return _with_imbalance(microbatches, replica)


def _with_imbalance(microbatches: list[list[list[int]]], replica_costs: list[float]) -> Plan:
    mean = sum(replica_costs) / len(replica_costs)
    return Plan(microbatches, replica_costs, max(replica_costs) / mean if mean > 0 else 1.0)


# ============================================================================ dp_balanced
def plan_dp_balanced(
    lengths, dp: int, cp: int, T: int, microbatch_group: int | None = None, cost_attention: float = 0.0
) -> Plan:
    """Megatron's dp_balanced schedule; `cost_attention` only affects the reported costs."""
    lens = _check_inputs(lengths, dp, cp, T, "dp_balanced")
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
    return _finish(microbatches, sample_costs(lens, cost_attention), cp)


# ============================================================================ balanced
def _greedy(lens: np.ndarray, costs: np.ndarray, order: np.ndarray, dp: int, K: int, T: int):
    """Place samples (in `order`) one by one on the replica with the lowest projected final cost.

    Every replica ends near the same token count (the mean), so a replica's final cost is
    projected as its cost now plus its missing tokens at the cost per token of the samples still
    to place. Plain LPT (lowest cost now) lets cheap replicas fill up with tokens and leaves the
    attention-heavy ones short of small samples at the end. Inside a replica: best fit.
    Returns (bin_of [n]: microbatch r*K + k, or -1 where a sample fit nowhere; bin_free [dp*K]).
    """
    rooms = [[(T, k) for k in range(K)] for _ in range(dp)]  # per replica: (free, microbatch), sorted
    max_free, cost, tokens = [T] * dp, [0.0] * dp, [0] * dp
    left_cost, left_tokens = float(costs.sum()), int(lens.sum())
    bin_of = np.full(lens.size, -1, dtype=np.int64)
    replicas = range(dp)
    for i, length, c in zip(order.tolist(), lens[order].tolist(), costs[order].tolist()):
        rate = left_cost / left_tokens if left_tokens > 0 else 1.0
        left_cost -= c
        left_tokens -= length
        fits = [r for r in replicas if max_free[r] >= length]
        if not fits:
            continue
        r = min(fits, key=lambda q: cost[q] - rate * tokens[q])  # lowest index on ties
        row = rooms[r]
        free, k = row.pop(bisect.bisect_left(row, (length, -1)))  # best fit, lowest index on ties
        bisect.insort(row, (free - length, k))
        max_free[r] = row[-1][0]
        cost[r] += c
        tokens[r] += length
        bin_of[i] = r * K + k
    bin_free = np.empty(dp * K, dtype=np.int64)
    for r, row in enumerate(rooms):
        for free, k in row:
            bin_free[r * K + k] = free
    return bin_of, bin_free


def _groups(items: np.ndarray, bin_of: np.ndarray, lens: np.ndarray):
    """Every single sample and every pair of samples sharing a microbatch, among `items`.

    Returns (first [g], second [g] or -1, length [g], microbatch [g]).
    """
    items = items[np.argsort(bin_of[items], kind="stable")]
    bins = bin_of[items]
    first, second = [items], [np.full(items.size, -1)]
    for k in range(1, items.size):
        same = bins[:-k] == bins[k:]
        if not same.any():
            break
        first.append(items[:-k][same])
        second.append(items[k:][same])
    first_a, second_a = np.concatenate(first), np.concatenate(second)
    length = lens[first_a] + np.where(second_a >= 0, lens[second_a], 0)
    return first_a, second_a, length, bin_of[first_a]


def _subset_near(sizes: list[int], lo: int, cap: int) -> tuple[int, list[int]]:
    """A subset of `sizes` whose total is the smallest reachable one in [lo, cap], or else the
    largest one <= cap; returns (total, positions of one such subset).

    Exact subset sum over reachable totals kept as bits of a Python int (a few thousand bits: the
    sizes are in units of the lengths' common divisor). Ties keep the earlier sizes: walking back
    from the last size, a size is taken only if the total is unreachable without it.
    """
    window = (1 << (cap + 1)) - 1
    reach = [1]
    for size in sizes:
        reach.append((reach[-1] | (reach[-1] << size)) & window)
    above = reach[-1] >> lo
    best = lo + (above & -above).bit_length() - 1 if above else reach[-1].bit_length() - 1
    total, taken = best, []
    for k in range(len(sizes) - 1, -1, -1):
        if not (reach[k] >> total) & 1:
            taken.append(k)
            total -= sizes[k]
    assert total == 0, total
    return best, taken


def _refill(b: int, o: int, want: int, units: np.ndarray, bin_of: np.ndarray, cap: int) -> int:
    """Re-split the samples of microbatches b and o so that b gains `want` units (or the most it can
    below that, never more than fits): returns the units b gained (0: nothing changes)."""
    own, other = np.nonzero(bin_of == b)[0], np.nonzero(bin_of == o)[0]
    # o's samples after b's, its longest last: they move only where they must (long samples carry
    # most of the attention cost, which would shift between replicas).
    pool = np.concatenate([own, other[np.argsort(units[other], kind="stable")]])
    load = int(units[own].sum())
    best, taken = _subset_near(units[pool].tolist(), min(load + want, cap), cap)
    if best <= load:
        return 0
    bin_of[pool] = o
    bin_of[pool[taken]] = b
    return best - load


def _repair(
    lens: np.ndarray, costs: np.ndarray, bin_of: np.ndarray, bin_free: np.ndarray, T: int, K: int
) -> bool:
    """Fit the samples the greedy pass could not place; False if some microbatch stays over T.

    Leftovers go (over capacity) to the roomiest microbatch of the cheapest replica. Then, while a
    microbatch o overflows: (1) the samples of o and of one microbatch b with room are re-split
    so that b takes just what relieves o (an exact subset sum over both, so any exchange, not
    only of one or two samples), b from o's replica first (no cost moves between replicas), then
    the roomiest; (2) if no b can, the roomiest microbatch R gathers room: another microbatch is
    filled as full as it can be from itself and R; (3) if that cannot either (near-full
    microbatches of few long samples leave nothing to exchange pairwise), the microbatches with
    an overflow or room are packed again from all of their samples (`_repack`), with more and
    more full ones while that fails. Total overflow falls at every step (1), R's room grows at
    every step (2), and a successful step (3) ends it, so this terminates.
    """
    left = np.nonzero(bin_of < 0)[0]
    placed = bin_of >= 0
    rep_cost = np.bincount(bin_of[placed] // K, weights=costs[placed], minlength=bin_free.size // K)
    for i in left[np.argsort(-lens[left], kind="stable")].tolist():
        r = int(np.argmin(rep_cost))  # the cheapest replica, into its roomiest microbatch
        b = r * K + int(np.argmax(bin_free[r * K : (r + 1) * K]))
        bin_of[i] = b
        bin_free[b] -= lens[i]
        rep_cost[r] += costs[i]
    unit = math.gcd(T, *np.unique(lens).tolist())
    units, cap = lens // unit, T // unit

    def apply(b: int, o: int, want: int) -> int:
        gained = _refill(b, o, want, units, bin_of, cap)
        bin_free[b] -= gained * unit
        bin_free[o] += gained * unit
        return gained

    while (bin_free < 0).any():
        o = int(np.argmin(bin_free))
        need = -int(bin_free[o]) // unit
        roomy = np.nonzero(bin_free > 0)[0]
        # Microbatches of o's replica first (moving samples there leaves the replica costs as they
        # are), then the roomiest; each takes only what relieves o.
        roomy = roomy[np.lexsort((-bin_free[roomy], roomy // K != o // K))].tolist()
        if any(apply(b, o, need) for b in roomy):
            continue
        gather = max(roomy, key=lambda q: (bin_free[q], -q))
        if any(apply(b, gather, cap) for b in roomy if b != gather):
            continue
        # Full microbatches join the region, those of many (short, easily combined) samples first.
        region = np.nonzero(bin_free != 0)[0].tolist()
        full = np.nonzero(bin_free == 0)[0]
        full = full[np.argsort(-np.bincount(bin_of, minlength=bin_free.size)[full], kind="stable")].tolist()
        while not _repack(region, units, costs, bin_of, cap, K):
            if not full:
                return False
            grow = max(8, len(region))
            region, full = region + full[:grow], full[grow:]
        bin_free[:] = T - np.bincount(bin_of, weights=lens, minlength=bin_free.size).astype(np.int64)
    return True


def _repack(
    bins: list[int], units: np.ndarray, costs: np.ndarray, bin_of: np.ndarray, cap: int, K: int
) -> bool:
    """Pack all samples of `bins` again; False (and nothing changed) if some sample finds no place.

    The groups are filled one after another: each takes the largest sample left, then the fullest
    subset of the others (larger samples preferred), so the room left over gathers in the last
    groups. Then the groups go to the microbatches, costliest first, each into the replica that is
    cheapest so far (counting its other microbatches), which keeps the replicas balanced.
    """
    items = np.nonzero(np.isin(bin_of, bins))[0]
    rest = items[np.argsort(-units[items], kind="stable")].tolist()
    groups = []
    while rest and len(groups) < len(bins):
        first, others = rest[0], rest[1:]
        _, taken = _subset_near(units[others].tolist(), cap - int(units[first]), cap - int(units[first]))
        chosen = {first} | {others[k] for k in taken}
        groups.append(sorted(chosen))
        rest = [i for i in rest if i not in chosen]
    if rest:
        return False
    rep_cost = np.bincount(bin_of // K, weights=costs, minlength=bin_of.max() // K + 1)
    rep_cost -= np.bincount(bin_of[items] // K, weights=costs[items], minlength=rep_cost.size)
    free = list(bins)
    for group in sorted(groups, key=lambda g: -costs[g].sum()):
        b = min(free, key=lambda q: (rep_cost[q // K], q))
        free.remove(b)
        bin_of[group] = b
        rep_cost[b // K] += costs[group].sum()
    return True


def _window_candidates(x_len, x_free, y_len, y_bin, y_free):
    """(x index, y index) of group exchanges in place (x into y's microbatch and back) that fit.

    Per partner microbatch: its groups sorted by length, and for each x only those in the window
    [l_x - room there, l_x + room of x's] (narrow once microbatches are nearly full), at most
    _WINDOW on either side of l_x (bounds the work when microbatches still have room).
    """
    order = np.lexsort((y_len, y_bin))
    xs, ys = [], []
    for b in np.unique(y_bin).tolist():
        lo_b, hi_b = np.searchsorted(y_bin[order], [b, b + 1])
        idx = order[lo_b:hi_b]
        room = y_free[idx[0]]
        near = lo_b + np.searchsorted(y_len[idx], x_len)
        lo = np.maximum(lo_b + np.searchsorted(y_len[idx], x_len - room, "left"), near - _WINDOW)
        hi = np.minimum(lo_b + np.searchsorted(y_len[idx], x_len + x_free, "right"), near + _WINDOW)
        counts = hi - lo
        xi = np.repeat(np.arange(x_len.size), counts)
        xs.append(xi)
        ys.append(order[np.repeat(lo - np.cumsum(counts) + counts, counts) + np.arange(xi.size)])
    return np.concatenate(xs), np.concatenate(ys)


def _destination(length, other_len, own_bin, free, roomiest, second, K):
    """Where a sample that leaves `own_bin`'s partner can land in the partner's replica.

    Into the microbatch the other group leaves if that has room once it is gone, else into the
    roomiest other microbatch of that replica if it has room, else nowhere (-1).
    """
    rep = own_bin // K
    alt = np.where(roomiest[rep] != own_bin, roomiest[rep], second[rep])
    return np.where(length - other_len <= free[own_bin], own_bin, np.where(free[alt] >= length, alt, -1))


def _local_search(
    lens: np.ndarray, costs: np.ndarray, bin_of: np.ndarray, bin_free: np.ndarray, dp: int, K: int
):
    """Lower the most expensive replica r by exchanges between microbatches, in place.

    An exchange gives a group x of r for a group y of another replica when every microbatch stays
    within T and the larger of the two new replica costs is below r's old cost; each step takes
    the best. First single samples: x for y (or for nothing, a move), each landing in the
    microbatch the other left or in the roomiest one of its new replica. Then, once microbatches
    are full and only token-neutral exchanges can still move attention cost, groups of one or two
    samples of one microbatch, exchanged in place, with the cheapest replicas.
    """
    rep_cost = np.bincount(bin_of // K, weights=costs, minlength=dp)
    mean = rep_cost.mean()
    for _ in range(_MAX_SEARCH_STEPS):
        r = int(np.argmax(rep_cost))
        top = rep_cost[r]
        if top <= mean * (1 + _GOOD_ENOUGH):
            return
        rep = bin_of // K
        cheap = [int(p) for p in np.argsort(rep_cost, kind="stable")[: _SEARCH_PARTNERS + 1] if p != r]
        mine, theirs = np.nonzero(rep == r)[0], np.nonzero(np.isin(rep, cheap))[0]
        by_room = np.argsort(-bin_free.reshape(dp, K), axis=1, kind="stable") + (np.arange(dp) * K)[:, None]
        roomiest, second = by_room[:, 0], by_room[:, min(1, K - 1)]
        for singles in (True, False):
            if singles:
                x1, x2, x_len, x_bin = mine, np.full(mine.size, -1), lens[mine], bin_of[mine]
                y1, y2, y_len, y_bin = theirs, np.full(theirs.size, -1), lens[theirs], bin_of[theirs]
                empty = np.nonzero(np.arange(dp * K) // K != r)[0]  # a plain move into any other replica
            else:
                x1, x2, x_len, x_bin = _groups(mine, bin_of, lens)
                anchors = mine[np.argsort(-costs[mine], kind="stable")[:_ANCHORS]]
                keep = np.isin(x1, anchors) | np.isin(x2, anchors)  # r's costly samples move cost
                x1, x2, x_len, x_bin = x1[keep], x2[keep], x_len[keep], x_bin[keep]
                y1, y2, y_len, y_bin = _groups(theirs, bin_of, lens)
                empty = np.concatenate([np.arange(p * K, (p + 1) * K) for p in cheap])
            none = np.full(empty.size, -1)
            y1, y2 = np.concatenate([y1, none]), np.concatenate([y2, none])
            y_len, y_bin = (
                np.concatenate([y_len, np.zeros(empty.size, np.int64)]),
                np.concatenate([y_bin, empty]),
            )
            if singles:
                xi, yi = (
                    a.reshape(-1)
                    for a in np.meshgrid(np.arange(x_len.size), np.arange(y_len.size), indexing="ij")
                )
                x_to = _destination(x_len[xi], y_len[yi], y_bin[yi], bin_free, roomiest, second, K)
                y_to = _destination(y_len[yi], x_len[xi], x_bin[xi], bin_free, roomiest, second, K)
                ok = (x_to >= 0) & (y_to >= 0)
                xi, yi, x_to, y_to = xi[ok], yi[ok], x_to[ok], y_to[ok]
            else:
                xi, yi = _window_candidates(x_len, bin_free[x_bin], y_len, y_bin, bin_free[y_bin])
                x_to, y_to = y_bin[yi], x_bin[xi]
            x_cost = costs[x1] + np.where(x2 >= 0, costs[x2], 0.0)
            y_cost = np.where(y1 >= 0, costs[y1], 0.0) + np.where(y2 >= 0, costs[y2], 0.0)
            delta = y_cost[yi] - x_cost[xi]  # change of r's cost
            new_max = np.maximum(top + delta, rep_cost[y_bin[yi] // K] - delta)
            new_max = np.where(delta < 0, new_max, np.inf)
            if new_max.size and new_max.min() < top * (1 - _MIN_GAIN):
                break
        else:
            return
        j = int(np.argmin(new_max))
        a, b = int(xi[j]), int(yi[j])
        rep_cost[r] += delta[j]
        rep_cost[y_bin[b] // K] -= delta[j]
        bin_free[x_bin[a]] += x_len[a]
        bin_free[y_bin[b]] += y_len[b]
        bin_free[x_to[j]] -= x_len[a]
        bin_free[y_to[j]] -= y_len[b]
        for item in (x1[a], x2[a]):
            if item >= 0:
                bin_of[item] = x_to[j]
        for item in (y1[b], y2[b]):
            if item >= 0:
                bin_of[item] = y_to[j]
        assert (bin_free[[x_bin[a], y_bin[b], x_to[j], y_to[j]]] >= 0).all()


def plan_balanced(
    lengths, dp: int, cp: int, T: int, cost_attention: float, microbatch_group: int | None = None
) -> Plan:
    """Minimise the slowest replica's cost with the fewest microbatches per replica (all equal).

    For K = a lower bound, K+1, ...: greedy placement under the cap T, then a repair of what did
    not fit (K+1 if that fails); then local search on the slowest replica (module docstring).
    Deterministic: no randomness, ties go to the lowest index. `microbatch_group`
    (interleaved pipelines) rounds K up to a multiple of it; microbatches may be empty when there
    are fewer samples than microbatch slots.
    """
    lens = _check_inputs(lengths, dp, cp, T, "balanced")
    costs = sample_costs(lens, cost_attention)
    n = lens.size
    order = np.lexsort((np.arange(n), -lens, -costs))  # decreasing cost, then length, then index
    group = microbatch_group or 1
    # Lower bounds: total tokens, and samples longer than T/2 never share a microbatch.
    K = max(1, math.ceil(int(lens.sum()) / (dp * T)), math.ceil(int((2 * lens > T).sum()) / dp))
    K = math.ceil(K / group) * group
    while True:  # terminates: with dp*K >= n every sample gets its own microbatch
        bin_of, bin_free = _greedy(lens, costs, order, dp, K, T)
        if _repair(lens, costs, bin_of, bin_free, T, K):
            break
        K += group
    _local_search(lens, costs, bin_of, bin_free, dp, K)

    members = [[] for _ in range(dp * K)]
    for i in np.argsort(bin_of, kind="stable").tolist():
        members[int(bin_of[i])].append(i)
    microbatches = []
    for r in range(dp):
        mbs = members[r * K : (r + 1) * K]
        mbs.sort(key=lambda mb: (not mb, mb[0] if mb else 0))  # by first sample, empty ones last
        microbatches.append(mbs)
    return _finish(microbatches, costs, cp)


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
        best, bar = None, totals[r] * (1 - _MIN_GAIN)
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
    return _with_imbalance(mbs, [sum(mb_cost(mb) for mb in replica) for replica in mbs])
