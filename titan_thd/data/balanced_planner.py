"""The `balanced` planner (training.planner = balanced; titan_thd/data/planner.py has the overview).

Minimises the slowest replica's cost with the fewest microbatches K per replica. For K = a lower
bound, K + 1, ...: (1) greedy placement, samples by decreasing cost, each on the replica with the
lowest *projected* final cost, best fit inside it; (2) repair of the samples that fit nowhere by
exact subset-sum re-splits of two microbatches, else a re-packing of the microbatches with room or
overflow (else K + 1); (3) local search: exchanges of samples (then pairs) between the slowest
replica and the others while that lowers the slowest.
"""

from __future__ import annotations

import bisect
import math

import numpy as np

from titan_thd.data.plan import Plan, check_inputs, finish, sample_costs

# Local-search limits; each accepted step strictly lowers the sorted cost vector, so these only
# bound the time on pathological inputs.
_MAX_SEARCH_STEPS = 128
_SEARCH_PARTNERS = 4  # swap partners: the cheapest few replicas
_ANCHORS = 16  # group exchanges: only groups with one of r's 16 costliest samples
_WINDOW = 4  # group exchanges: partner groups looked at on each side of a length
_GOOD_ENOUGH = 1e-3  # stop once the slowest replica is within 0.1 % of the mean
_MIN_GAIN = 1e-4  # or once the best exchange lowers it by less than 0.01 %


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
    lens = check_inputs(lengths, dp, cp, T, "balanced")
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
    return finish(microbatches, costs, cp)
