#!/usr/bin/env python
"""Planner benchmark: `balanced` vs Megatron's `dp_balanced` on lognormal document lengths.

For every dp x cp: the per-rank token budget M is fixed, so T = M * cp tokens per microbatch of
one DP replica. Global batches are formed by a token budget: documents are drawn in order from a
seeded lognormal stream and added while the sum of their padded lengths stays within
mbs_per_replica * dp * T (the document that does not fit opens the next batch); or, with
--batch-docs N, of N documents each. Reported, as the
mean over --steps global batches (both planners see the same batches):

    imbalance  max / mean replica cost, cost = sum(len + b * len^2) over a replica's documents
    waste      1 - real tokens / slot tokens, slots = dp * microbatches per replica * T
    bound      the waste with the token bound ceil(tokens / (dp * T)) microbatches per replica: the
               part of `waste` that comes from the batch itself (the room its last document left
               under the token budget), which no planner avoids
    extra      fraction of batches planned with more microbatches per replica than the token
               bound; each such batch wastes about 1 / (mbs + 1). Some batches have no packing
               within the bound (e.g. two documents of 4096 and 4036 tokens with T = 4096 leave
               60 tokens that no other document fits into, more than the batch's total room).
    plan_ms    CPU time of one planning call (thread time: robust to other load on the machine)

Examples:
    python benchmarks/bench_planner.py
    python benchmarks/bench_planner.py --dp 8 --cp 2 --steps 20 --json /tmp/planner.json
    python benchmarks/bench_planner.py --cost-attention 1.2e-4 --mean-len 2048
    python benchmarks/bench_planner.py --batch-docs 1000 --dp 1 8 --cp 1 2   # planning time per 1000 documents
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.data.packer import padded_lengths
from titan_thd.data.planner import POLICIES, make_plan


def global_batches(rng: np.random.Generator, budget: int, T: int, args: argparse.Namespace, mult: int):
    """Endless stream of padded-length arrays: within `budget` tokens, or of --batch-docs documents."""
    mu = np.log(args.mean_len) - args.sigma**2 / 2  # lognormal with arithmetic mean mean_len (Megatron mock)
    carry: list[int] = []
    while True:
        batch, used = carry, sum(carry)
        while True:
            length = int(
                padded_lengths(
                    np.array([int(np.clip(rng.lognormal(mu, args.sigma), args.min_len, T))]), mult
                )[0]
            )
            if (used + length > budget) if not args.batch_docs else len(batch) == args.batch_docs:
                carry = [length]
                break
            batch.append(length)
            used += length
        yield np.array(batch, dtype=np.int64)


def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for dp in args.dp:
        for cp in args.cp:
            T = args.M * cp
            mult = args.pad_to_multiple or 2 * cp
            stream = global_batches(
                np.random.default_rng(args.seed), args.mbs_per_replica * dp * T, T, args, mult
            )
            batches = [next(stream) for _ in range(args.steps)]
            for policy in POLICIES:
                imb, waste, bound, ms, mbs, extra = [], [], [], [], [], []
                for lengths in batches:
                    start = time.thread_time()
                    plan = make_plan(policy, lengths, dp, cp, T, args.cost_attention)
                    ms.append((time.thread_time() - start) * 1e3)
                    imb.append(plan.imbalance)
                    waste.append(1 - lengths.sum() / (dp * plan.num_microbatches * T))
                    mbs.append(plan.num_microbatches)
                    k_bound = -(-int(lengths.sum()) // (dp * T))
                    bound.append(1 - lengths.sum() / (dp * k_bound * T))
                    extra.append(plan.num_microbatches > k_bound)
                rows.append(
                    {
                        "dp": dp,
                        "cp": cp,
                        "planner": policy,
                        "imbalance": float(np.mean(imb)),
                        "imbalance_max": float(np.max(imb)),
                        "waste": float(np.mean(waste)),
                        "waste_bound": float(np.mean(bound)),
                        "plan_ms": float(np.mean(ms)),
                        "docs": float(np.mean([b.size for b in batches])),
                        "microbatches": float(np.mean(mbs)),
                        "T": T,
                        "extra": float(np.mean(extra)),
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("Examples:")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--dp", type=int, nargs="+", default=[2, 8, 64])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--M", type=int, default=4096, help="tokens per rank per microbatch (T = M * cp)")
    p.add_argument(
        "--mbs-per-replica",
        type=int,
        default=4,
        help="token budget of a global batch in microbatches per replica",
    )
    p.add_argument(
        "--mean-len", type=float, default=1024, help="arithmetic mean of the lognormal document length"
    )
    p.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma")
    p.add_argument("--min-len", type=int, default=16, help="lengths are clipped to [min-len, T]")
    p.add_argument(
        "--pad-to-multiple", type=int, default=0, help="per-document padding (0: 2*cp, as zigzag needs)"
    )
    p.add_argument(
        "--cost-attention",
        type=float,
        default=2e-5,
        help="b in cost = len + b*len^2; 2e-5 ~ Llama-3-8B (2*d*layers / 2*params per token)",
    )
    p.add_argument(
        "--batch-docs",
        type=int,
        default=0,
        help="form global batches of this many documents instead of the token budget",
    )
    p.add_argument("--steps", type=int, default=8, help="global batches per configuration")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write {'rows': [...]} here")
    args = p.parse_args(argv)

    rows = run(args)
    formed = (
        f"{args.batch_docs} documents"
        if args.batch_docs
        else f"documents added while padded tokens <= {args.mbs_per_replica} * dp * T"
    )
    print(
        f"global batch = {formed} (lognormal, mean {args.mean_len:g}, sigma {args.sigma:g}, clipped to "
        f"[{args.min_len}, T]);  T = {args.M} * cp;  "
        f"cost = len + {args.cost_attention:g} * len^2;  mean over {args.steps} batches"
    )
    head = (
        f"{'dp':>3} {'cp':>2} {'T':>6} {'docs':>6} {'planner':>11} {'mbs':>5} {'imbalance':>9} {'imb max':>8} "
        f"{'waste':>7} {'bound':>7} {'extra':>6} {'plan ms':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['dp']:>3} {r['cp']:>2} {r['T']:>6} {r['docs']:>6.0f} {r['planner']:>11} {r['microbatches']:>5.2f} "
            f"{r['imbalance']:>9.4f} {r['imbalance_max']:>8.4f} {100 * r['waste']:>6.2f}% "
            f"{100 * r['waste_bound']:>6.2f}% {r['extra']:>6.2f} {r['plan_ms']:>8.2f}"
        )
    if args.json:
        keys = ("dp", "cp", "planner", "imbalance", "waste", "plan_ms", "waste_bound", "extra")
        Path(args.json).write_text(
            json.dumps({"rows": [{k: r[k] for k in keys} for r in rows], "config": vars(args)}, indent=2)
            + "\n"
        )
    return rows


if __name__ == "__main__":
    main()
