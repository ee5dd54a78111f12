"""Microbatch planner: the samples of one global batch -> microbatches of every DP replica.

DESIGN.md section 3.2. Both policies are pure, deterministic functions of the padded sample
lengths, `dp`, `cp` and `T` (the tokens of one microbatch of one DP replica before the CP split;
Megatron's per-bin capacity C = M * cp). Every rank computes the same plan and reads only its own
samples.

Cost model: a sample of padded length L costs `L + b * L**2` (linear work per token plus attention
work, b = `cost_attention`); a microbatch costs the sum over its samples, a replica the sum over
its microbatches. Under CP each of the `cp` ranks of a replica carries cost / cp, which is what
`Plan.replica_costs` reports. `Plan.imbalance` = max / mean replica cost (1.0 = perfect).

- `dp_balanced`: Megatron's order-preserving next-fit + tail splitting + round-robin
  (megatron_thd_spec.md section 1.2), with the `i >= 0` fix and a ValueError instead of an empty
  bin for a sample longer than T. Token counts only; it does not balance.
- `balanced`: minimises the slowest replica's cost with the fewest microbatches K per replica.
  For K = a lower bound, K + 1, ...: (1) greedy placement, samples by decreasing cost, each on the
  replica with the lowest *projected* final cost (cost now + its missing tokens at the average
  cost per token still to place), best fit inside it; (2) repair of the samples that fit nowhere
  by exchanging groups of one or two samples between microbatches until none overflows (else
  K + 1); (3) local search: exchanges of samples (then pairs) between the slowest replica and
  the others while that lowers the slowest. A heuristic (the problem is NP-hard): on tiny inputs
  it finds the optimal K and comes within a few % of the optimal cost (brute force in
  tests/data/test_planner.py); a few ms for 1000 samples (scripts/bench_planner.py).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import numpy as np

POLICIES = ("balanced", "dp_balanced")

# Local-search limits; each accepted step strictly lowers the sorted cost vector, so these only
# bound the time on pathological inputs.
_MAX_SEARCH_STEPS = 128
_SEARCH_PARTNERS = 4  # swap partners: the cheapest few replicas
_ANCHORS = 16  # group exchanges: only groups with one of r's 16 costliest samples
_WINDOW = 4  # group exchanges: partner groups looked at on each side of a length
_REPAIR_DONORS = 16  # the overflow repair asks the roomiest microbatches first
_GOOD_ENOUGH = 1e-3  # stop once the slowest replica is within 0.1 % of the mean
_MIN_GAIN = 1e-4  # or once the best exchange lowers it by less than 0.01 %


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
    replica = np.array([sum(costs[i] for mb in mbs for i in mb) for mbs in microbatches]) / cp
    mean = float(replica.mean())
    imbalance = float(replica.max()) / mean if mean > 0 else 1.0
    return Plan(microbatches, [float(c) for c in replica], imbalance)


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


def _best_relief(z_len: np.ndarray, ex: int | None, donors: np.ndarray, lens, bin_of, bin_free):
    """Best exchange of a group of microbatch o (group lengths `z_len`) for a group of one of `donors`
    (or nothing): returns (index into z_len, (w1, w2, w_len, w_bin), index of w) or None.

    o overflows by `ex`: moving d tokens to a donor with `free` room removes
    min(d, ex, free, ex + free - d) tokens of overflow, so per donor group only the two z groups
    around d = min(ex, free) need checking (a binary search over the sorted z lengths).
    `ex` None: o has room and gathers more, the largest d <= free.
    """
    w1, w2, w_len, w_bin = _groups(np.nonzero(np.isin(bin_of, donors))[0], bin_of, lens)
    none = np.full(donors.size, -1)  # taking nothing back = a plain move
    w1, w2 = np.concatenate([w1, none]), np.concatenate([w2, none])
    w_len, w_bin = np.concatenate([w_len, np.zeros(donors.size, np.int64)]), np.concatenate([w_bin, donors])
    z_order = np.argsort(z_len, kind="stable")
    z_sorted = z_len[z_order]
    free = bin_free[w_bin]
    if ex is None:
        candidates = (np.searchsorted(z_sorted, w_len + free, "right") - 1,)
    else:
        above = np.searchsorted(z_sorted, w_len + np.minimum(ex, free))  # first group with d >= min(ex, free)
        candidates = (above, above - 1)
    best_gain, best_pick = np.zeros(w_len.size, np.int64), np.full(w_len.size, -1)
    for cand in candidates:
        valid = (cand >= 0) & (cand < z_sorted.size)
        d = z_sorted[np.clip(cand, 0, z_sorted.size - 1)] - w_len
        if ex is None:
            gain = np.where(valid & (d > 0) & (d <= free), d, 0)
        else:
            gain = np.where(
                valid & (d > 0), np.minimum(np.minimum(d, ex), np.minimum(free, ex + free - d)), 0
            )
        better = gain > best_gain
        best_gain = np.where(better, gain, best_gain)
        best_pick = np.where(better, cand, best_pick)
    w = int(np.argmax(best_gain))
    if best_gain[w] <= 0:
        return None
    return int(z_order[best_pick[w]]), (w1, w2, w_len, w_bin), w


def _repair(lens: np.ndarray, bin_of: np.ndarray, bin_free: np.ndarray) -> bool:
    """Fit the samples the greedy pass could not place; False if some microbatch stays over T.

    Leftovers go (over capacity) to the microbatches with the most room; then, while a microbatch
    o overflows, one or two of its samples are exchanged for zero, one or two samples of a
    microbatch with room (the roomiest few first, then all). When no such exchange exists, room
    is gathered first: the roomiest microbatch takes room from the others by the same kind of
    exchange, which widens the lengths that fit there. Total overflow falls at every exchange
    with o and the largest room grows at every gathering step, so this ends.
    """
    left = np.nonzero(bin_of < 0)[0]
    for i in left[np.argsort(-lens[left], kind="stable")].tolist():
        b = int(np.argmax(bin_free))
        bin_of[i] = b
        bin_free[b] -= lens[i]
    while (bin_free < 0).any():
        roomy = np.nonzero(bin_free > 0)[0]
        roomy = roomy[np.argsort(-bin_free[roomy], kind="stable")]
        o = int(np.argmin(bin_free))
        ex = -int(bin_free[o])
        for donors in (roomy[:_REPAIR_DONORS], roomy[_REPAIR_DONORS:], None):
            if donors is None and roomy.size > 1:  # gather room in the roomiest microbatch
                o, ex, donors = int(roomy[0]), None, roomy[1:]
            if donors is None or donors.size == 0:
                continue
            z1, z2, z_len, _ = _groups(np.nonzero(bin_of == o)[0], bin_of, lens)
            found = _best_relief(z_len, ex, donors, lens, bin_of, bin_free)
            if found is not None:
                break
        else:
            return False
        z, (w1, w2, w_len, w_bin), w = found
        b = int(w_bin[w])
        for item in (z1[z], z2[z]):
            if item >= 0:
                bin_of[item] = b
        for item in (w1[w], w2[w]):
            if item >= 0:
                bin_of[item] = o
        d = int(z_len[z] - w_len[w])
        bin_free[o] += d
        bin_free[b] -= d
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
        if _repair(lens, bin_of, bin_free):
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
) -> Plan:
    """Dispatch on `training.planner`."""
    if policy == "balanced":
        return plan_balanced(lengths, dp, cp, T, cost_attention, microbatch_group)
    if policy == "dp_balanced":
        return plan_dp_balanced(lengths, dp, cp, T, microbatch_group, cost_attention)
    raise ValueError(f"training.planner: got {policy!r}, expected one of {', '.join(POLICIES)}")
