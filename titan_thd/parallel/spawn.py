"""Run a function in N local gloo processes (multi-process tests and benchmarks on CPU).

    def body(rank, world_size, arg):       # module-level, so it pickles
        ...                                 # the default process group is initialised
        return something_picklable

    results = spawn(body, 2, arg)           # [result of rank 0, result of rank 1]

A failure on any rank raises in the caller with that rank's traceback; `timeout` bounds the whole
run so a hung collective cannot stall CI.
"""

from __future__ import annotations

import io
import os
import queue
import socket
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, args, results, collective_timeout):
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=collective_timeout),
        )
        out = fn(rank, world_size, *args)
        # Serialise to bytes: tensors sent through a torch.multiprocessing queue live in shared
        # memory that disappears when this process exits before the parent reads them.
        buf = io.BytesIO()
        torch.save(out, buf)
        results.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report every failure to the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 300, collective_timeout: float = 60
) -> list[Any]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_worker, args=(fn, r, world_size, port, args, results, collective_timeout))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outs: dict[int, Any] = {}
    failures: list[str] = []
    try:
        for _ in range(world_size):
            try:
                rank, ok, out = results.get(timeout=timeout)
            except queue.Empty:
                failures.append(
                    f"timed out after {timeout}s waiting for ranks {sorted(set(range(world_size)) - set(outs))}"
                )
                break
            if ok:
                outs[rank] = torch.load(io.BytesIO(out), weights_only=False)
            else:
                failures.append(f"rank {rank} failed:\n{out}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if not failures else 1)
            if p.is_alive():
                p.kill()
    if failures:
        raise RuntimeError("\n".join(failures))
    return [outs[r] for r in range(world_size)]
