"""Process-group start-up, device choice and the few collectives every part needs.

- `init_distributed(comm)` reads the torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK). A world
  of one process creates no process group at all (instant start-up; every helper below then
  degrades to a local no-op), unless it asks for one (`single_rank_group`: mixed precision is
  FSDP2's, which needs a device mesh): then a group of one on an in-process store (no port, a
  few ms). Otherwise: gloo on CPU, NCCL on CUDA, timeout from `comm.init_timeout_seconds` so a
  failing rank cannot hang its peers for the default 30 min.
- `comm.mode = "fake"` (or `init_fake(world_size)`): one process plays rank 0 of a simulated
  world on torch's fake backend. Meshes and sharding plans are real; collectives return
  shape-correct garbage (all_reduce leaves the input unchanged, all_gather repeats the local
  input), and DCP cannot save. A construction dry run, never a numerical one.
- `dist_sum` / `dist_max` reduce over a named mesh, or return the input when the mesh is None.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from titan_thd.config import Comm

Number = TypeVar("Number", torch.Tensor, float, int)


@dataclass(frozen=True)
class DistInfo:
    world_size: int
    rank: int
    local_rank: int
    device: torch.device
    fake: bool = False
    single_rank_group: bool = False
    """A world of one that started a process group of one (mixed precision); `close` ends it."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, str(default))
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} = {value!r}: expected an integer") from None


