"""MoE layer: grouped experts vs the per-expert loop, and all-to-all bytes per layer under EP.

grouped vs loop  forward + backward of the routed experts (rows sorted by expert, uniform random
                 routing, float32, one thread), best of `--reps`, in µs per token, at the `tiny`
                 flavor and at a Flash-shaped width (d 4096, F 2048) with few experts so it fits;
                 each also as a fraction of the one-thread float32 matmul peak (a square 2048
                 matmul timed here), counting 3 projections x (forward + 2 backward) matmuls of
                 2 N k d F flops each: a form near the peak cannot be made much faster.
all-to-all       one dsv4 MoE layer (`tiny`, float32) on 4 gloo processes in ep groups of
                 1, 2 and 4: bytes each rank sends to other ranks per layer, counted at the two
                 row all-to-alls (dispatch and combine; the backward sends as much again), vs
                 the analytic 2 * N k (ep - 1) / ep * d * 4 bytes for N tokens of uniform routing.

  .venv/bin/python scripts/bench_moe.py --json /tmp/bench_moe.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.models.dsv4.args import flavors
from titan_thd.models.dsv4.moe import MoE, grouped_experts, looped_experts
from titan_thd.parallel import expert_parallel
from titan_thd.parallel.spawn import spawn


def matmul_peak_gflops(reps: int = 5, n: int = 2048) -> float:
    """Best float32 square-matmul GFLOP/s on the current threads."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.matmul(a, b)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def time_experts(
    dim: int, hidden: int, n_experts: int, k: int, tokens: int, reps: int, peak_gflops: float
) -> dict:
    torch.manual_seed(0)
    args = dataclasses.replace(flavors["tiny"], dim=dim, moe_inter_dim=hidden, n_experts=n_experts)
    experts = list(MoE(args, hash_routed=False).experts.values())
    rows = tokens * k
    counts = torch.bincount(torch.randint(0, n_experts, (rows,)), minlength=n_experts).tolist()
    x = torch.randn(rows, dim, requires_grad=True)
    grad = torch.randn(rows, dim)
    out = {}
    for name, fn in (
        ("loop", lambda: looped_experts(x, counts, experts)),
        ("grouped", lambda: grouped_experts(x, counts, experts, args.swiglu_limit)),
    ):
        fn().backward(grad)  # warm-up
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn().backward(grad)
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_us_per_token"] = best / tokens * 1e6
        out[f"{name}_peak_frac"] = 3 * 3 * 2 * rows * dim * hidden / best / 1e9 / peak_gflops
    out["speedup"] = out["loop_us_per_token"] / out["grouped_us_per_token"]
    return {"dim": dim, "hidden": hidden, "experts": n_experts, "k": k, "tokens": tokens} | out


def _a2a_body(rank: int, world: int, tokens: int) -> list[dict]:
    torch.set_num_threads(1)
    args = flavors["tiny"]
    sent = [0]
    a2a = expert_parallel.all_to_all_single_autograd

    def counting(x, output_splits, input_splits, group):
        me = dist.get_rank(group)
        sent[0] += (sum(input_splits) - input_splits[me]) * x.shape[1] * x.element_size()
        return a2a(x, output_splits, input_splits, group)

    expert_parallel.all_to_all_single_autograd = counting
    results = []
    for ep in (1, 2, 4):
        groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, world, ep)]
        torch.manual_seed(0)
        moe = MoE(args, hash_routed=False).train()
        torch.nn.init.normal_(moe.gate.weight, std=0.02)  # torch.empty otherwise
        if ep > 1:
            expert_parallel.apply_ep([moe], groups[rank // ep])
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(tokens, args.dim, generator=g)
        sent[0] = 0
        moe(x, torch.zeros(tokens, dtype=torch.long), torch.ones(tokens, dtype=torch.bool))
        analytic = 2 * tokens * args.n_activated_experts * (ep - 1) / ep * args.dim * 4
        results.append({"ep": ep, "bytes_sent_per_layer": sent[0], "analytic_bytes": analytic})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the tiny and a2a cases")
    cli = parser.parse_args()
    torch.set_num_threads(1)
    tiny = flavors["tiny"]
    peak = matmul_peak_gflops()
    report = {
        "matmul_peak_gflops_1thread": peak,
        "grouped_vs_loop": [
            time_experts(
                tiny.dim,
                tiny.moe_inter_dim,
                tiny.n_experts,
                tiny.n_activated_experts,
                cli.tokens,
                cli.reps,
                peak,
            ),
            time_experts(4096, 2048, 4, 2, 128, max(1, cli.reps // 2), peak),  # Flash widths, 4 experts
        ],
        "all_to_all": spawn(_a2a_body, 4, cli.tokens)[0],
    }
    for row in report["grouped_vs_loop"]:
        print(
            f"d {row['dim']} F {row['hidden']} E {row['experts']}: loop {row['loop_us_per_token']:.1f} µs/token, "
            f"grouped {row['grouped_us_per_token']:.1f} µs/token ({row['speedup']:.2f}x); "
            f"of the {peak:.0f} GFLOP/s matmul peak: loop {row['loop_peak_frac']:.0%}, "
            f"grouped {row['grouped_peak_frac']:.0%}"
        )
    for row in report["all_to_all"]:
        print(
            f"ep {row['ep']}: {row['bytes_sent_per_layer']:,} bytes sent per layer (rank 0, forward), "
            f"analytic {row['analytic_bytes']:,.0f}"
        )
    if cli.json:
        cli.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
