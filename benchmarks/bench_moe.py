"""MoE layer: grouped experts vs the per-expert loop, and all-to-all bytes per layer under EP.

grouped vs loop  forward + backward of the routed experts (rows sorted by expert, uniform random
                 routing, float32, `--threads`), in µs per token, at the `tiny` flavor and at a
                 Flash-shaped width (d 4096, F 2048) with few experts so it fits. The grouped form
                 runs one `F.grouped_mm` per projection on the stacked [E, out, in] weights
                 (models/dsv4/moe.py), the loop one F.linear per expert and projection on separate
                 2-D weights (the per-expert layout before stacking), the same values. The two
                 alternate `--reps` times (the machine may be shared); the table gives the
                 medians and the median of the per-pair ratios. Each also as a
                 fraction of the float32 matmul peak (a square 2048 matmul timed here on the same
                 threads), counting 3 projections x (forward + 2 backward) matmuls of 2 N k d F
                 flops each: a form near the peak cannot be made much faster. `weight_sized` lists
                 the ops that create a tensor of a stack's shape in the grouped forward + backward
                 (the three weight gradients: no weight copy), `top_ops` its profile.
all-to-all       one dsv4 MoE layer (`tiny`, float32) on 4 gloo processes in ep groups of
                 1, 2 and 4: bytes each rank sends to other ranks per layer, counted at the two
                 row all-to-alls (dispatch and combine; the backward sends as much again), vs
                 the analytic 2 * N k (ep - 1) / ep * d * 4 bytes for N tokens of uniform routing.

  .venv/bin/python benchmarks/bench_moe.py --json /tmp/bench_moe.json [--threads 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.components.hardware import cpu_model_name
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


class _NewStacks(TorchDispatchMode):
    """Ops that write a tensor of a stack's shape [E, a, b] into new memory (views left out)."""

    def __init__(self, n_experts: int, numel: int):
        super().__init__()
        self.n_experts, self.numel, self.found = n_experts, numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [a for a in [*args, *(kwargs or {}).values()] if torch.is_tensor(a)]
        inputs = {a.untyped_storage().data_ptr() for a in tensors}
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if not torch.is_tensor(t) or t.untyped_storage().data_ptr() in inputs:
                continue
            if t.dim() == 3 and t.shape[0] == self.n_experts and t.numel() == self.numel:
                self.found.append(str(func))
        return out


def time_experts(
    dim: int, hidden: int, n_experts: int, k: int, tokens: int, reps: int, peak_gflops: float
) -> dict:
    torch.manual_seed(0)
    args = dataclasses.replace(flavors["tiny"], dim=dim, moe_inter_dim=hidden, n_experts=n_experts)
    experts = MoE(args, hash_routed=False).experts
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=0.02)
    ws = (experts.w1, experts.w2, experts.w3)
    # The loop as the per-expert layout ran it: separate 2-D weights (slices of a stack would
    # each backpropagate a stack-sized gradient).
    per_expert = [[w[e].detach().clone().requires_grad_() for e in range(n_experts)] for w in ws]
    rows = tokens * k
    counts = torch.bincount(torch.randint(0, n_experts, (rows,)), minlength=n_experts).tolist()
    x = torch.randn(rows, dim, requires_grad=True)
    grad = torch.randn(rows, dim)
    forms = {
        "loop": lambda: looped_experts(x, counts, *per_expert, args.swiglu_limit),
        "grouped": lambda: grouped_experts(x, counts, *ws, args.swiglu_limit),
    }
    times: dict[str, list[float]] = {name: [] for name in forms}
    for fn in forms.values():
        fn().backward(grad)  # warm-up
    leaves = [x, *ws, *(w for ws_e in per_expert for w in ws_e)]
    for _ in range(reps):  # alternating: a load change hits both forms alike
        for name, fn in forms.items():
            for t in leaves:  # as after a step's zero_grad: the backward writes, never accumulates
                t.grad = None
            t0 = time.perf_counter()
            fn().backward(grad)
            times[name].append(time.perf_counter() - t0)
    with _NewStacks(n_experts, experts.w1.numel()) as new:
        forms["grouped"]().backward(grad)
    with torch.profiler.profile() as prof:
        forms["grouped"]().backward(grad)
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:6]
    out = {}
    for name, ts in times.items():
        out[f"{name}_us_per_token"] = statistics.median(ts) / tokens * 1e6
        out[f"{name}_peak_frac"] = 3 * 3 * 2 * rows * dim * hidden / statistics.median(ts) / 1e9 / peak_gflops
    out["speedup"] = statistics.median(a / b for a, b in zip(times["loop"], times["grouped"]))
    out["speedup_range"] = [
        min(a / b for a, b in zip(times["loop"], times["grouped"])),
        max(a / b for a, b in zip(times["loop"], times["grouped"])),
    ]
    out["weight_sized"] = new.found
    out["top_ops"] = [(e.key, round(e.self_cpu_time_total / 1e3, 2)) for e in top]
    return {"dim": dim, "hidden": hidden, "experts": n_experts, "k": k, "tokens": tokens, "reps": reps} | out


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
        ep_mesh = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("rest", "ep"))["ep"]
        torch.manual_seed(0)
        moe = MoE(args, hash_routed=False).train()
        for p in moe.parameters():  # torch.empty otherwise
            torch.nn.init.normal_(p, std=0.02)
        if ep > 1:
            expert_parallel.apply_ep([moe], ep_mesh)
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
    parser.add_argument("--reps", type=int, default=7, help="alternating measurements of each form")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the tiny and a2a cases")
    parser.add_argument("--no-a2a", action="store_true", help="skip the 4-process all-to-all count")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    tiny = flavors["tiny"]
    peak = matmul_peak_gflops()
    cases = [
        (tiny.dim, tiny.moe_inter_dim, tiny.n_experts, tiny.n_activated_experts, cli.tokens, cli.reps),
        (4096, 2048, 4, 2, 128, max(3, cli.reps // 2)),  # Flash widths, 4 experts
        (4096, 2048, 4, 2, 1024, max(3, cli.reps // 2)),  # ... with 512 rows per expert
    ]
    report = {
        "cpu": cpu_model_name(),
        "torch": torch.__version__,
        "threads": cli.threads,
        "matmul_peak_gflops": peak,
        "grouped_vs_loop": [time_experts(*case, peak) for case in cases],
    }
    if not cli.no_a2a:
        report["all_to_all"] = spawn(_a2a_body, 4, cli.tokens)[0]
    print(
        f"{report['cpu']}, torch {report['torch']}, {cli.threads} thread(s), float32 matmul peak {peak:.0f} GFLOP/s"
    )
    for row in report["grouped_vs_loop"]:
        lo, hi = row["speedup_range"]
        print(
            f"d {row['dim']} F {row['hidden']} E {row['experts']} rows {row['tokens'] * row['k']}: "
            f"loop {row['loop_us_per_token']:.1f} µs/token, grouped {row['grouped_us_per_token']:.1f} µs/token "
            f"(grouped {row['speedup']:.2f}x the loop, {lo:.2f}-{hi:.2f} over {row['reps']} pairs); "
            f"of the peak: loop {row['loop_peak_frac']:.0%}, grouped {row['grouped_peak_frac']:.0%}; "
            f"weight-sized tensors created: {row['weight_sized']}"
        )
    for row in report.get("all_to_all", []):
        print(
            f"ep {row['ep']}: {row['bytes_sent_per_layer']:,} bytes sent per layer (rank 0, forward), "
            f"analytic {row['analytic_bytes']:,.0f}"
        )
    if cli.json:
        cli.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
