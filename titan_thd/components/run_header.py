"""The log header of a run: what is trained, on what, in which layout, with how much memory.

    for line in header_lines(cfg, ...):
        logger.info("%s", line)

Every value is passed in; nothing here builds a model or runs a forward (the memory lines, the
run's memory plan's `state_line` and `stage_lines` (memory/plan.py), come in as text).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from titan_thd.components import hardware
from titan_thd.components.metrics import peak_source
from titan_thd.components.muon import Muon
from titan_thd.components.precision import Precision, precision_warnings
from titan_thd.components.run_settings import data_description
from titan_thd.components.validation import Validator
from titan_thd.config import Config
from titan_thd.data.dataloader import THDDataLoader
from titan_thd.data.tokenizer import Tokenizer
from titan_thd.parallel.activation_checkpoint import describe
from titan_thd.parallel.parallel_dims import ParallelDims


def model_name(cfg: Config, flavor: str) -> str:
    """`dsv4/tiny`; with an empty flavor the architecture is the config.json of model.hf_path, and the
    header says so: `dsv4 (config.json of PATH)`."""
    return (
        f"{cfg.model.name}/{flavor}" if flavor else f"{cfg.model.name} (config.json of {cfg.model.hf_path})"
    )


def header_lines(
    cfg: Config,
    *,
    flavor: str,
    dims: ParallelDims,
    cp_mode: str,
    device: torch.device,
    fake: bool,
    num_params: int,
    model_args: Any,
    tokenizer: Tokenizer,
    optimizers: Sequence[torch.optim.Optimizer],
    precision: Precision,
    compile_line: str,
    loader: THDDataLoader,
    validator: Validator | None,
    state_line: str,
    stage_lines: Sequence[str],
    ac_regions: Mapping[str, str],
    peak_tflops: float,
    lora_line: str = "",
) -> list[str]:
    """The header's lines, in order (warnings are marked `warning:`); `lora_line`: the adapters, if any."""
    c, d, ac = cfg, dims, cfg.activation_checkpoint
    lines = [
        c.job.description or "titan_thd",
        f"model {model_name(c, flavor)}: {num_params:,} parameters, vocab {model_args.vocab_size} "
        f"(tokenizer {tokenizer.vocab_size}), dtype {c.training.dtype}",
        *([note] if (note := getattr(tokenizer, "added_tokens_note", str)()) else []),
        *([lora_line] if lora_line else []),
        precision.describe(c.training.mixed_precision_param),
        state_line,
        describe(ac.mode, ac.regions, ac.layers, ac_regions),
        *stage_lines,
    ]
    muon = next((o for o in optimizers if isinstance(o, Muon)), None)
    ns = (
        ""
        if muon is None
        else f"; Muon Newton-Schulz in {str(muon.ns_dtype).removeprefix('torch.')} "
        f"(optimizer.muon_ns_dtype = {c.optimizer.muon_ns_dtype})"
    )
    hw = hardware.detect(device)
    lines.append(f"hardware: {hw.describe()}{hardware.describe_malloc(device)}{ns}")
    lines.append(compile_line)  # models/compile.py CompileDecision.describe()
    lines += [f"warning: {w}" for w in precision_warnings(precision, hw, fake)]
    ep = f", ep {d.ep} (experts sharded over efsdp {d.efsdp_degree})" if d.ep_enabled else ""
    hsdp = f" (HSDP: {d.dp_replicate} replicas x {d.dp_shard} shards)" if d.hsdp_enabled else ""
    lines.append(
        f"world {d.world_size} on {device}{' (fake process group)' if fake else ''}: dp {d.dp}{hsdp}, cp {d.cp} "
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
    lines.append(f"MFU peak {peak_tflops:.3f} TFLOP/s per rank ({peak_source(c.metrics, device)})")
    return lines
