"""Host memory: what the ranks of one machine (CPU ranks: all their memory) or one node (the blocks'
inputs that activation_checkpoint.offload keeps there) need, against what it has; the refusals, with
the numbers, before anything is allocated (docs/design.md §5.3). The figures: memory/plan.py.
"""

from __future__ import annotations

import os

from titan_thd.memory.plan import MemoryPlan, RankMemory
from titan_thd.memory.state import size
from titan_thd.parallel.distributed import broadcast_object
from titan_thd.run import Run


def offload_refusal(plan: MemoryPlan) -> str:
    """The refusal of an offload whose node cannot hold it ("" when it fits or without offload)."""
    ranks_per_node, node_bytes, source = plan.node
    need = plan.offloaded_node_bytes(ranks_per_node)
    if not need or need <= node_bytes:
        return ""
    return (
        f"memory: activation_checkpoint.offload keeps {size(need)} of recomputed blocks' inputs in the "
        f"host memory of a node of {ranks_per_node} ranks (the header's host memory line), more than its "
        f"{size(node_bytes)} ({source}); lower training.tokens_per_microbatch, raise "
        "parallelism.context_parallel_degree, set memory.host_gib to the nodes' memory, or "
        "activation_checkpoint.offload = false"
    )


def host_refusal(
    plan: MemoryPlan, local_ranks: int, available: float, tokens_per_microbatch: int, cp: int, ac_mode: str
) -> str:
    """The host-memory refusal's message ("" when the fullest host's ranks fit in `available`): CPU
    ranks share their host's memory, and a run that cannot fit is refused with the numbers instead of
    being killed by the kernel in its first step (which can take the user's other work with it)."""
    need = plan.host_bytes(local_ranks)
    if need <= available:
        return ""
    counts = plan.host_ranks(local_ranks)

    def each(r: RankMemory) -> str:
        return size(r.total_bytes) + (" (start-up)" if r.startup_bytes > r.steady_bytes else "")

    if len(counts) == 1:
        ranks = f"{local_ranks} rank(s) on this host x {each(plan.ranks[counts[0][0]])} estimated per rank"
    else:
        listed = " + ".join(f"{n} x {each(plan.ranks[r])} (pp rank {r})" for r, n in counts)
        ranks = f"{local_ranks} rank(s) on this host: {listed} estimated per rank"
    line = "activation line" if plan.schedule is None else "pp rank lines"
    return (
        f"memory: {ranks} (the header's {line}: training.tokens_per_microbatch {tokens_per_microbatch:,} "
        f"over context parallel degree {cp}, activation_checkpoint.mode = {ac_mode}) = {size(need)}, more "
        f"than the {size(available)} this machine has available; recompute "
        "(--activation_checkpoint.mode full), lower training.tokens_per_microbatch or raise "
        "parallelism.context_parallel_degree"
    )


def refuse_beyond_host(plan: MemoryPlan | None, available: float | None, run: Run, is_main: bool) -> None:
    """ValueError on every rank when the fullest host's ranks cannot fit in `available` bytes (None: not
    a CPU run, whose ranks' memory is not the host's), or when activation_checkpoint.offload's inputs
    do not fit a node's host memory (rank 0, `is_main`, decides with its plan of `run` and tells the
    others: they refuse together). A collective."""
    message = ""
    if is_main:
        assert plan is not None  # rank 0 plans the memory
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        t, ac = run.cfg.training, run.cfg.activation_checkpoint
        if available is not None:
            message = host_refusal(plan, local, available, t.tokens_per_microbatch, run.dims.cp, ac.mode)
        message = message or offload_refusal(plan)
    if message := broadcast_object(message):
        raise ValueError(message)
