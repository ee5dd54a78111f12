"""mHC update (`hc_post`): eager `_Post` (written-out backward) vs `training.compile`'s compiled formula.

Forward + backward of `post_k y + sum_j comb[j, k] h_j` on random float32 inputs, T rows, N = 4
streams, at each `--dims` width. The two forms alternate `--reps` times after a warm-up (the first
compiled call, the compile, is reported apart); the table gives the medians and their ratio. This is
the measurement behind `apply_compile` still swapping the formula in for `hc_post`
(docs/dsv4.md §18). Run it under run_train.sh's allocator to see a training step's conditions:

  MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1099511627776 \\
      .venv/bin/python benchmarks/bench_hc_post.py --threads 2 [--json /tmp/hc_post.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from titan_thd.components.hardware import cpu_model_name
from titan_thd.models.compile import compiled
from titan_thd.models.dsv4.mhc import hc_post, hc_post_formula


def _fwd_bwd_s(fn, args: tuple[torch.Tensor, ...], grad_TND: torch.Tensor) -> float:
    t0 = time.perf_counter()
    fn(*args).backward(grad_TND)
    elapsed = time.perf_counter() - t0
    for a in args:
        a.grad = None
    return elapsed


def measure(T: int, d: int, reps: int, n: int = 4) -> dict:
    g = torch.Generator().manual_seed(0)
    shapes = ((T, d), (T, n, d), (T, n), (T, n, n))
    args = tuple(torch.randn(s, generator=g).requires_grad_() for s in shapes)
    grad_TND = torch.randn(T, n, d, generator=g)
    forms = {"eager": hc_post, "compiled": compiled(hc_post_formula)}
    first_compiled_s = _fwd_bwd_s(forms["compiled"], args, grad_TND)
    for fn in forms.values():  # warm-up
        _fwd_bwd_s(fn, args, grad_TND)
    times: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(reps):
        for name, fn in forms.items():
            times[name].append(_fwd_bwd_s(fn, args, grad_TND))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {
        "T": T,
        "d": d,
        "eager_ms": med["eager"],
        "compiled_ms": med["compiled"],
        "eager_over_compiled": med["eager"] / med["compiled"],
        "first_compiled_call_s": first_compiled_s,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=4096, help="T")
    p.add_argument("--dims", default="256,1024", help="comma list of widths d")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", default="")
    opts = p.parse_args(argv)
    if opts.rows < 1 or opts.reps < 1:
        raise SystemExit(f"error: --rows {opts.rows} and --reps {opts.reps} must be >= 1")
    torch.set_num_threads(opts.threads)
    malloc = "reuse" if os.environ.get("MALLOC_MMAP_MAX_") == "0" else "system"
    print(
        f"hc_post fwd+bwd, float32, {opts.threads} threads, CPU {cpu_model_name()!r}, "
        f"torch {torch.__version__}, glibc malloc {malloc!r}, median of {opts.reps} alternating reps"
    )
    rows = [measure(opts.rows, int(d), opts.reps) for d in opts.dims.split(",")]
    for r in rows:
        print(
            f"  T {r['T']:>6}  d {r['d']:>5}  eager _Post {r['eager_ms']:8.1f} ms  compiled formula "
            f"{r['compiled_ms']:8.1f} ms  eager/compiled {r['eager_over_compiled']:.2f}x  "
            f"(first compiled call {r['first_compiled_call_s']:.1f} s)"
        )
    if opts.json:
        Path(opts.json).write_text(
            json.dumps(
                {"cpu": cpu_model_name(), "malloc": malloc, "threads": opts.threads, "rows": rows}, indent=2
            )
            + "\n"
        )


if __name__ == "__main__":
    main()