def cuda_summary() -> str:
    """What this process can compute on, for an error line: `2 CUDA devices (NVIDIA H100 ...)`, or why none."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            return f"this torch {torch.__version__} is a CPU-only build (no CUDA)"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if visible is None else f", CUDA_VISIBLE_DEVICES={visible!r}"
        return f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no CUDA device{shown}"
    n = torch.cuda.device_count()
    return f"{n} CUDA device{'s' * (n != 1)} ({torch.cuda.get_device_name(0)})"


def parse_device(value: str | torch.device, flag: str = "--device") -> torch.device:
    """The device a command line names (`auto`: cuda when available, else cpu), checked against what
    this machine has: ValueError (one line: the flag, the value, what is available, the fix) for an
    unknown name, CUDA without a CUDA device, or a CUDA index past the last device."""
    if isinstance(value, str) and value == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {value!r}: not a device; expected auto, cpu, cuda or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{flag} {value!r}: this project computes on cpu or cuda; use {flag} cpu or cuda")
    if not torch.cuda.is_available():
        raise ValueError(f"{flag} {value}: {cuda_summary()}; use {flag} cpu (or auto)")
    if device.index is not None and device.index >= torch.cuda.device_count():
        last = torch.cuda.device_count() - 1
        raise ValueError(f"{flag} {value}: only {cuda_summary()}; use cuda:0 to cuda:{last}")
    return device


def device_of(local_rank: int) -> torch.device:
    """cuda:<local_rank> when CUDA is present, else the CPU (nothing is set up). Under torchrun, a node
    asked for more processes (NGPU, LOCAL_WORLD_SIZE) than it has CUDA devices is a ValueError on
    every rank alike, before any of them waits for the others."""
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        per_node = max(local_rank + 1, _env_int("LOCAL_WORLD_SIZE", 0))
        if per_node > count:
            raise ValueError(
                f"NGPU={per_node} processes per node (LOCAL_WORLD_SIZE), but this node has only "
                f"{cuda_summary()}; set NGPU={count} or fewer (one process per GPU)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def die_with_parent() -> None:
    """Linux: this process is SIGKILLed when its parent dies (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the call: nobody will send the signal
        os.kill(os.getpid(), signal.SIGKILL)


def select_device(local_rank: int) -> torch.device:
    """`device_of(local_rank)`, made the current CUDA device."""
    device = device_of(local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    return device


def env_device() -> torch.device:
    """The device this process will compute on (LOCAL_RANK of the torchrun environment), before any set-up."""
    return device_of(_env_int("LOCAL_RANK", 0))


def die_with_launcher() -> None:
    """Under torchrun: this rank is SIGKILLed when torchrun dies.

    torchrun starts every rank in a session of its own, so a SIGKILL of torchrun (or of its
    process group) used to leave the ranks training on, writing checkpoints and metrics into the
    folder that the next run resumes from (measured: dev/fault_injection.py).
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        die_with_parent()


def init_distributed(comm: Comm, single_rank_group: bool = False) -> DistInfo:
    """Start the process group described by `comm` and the torchrun environment; a world of one
    process starts a group of one only with `single_rank_group` (and when none exists yet)."""
    die_with_launcher()
    if comm.mode == "fake":
        if "NGPU" not in os.environ:
            raise ValueError(
                "comm.mode = fake needs the simulated world size in the NGPU environment variable (e.g. NGPU=64)"
            )
        return init_fake(_env_int("NGPU", 1), rank=_env_int("RANK", 0))
    world_size, rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    device = select_device(local_rank)
    if world_size > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=comm.init_timeout_seconds),
            device_id=device if device.type == "cuda" else None,
        )
    own = world_size == 1 and single_rank_group and not dist.is_initialized()
    if own:  # an in-process store: nothing to rendezvous with, no port to find
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            device_id=device if device.type == "cuda" else None,
        )
    return DistInfo(world_size, rank, local_rank, device, single_rank_group=own)


def init_fake(world_size: int, rank: int = 0) -> DistInfo:
    """One process simulates `rank` of a `world_size` world on the fake backend (CPU tensors).

    torch creates the FakeStore itself when no store is given (checked on 2.11.0 and 2.13.0).
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"fake process group: rank {rank} is outside a world of {world_size}")
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    return DistInfo(world_size, rank, 0, torch.device("cpu"), fake=True)


def is_fake() -> bool:
    return dist.is_initialized() and dist.get_backend() == "fake"


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def collective_device() -> torch.device:
    """Where small tensors must live for a collective on the default group (NCCL needs CUDA)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank of the default group (the object itself when alone)."""
    if world_size() == 1:
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank of the default group ([obj] when alone or fake)."""
    if world_size() == 1 or is_fake():
        return [obj]
    gathered: list[Any] = [None] * world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def _reduce(x: Number, mesh: DeviceMesh | None, op: dist.ReduceOp) -> Number:
    if mesh is None or mesh.size() == 1:
        return x
    if isinstance(x, torch.Tensor):
        t = x.detach().clone()
    else:
        # a Python number starts on the host; NCCL gets it on its device below
        t = torch.tensor(x, dtype=torch.int64 if isinstance(x, int) else torch.float64, device="cpu")
    if mesh.device_type == "cuda":
        t = t.to(collective_device())
    dist.all_reduce(t, op=op, group=mesh.get_group())
    if isinstance(x, torch.Tensor):
        return t.to(x.device)
    return type(x)(t.item())


def dist_sum(x: Number, mesh: DeviceMesh | None) -> Number:
    """Sum of `x` over the ranks of `mesh` (a 1-D mesh or None); tensors and Python numbers."""
    return _reduce(x, mesh, dist.ReduceOp.SUM)


def dist_max(x: Number, mesh: DeviceMesh | None) -> Number:
    """Maximum of `x` over the ranks of `mesh` (a 1-D mesh or None)."""
    return _reduce(x, mesh, dist.ReduceOp.MAX)


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one rank of the world."""
    if world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@contextlib.contextmanager
def rank_zero_first(rank: int) -> Iterator[None]:
    """Rank 0 runs the body first (e.g. tokenises into a cache), then the other ranks (reading it)."""
    if rank != 0:
        barrier()
    yield
    if rank == 0:
        barrier()


def env_world_size(name: str) -> int:
    """The positive integer in the environment variable `name` (1 when unset); ValueError otherwise."""
    value = os.environ.get(name, "1")
    try:
        world_size = int(value)
    except ValueError:
        world_size = 0
    if world_size < 1:
        raise ValueError(f"environment variable {name} = {value!r}: expected a positive integer (processes)")
    return world_size
