"""The check's command line, its steps' time limits, the table and the JSON file (titan_thd/check/__init__.py)."""

from __future__ import annotations

import argparse
import json
import logging
import platform
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from titan_thd.check.steps import Context, Outcome, Row, Step
from titan_thd.parallel.distributed import cuda_summary, parse_device


class StepTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """StepTimeout in this (main) thread after `seconds` (SIGALRM; a CUDA kernel in flight finishes first)."""

    def expire(signum, frame):
        raise StepTimeout(f"time limit {seconds:.0f} s reached")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_step(step: Step, ctx: Context, limit_scale: float) -> Row:
    if step.needs_cuda and not ctx.gpu:
        return Row(step.name, "SKIP", 0.0, "needs CUDA", {})
    limit = (step.limit_s[0] if ctx.gpu else step.limit_s[1]) * limit_scale
    t0 = time.perf_counter()
    try:
        with time_limit(limit):
            out = step.run(ctx)
    except Exception as e:  # noqa: BLE001 - a failing step is a row of the table, the check goes on
        where = traceback.extract_tb(e.__traceback__)[-1]
        message = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(
            f"[{step.name}] FAILED: {message} ({Path(where.filename).name}:{where.lineno})", file=sys.stderr
        )
        out = Outcome("FAIL", message[:100], {"error": message, "at": f"{where.filename}:{where.lineno}"})
    finally:
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
    seconds = time.perf_counter() - t0
    print(f"[{step.name}] {out.verdict} in {seconds:.1f} s: {out.figure}", file=sys.stderr, flush=True)
    return Row(step.name, out.verdict, seconds, out.figure, out.details)


def table(rows: list[Row]) -> str:
    width = max(len(r.step) for r in rows)
    lines = [f"{'step':<{width}}  verdict  seconds  figure", "-" * (width + 40)]
    lines += [f"{r.step:<{width}}  {r.verdict:<7}  {r.seconds:7.1f}  {r.figure}" for r in rows]
    return "\n".join(lines)


def steps() -> list[Step]:
    from titan_thd.check import generation, layers, recipes, resident, vllm_adapters

    return sorted(
        [*recipes.STEPS, *layers.STEPS, *generation.STEPS, *resident.STEPS, *vllm_adapters.STEPS],
        key=lambda s: s.name.split()[0],
    )


def machine(device: torch.device) -> dict:
    from titan_thd.components.hardware import detect

    return {
        "device": detect(device).describe(),
        "cuda": cuda_summary(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m titan_thd.check", description=__doc__)
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N")
    p.add_argument("--out", type=Path, default=Path("check_gpu.json"), help="the JSON file of the table")
    p.add_argument("--only", action="append", default=[], help="run the steps whose name starts so (repeat)")
    p.add_argument("--limit_scale", type=float, default=1.0, help="multiply every step's time limit")
    p.add_argument("--workdir", type=Path, help="where the runs write (default: a temporary folder)")
    p.add_argument("-v", "--verbose", action="store_true", help="show the trainer's log")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    opts = parse(sys.argv[1:] if argv is None else argv)
    try:
        device = parse_device(opts.device)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("titan_thd").setLevel(logging.INFO if opts.verbose else logging.WARNING)
    chosen = [s for s in steps() if not opts.only or any(s.name.startswith(o) for o in opts.only)]
    info = machine(device)
    print(f"check: {info['device']}; {info['cuda']}; torch {info['torch']}", file=sys.stderr)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="titan_thd_check_") as tmp:
        workdir = opts.workdir or Path(tmp)
        ctx = Context(device, device.type == "cuda", workdir)
        rows = [run_step(s, ctx, opts.limit_scale) for s in chosen]
    total = time.perf_counter() - start
    print(table(rows))
    verdicts = [r.verdict for r in rows]
    print(
        f"{verdicts.count('PASS')} PASS, {verdicts.count('FAIL')} FAIL, {verdicts.count('SKIP')} SKIP in {total:.0f} s"
    )
    opts.out.parent.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "device": str(device), "seconds": total, "steps": [asdict(r) for r in rows]}
    opts.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
    print(f"wrote {opts.out}", file=sys.stderr)
    return 1 if "FAIL" in verdicts else 0
