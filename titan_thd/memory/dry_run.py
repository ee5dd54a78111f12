"""The fake-process-group dry run (COMM_MODE=fake): whether its one training step is worth running.

A fake-PG step gathers each FSDP unit in full (the fake all-gather copies the local shard into every
slot) and computes on garbage collectives, so its only use is to show that the layout runs. It is
built on the meta device and its shards filled only for a step that fits: it is skipped, with the
numbers, when this rank's shards, one unsharded unit and the activations cannot fit in this machine
or the step would compute for more than 5 minutes; the meshes, sharding, optimizer and memory lines
are shown anyway.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from titan_thd.components.optimizer import OptimizersContainer
from titan_thd.memory.host import offload_refusal
from titan_thd.memory.live import available_host_bytes
from titan_thd.memory.plan import MemoryPlan, RankMemory, plan_memory
from titan_thd.models.packed_weight import packed_weights
from titan_thd.parallel.fsdp import materialize_sharded
from titan_thd.run import Run

logger = logging.getLogger("titan_thd")

MAX_STEP_SECONDS = 300


def plan_with_activations(run: Run, log: bool) -> MemoryPlan:
    """The dry run's memory plan with its activations, measured after the header (the header came
    from the plan without them, `plan_memory(run, measure=False)`): a model measured on narrowed
    copies takes a minute or more (progress lines), and the layout, sharding and state lines should
    not wait for it. Logs the activation lines where `log` (rank 0)."""
    plan = plan_memory(run)
    if log:
        for line in plan.activation_lines():
            logger.info("%s", line)
    if refusal := offload_refusal(plan):  # every simulated rank is this process: no broadcast
        raise ValueError(refusal)
    return plan


def fake_step_fits(rank: RankMemory, tokens_per_rank: int, flops_per_rank: float, peak_tflops: float) -> bool:
    """True when the dry run's step fits the machine's free memory and MAX_STEP_SECONDS; `rank`: this
    rank's memory plan (memory/plan.py), whose shards (still on the meta device), largest FSDP unit
    and activations (what its microbatches' forwards keep for their backward: without them a long
    microbatch ran this machine out of memory) the step needs. Filled at build, Flash's 135 GiB of
    shards per rank at dp x cp 8 swapped a 24 GiB machine until the kernel killed the dry run."""
    unit, activation_bytes = rank.largest_unit_bytes, rank.activation_bytes
    logger.info("dry run: largest unsharded FSDP unit %.2f GiB (one all-gather)", unit / 2**30)
    # The shards (and a base kept as released), the unit's params, grads and workspace, the
    # activations, a resident base's dequantisation.
    need = rank.startup_bytes + 3 * unit + activation_bytes + rank.dequant_bytes
    free = available_host_bytes()
    if need > free:
        logger.warning(
            "dry run: meshes, sharding and optimizer built (on the meta device); the step is skipped "
            "because this rank's shards (%.1f GiB), one FSDP unit unsharded and one microbatch's "
            "activations need about %.1f GiB and this machine has %.1f GiB free",
            rank.startup_bytes / 2**30,
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


def materialize(model: nn.Module, device: torch.device, optimizers: OptimizersContainer) -> None:
    """Fill this rank's shards for the dry run's step (built on the meta device: `fake_step_fits`).
    FSDP's and TP's DTensors keep their objects; a plain parameter is replaced, and the optimizers
    built on the meta model (no state yet) are pointed at its replacement. A base kept as released
    gets codes and scales of its boxes' stored shapes (`fill_resident`: a dry run reads no folder)."""
    names = {id(p): n for n, p in model.named_parameters()}
    materialize_sharded(model)
    model.to(device)
    fill_resident(model, device)
    now = dict(model.named_parameters())
    for opt in optimizers.optimizers:
        for group in opt.param_groups:
            group["params"] = [now[names[id(p)]] for p in group["params"]]


def fill_resident(model: nn.Module, device: torch.device) -> int:
    """Give every `PackedWeight` (models/packed_weight.py) of a dry run's model codes and scales of its stored
    shapes: random FP8 / FP4 codes and scales of 2^0 (what the step computes on is meaningless, as
    every fake-process-group value is; only the shapes and bytes matter). Returns the bytes."""
    total = 0
    for r in packed_weights(model).values():
        codes, grid = r.fmt.code_shape(r.shape), r.fmt.grid_shape(r.shape)
        # e4m3 bytes below 0x78 are finite (0x7f / 0xff are NaN); FP4 uses every nibble
        r.codes = torch.randint(
            0, 0x78 if r.fmt.kind == "fp8" else 256, codes, dtype=torch.uint8, device=device
        )
        one = torch.full(grid, 127, dtype=torch.uint8, device=device)  # e8m0: 2^(127 - 127)
        r.scale = one if r.fmt.scale_bytes == 1 else torch.ones(grid, device=device)
        total += r.codes.nbytes + r.scale.nbytes
    return total
