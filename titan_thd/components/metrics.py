"""Per-step metrics: console line, TensorBoard scalars and `<dump_folder>/metrics.jsonl`.

Definitions (docs/design.md §3.6). Token counts are global (all data-parallel replicas):
    loss          token-mean cross-entropy of the step (the language-model loss; aux losses,
                  already normalised by the same trained-token count, are logged as `aux/<name>`
                  and added to it for the gradient)
    tps           real (non-padding) tokens per second of the whole job
    tps_per_rank  tps / world size
    padding_frac  1 - tokens_real / tokens_slots (slots = microbatches x T x data-parallel degree)
    tflops        model FLOPs per second per rank (attention from real document lengths)
    mfu           tflops as a percentage of one rank's peak: `metrics.peak_tflops`, or a measured
                  matmul peak of the compute dtype divided by the ranks that share a CPU
    imbalance     slowest replica's planner cost / mean cost (1.0 = perfectly balanced)
    step_time     seconds of this step; wall_time: seconds since training started

Only the logging rank writes; the other ranks build a disabled logger.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

import torch

from titan_thd.config import Metrics as MetricsConfig

logger = logging.getLogger("titan_thd")

_PEAK_CACHE: dict[tuple[torch.dtype, str], float] = {}


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, seconds: float = 0.3) -> float:
    """Best square-matmul TFLOP/s of `device` in `dtype`, measured once per process.

    On CPU every core available to the process is used for the measurement, so the result is the
    whole machine's peak.
    """
    key = (dtype, str(device))
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    n = 2048 if device.type == "cpu" else 8192
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    try:
        torch.matmul(a, b)  # warm-up (kernel selection, page faults)
        best, start = math.inf, time.perf_counter()
        while time.perf_counter() - start < seconds or best == math.inf:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            torch.matmul(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    _PEAK_CACHE[key] = 2 * n**3 / best / 1e12
    return _PEAK_CACHE[key]


def peak_tflops_per_rank(
    cfg: MetricsConfig, dtype: torch.dtype, device: torch.device, local_world_size: int
) -> float:
    """MFU denominator of one rank: the configured peak, else the measured one (CPU: shared)."""
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops
    peak = measure_matmul_tflops(dtype, device)
    return peak / local_world_size if device.type == "cpu" else peak


def step_metrics(
    *,
    step: int,
    loss: float,
    grad_norm: float,
    lr: float,
    step_time: float,
    wall_time: float,
    tokens_real: int,
    tokens_trained: int,
    tokens_slots: int,
    flops: float,
    num_microbatches: int,
    imbalance: float,
    world_size: int,
    peak_tflops: float,
    aux_losses: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The metrics.jsonl record of one step (definitions in the module docstring)."""
    tps = tokens_real / step_time
    tflops = flops / step_time / world_size / 1e12
    record = {
        "step": step,
        "loss": loss,
        "grad_norm": grad_norm,
        "lr": lr,
        "tps": tps,
        "tps_per_rank": tps / world_size,
        "tokens_real": tokens_real,
        "tokens_trained": tokens_trained,
        "tokens_slots": tokens_slots,
        "padding_frac": 1.0 - tokens_real / tokens_slots if tokens_slots else 0.0,
        "tflops": tflops,
        "mfu": 100.0 * tflops / peak_tflops if peak_tflops > 0 else 0.0,
        "num_microbatches": num_microbatches,
        "imbalance": imbalance,
        "step_time": step_time,
        "wall_time": wall_time,
    }
    record.update({f"aux/{k}": v for k, v in (aux_losses or {}).items()})
    return record


def console_line(r: dict[str, Any]) -> str:
    aux = "".join(f"  {k} {v:.4f}" for k, v in r.items() if k.startswith("aux/"))
    return (
        f"step {r['step']:>5}  loss {r['loss']:.4f}{aux}  grad_norm {r['grad_norm']:.3f}  lr {r['lr']:.2e}  "
        f"tps {r['tps']:,.0f}  pad {100 * r['padding_frac']:.1f}%  tflops {r['tflops']:.3f}  "
        f"mfu {r['mfu']:.1f}%  mb {r['num_microbatches']}  imb {r['imbalance']:.3f}  {r['step_time']:.2f}s"
    )


class MetricsLogger:
    """Writes every step to metrics.jsonl (+ TensorBoard) and prints every `log_freq` steps.

    The jsonl file is opened at the first record: a run that starts at step 1 replaces an older
    file; a resumed run keeps the older records before its first step and drops any after it
    (steps logged after the checkpoint it resumes from), so every step appears once.
    """

    def __init__(self, cfg: MetricsConfig, dump_folder: str, *, enabled: bool):
        self.cfg = cfg
        self.enabled = enabled
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.jsonl = None
        self.tb = None
        if enabled and cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(Path(dump_folder) / "tb"))

    def _open(self, first_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if first_step > 1 and self.path.exists():
            kept = [
                line for line in self.path.read_text().splitlines() if json.loads(line)["step"] < first_step
            ]
        self.jsonl = open(self.path, "w")  # noqa: SIM115 (open for the whole run; close() closes it)
        self.jsonl.writelines(line + "\n" for line in kept)

    def should_print(self, step: int, last_step: int) -> bool:
        return step == 1 or step == last_step or step % self.cfg.log_freq == 0

    def log(self, record: dict[str, Any], last_step: int) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.jsonl is None:
            self._open(step)
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for key, value in record.items():
                if key != "step":
                    self.tb.add_scalar(key, value, step)
        if self.should_print(step, last_step):
            logger.info(console_line(record))

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
