"""The log header of a run: what is trained, on what, in which layout, with how much memory.

    for line in header_lines(cfg, ...):
        logger.info("%s", line)

Every value is passed in; nothing here builds a model or runs a forward (the pipeline stage lines,
which need a meta build and an activation measurement, come in as `stage_lines`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from titan_thd.components import hardware
from titan_thd.components.muon import Muon
from titan_thd.components.run_settings import data_description
from titan_thd.parallel.fsdp import estimate_memory_per_rank
from titan_thd.parallel.parallel_dims import ParallelDims

if TYPE_CHECKING:
    from titan_thd.components.validation import Validator
    from titan_thd.config import Config
    from titan_thd.data.dataloader import THDDataLoader
    from titan_thd.data.tokenizer import Tokenizer


def header_lines(
    cfg: Config,
    *,
    dims: ParallelDims,
    cp_mode: str,
    device: torch.device,
    fake: bool,
    model: nn.Module,
    num_params: int,
    model_args: Any,
    tokenizer: Tokenizer,
    optimizers: Sequence[torch.optim.Optimizer],
    muon_params: Sequence[str],
    dtype: torch.dtype,
    loader: THDDataLoader,
    validator: Validator | None,
    stage_lines: Sequence[str],
    peak_tflops: float,
) -> list[str]:
    """The header's lines, in order (warnings are marked `warning:`)."""
    c, d = cfg, dims
    lines = [
        c.job.description or "titan_thd",
        f"model {c.model.name}/{c.model.flavor}: {num_params:,} parameters, vocab {model_args.vocab_size} "
        f"(tokenizer {tokenizer.vocab_size}), dtype {c.training.dtype}",
        str(estimate_memory_per_rank(model, d, c.optimizer.name, dtype, muon_params)),
        *stage_lines,
    ]
    muon = next((o for o in optimizers if isinstance(o, Muon)), None)
    ns = (
        ""
        if muon is None
        else f"; Muon Newton-Schulz in {str(muon.ns_dtype).removeprefix('torch.')} "
        f"(optimizer.muon_ns_dtype = {c.optimizer.muon_ns_dtype})"
    )
    lines.append(f"hardware: {hardware.detect(device).describe()}{ns}")
    ep = f", ep {d.ep} (experts sharded over efsdp {d.efsdp_degree})" if d.ep_enabled else ""
    lines.append(
        f"world {d.world_size} on {device}{' (fake process group)' if fake else ''}: dp {d.dp}, cp {d.cp} "
        f"({cp_mode}), tp {d.tp}, pp {d.pp}{ep}"
    )
    counts = loader.overlong_counts
    lines.append(
        f"data {c.data.source} {data_description(c)}: {loader.steps.num_samples} samples; "
        f"{counts['truncated']} truncated, {counts['dropped']} dropped (longer than T = "
        f"{c.training.tokens_per_microbatch}); global batch {c.training.global_batch_size}"
    )
    if validator is not None:
        v = c.validation
        lines.append(
            f"validation: {validator.num_docs} documents "
            f"({f'fraction {v.fraction} held out of the data' if v.fraction else v.path}) in "
            f"{validator.num_batches} batches, after every {v.freq} steps and the last"
            + ("; padded forward compared" if v.compare_padded else "")
        )
    if c.training.global_batch_size < d.dp:
        lines.append(
            f"warning: training.global_batch_size = {c.training.global_batch_size} samples for {d.dp} "
            f"data-parallel replicas: at least {d.dp - c.training.global_batch_size} replicas train on "
            "padding only every step"
        )
    source = "metrics.peak_tflops" if c.metrics.peak_tflops else "measured matmul peak"
    lines.append(f"MFU peak {peak_tflops:.3f} TFLOP/s per rank ({source})")
    return lines
