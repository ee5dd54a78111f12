"""The fake-process-group dry run (COMM_MODE=fake): whether its one training step is worth running.

A fake-PG step gathers each FSDP unit in full (the fake all-gather copies the local shard into every
slot) and computes on garbage collectives, so its only use is to show that the layout runs. It is
skipped, with the numbers, when one unsharded unit cannot fit in this machine or the step would
compute for more than 5 minutes; the meshes, sharding, optimizer and memory lines are shown anyway.
"""

from __future__ import annotations

import logging

from titan_thd.memory.live import available_host_bytes
from titan_thd.memory.plan import RankMemory

logger = logging.getLogger("titan_thd")

MAX_STEP_SECONDS = 300


def fake_step_fits(rank: RankMemory, tokens_per_rank: int, flops_per_rank: float, peak_tflops: float) -> bool:
    """True when the dry run's step fits the machine's free memory and MAX_STEP_SECONDS; `rank`: this
    rank's memory plan (memory/plan.py), whose largest FSDP unit and activations (what its microbatches'
    forwards keep for their backward: without them a long microbatch ran this machine out of memory)
    the step needs."""
    unit, activation_bytes = rank.largest_unit_bytes, rank.activation_bytes
    logger.info("dry run: largest unsharded FSDP unit %.2f GiB (one all-gather)", unit / 2**30)
    need = 3 * unit + activation_bytes  # the unit's params, grads, workspace; the activations
    free = available_host_bytes()
    if need > free:
        logger.warning(
            "dry run: meshes, sharding and optimizer built; the step is skipped because one FSDP unit "
            "unsharded and one microbatch's activations need about %.1f GiB and this machine has %.1f "
            "GiB free",
            need / 2**30,
            free / 2**30,
        )
        return False
    # With expert parallelism even `flash` fits; its step would then compute for an hour on a CPU.
    seconds = flops_per_rank / (peak_tflops * 1e12) if peak_tflops > 0 else 0.0
    if seconds > MAX_STEP_SECONDS:
        logger.warning(
            "dry run: meshes, sharding and optimizer built; the step is skipped because one "
            "microbatch of %d tokens per rank is %.1e FLOPs, about %.0f min at this machine's %.3f TFLOP/s",
            tokens_per_rank,
            flops_per_rank,
            seconds / 60,
            peak_tflops,
        )
        return False
    return True
