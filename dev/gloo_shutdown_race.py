"""The gloo shutdown race of titan_thd/exits.py, measured: how often a rank aborts (SIGABRT, exit
code -6) when it ends, for the two ways a rank can end, side by side on the same loaded machine.

    .venv/bin/python dev/gloo_shutdown_race.py --rounds 20 --json race.json

Each round runs two 4-process torchrun jobs at once. Every rank does what the end of a DP 2 x CP 2
trainer run does: the trainer's named meshes, collectives on each of them, `any_rank`, the final
barrier, `destroy_process_group`; then one job returns from its main function as a rank used to
(the interpreter finalizes) and the other ends with `exits.exit_process` (as the trainer does
now). `--busy` processes spin meanwhile, and with `--lag` (default) the gloo worker threads run at
SCHED_IDLE from the final barrier on (CPU only when nothing else wants it): the delay that a busy
machine gives such a thread now and then, made frequent. A job fails when a rank aborts; its rank
logs then say `terminate called without an active exception` (a core dump shows
`~AsyncBarrierWork` -> `take_gil` -> `PyThread_exit_thread` -> `std::terminate`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
ENDINGS = ("finalize", "exit_process")


def worker(ending: str, lag: bool) -> int:
    """One rank (run under torchrun)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from titan_thd import exits
    from titan_thd.parallel import distributed as du
    from titan_thd.parallel.parallel_dims import ParallelDims

    du.die_with_launcher()
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    dims = ParallelDims(pp=1, dp_shard=2, cp=2, tp=1, world_size=4)
    dims.build_meshes("cpu")
    for _ in range(5):  # a few "steps" of collectives on every mesh
        for name in ("loss", "cp", "batch"):
            group = dims.get_mesh(name).get_group()
            t = torch.ones(1000, dtype=torch.float64)
            dist.all_reduce(t, group=group)
            dist.all_gather_single(
                torch.empty(dims.get_mesh(name).size() * 1000, dtype=torch.float64), t, group=group
            )
        du.any_rank(False)
    if lag:
        for tid in os.listdir("/proc/self/task"):
            if Path(f"/proc/self/task/{tid}/comm").read_text().strip() == "pt_gloo_runloop":
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
    du.barrier()
    du.destroy()
    if ending == "exit_process":
        exits.exit_process(0)
    return 0


def spin() -> None:
    while True:
        pass


def launch(ending: str, lag: bool, log_dir: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--rdzv-backend", "c10d"]
    cmd += ["--rdzv-endpoint", "localhost:0", "--log-dir", str(log_dir), "--redirects", "3"]
    cmd += [__file__, "--worker", ending, *(["--lag"] if lag else ["--no-lag"])]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )


def aborted_ranks(log_dir: Path) -> int:
    return sum("terminate called" in p.read_text() for p in log_dir.rglob("stderr.log"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument(
        "--busy", type=int, default=2, help="spinning processes (default 2: both cores of CI)"
    )
    parser.add_argument("--lag", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=ENDINGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        sys.exit(worker(args.worker, args.lag))
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(args.busy)]
    for p in spinners:
        p.start()
    results: dict[str, dict[str, Any]] = {e: {"runs": 0, "failed": 0, "aborted_ranks": 0} for e in ENDINGS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(args.rounds):
                jobs = {
                    e: (launch(e, args.lag, Path(tmp) / f"{r}-{e}"), Path(tmp) / f"{r}-{e}") for e in ENDINGS
                }
                for ending, (proc, log_dir) in jobs.items():
                    proc.communicate(timeout=600)
                    results[ending]["runs"] += 1
                    results[ending]["failed"] += proc.returncode != 0
                    results[ending]["aborted_ranks"] += aborted_ranks(log_dir)
                print(
                    f"round {r + 1}/{args.rounds}: "
                    + ", ".join(f"{e} {v['failed']} failed" for e, v in results.items())
                )
    finally:
        for p in spinners:
            p.kill()
    print(f"\n{'ending':<14} {'runs':>5} {'failed':>7} {'ranks aborted':>14}")
    for ending, v in results.items():
        print(f"{ending:<14} {v['runs']:>5} {v['failed']:>7} {v['aborted_ranks']:>14}")
    if args.json:
        config = {"rounds": args.rounds, "busy": args.busy, "lag": args.lag, "cpus": os.cpu_count()}
        args.json.write_text(json.dumps({"config": config, "results": results}, indent=2))


if __name__ == "__main__":
    main()
