"""Steps 1 and 3 of the check: both recipes for a few steps on the device in float32 and in mixed bf16,
losses against the CPU in float32; tokens/s, MFU and peak device memory of the mixed runs.

Loss bounds, relative to the CPU float32 loss of the same step (same data, same seeded weights):
- float32 on the GPU vs float32 on the CPU: the same operations on the same numbers, so the runs differ
  only by the order of the summations (cuBLAS / cuDNN tile and split their reductions differently; the
  project never enables TF32). Each length-K reduction then moves by ~sqrt(K) * 6e-8 (at most K * 6e-8),
  ~5e-6 for the K <= 8K of these models; the loss averages thousands of tokens, and the few optimizer
  steps carry these relative gradient differences through lr-sized updates (Adam's sign-like first steps
  flip only elements whose gradient is ~0, which move the loss by ~lr * 0). FP32_BOUND = 1e-4 leaves a
  20x margin and is still ~40x below one bf16 rounding: a kernel that silently computes in reduced
  precision shows.
- mixed bf16 (float32 master weights) vs float32: every forward and backward rounds to bf16 (relative
  U_BF16 = 2^-8 per operation, independent across tokens, so the mean loss moves far less) while the
  master weights take float32 updates, so nothing accumulates; every step within U_BF16 of the loss
  (tests/test_train_precision.py asserts the same bound over 20 CPU steps).
On the CPU (no CUDA) the float32 run is the reference itself and the mixed run is compared with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from titan_thd.check.steps import Context, Outcome, Step
from titan_thd.components.hardware import gpu_peak_tflops

ROOT = Path(__file__).resolve().parents[2]
FP32_BOUND = 1e-4
U_BF16 = 2.0**-8
RECIPES = {"llama": "debug_dense_thd.toml", "dsv4": "dsv4_flash_thd.toml"}
SMALL = {"llama": (), "dsv4": ("--model.flavor", "micro")}
"""What CPU scale adds to each recipe (the dsv4 recipe's smallest flavor)."""
FP32 = ("--training.dtype", "float32", "--training.mixed_precision_param", "float32")
MIXED = ("--training.dtype", "float32", "--training.mixed_precision_param", "bfloat16")
MOCK = '{"mode": "distribution", "type": "lognormal", "min_seq_len": 16, "max_seq_len": 200, "mean_seq_len": 64, "lognormal_sigma": 1.0}'
CPU_SCALE = (  # seconds, not minutes: mock documents (no tokenising), 2 microbatches of 256 tokens a step
    "--data.source", "mock", "--data.num_samples", "16", "--data.mock_config", MOCK,
    "--training.global_batch_size", "2", "--training.tokens_per_microbatch", "256",
)  # fmt: skip


@dataclass
class RunResult:
    losses: list[float]
    tps: float
    """Tokens per second over the steps after the first (the first warms up)."""
    tflops: float
    peak_bytes: int | None
    """torch.cuda.max_memory_allocated of the run (None on the CPU)."""
    estimate_bytes: float | None
    """The run header's per-rank estimate (Trainer.memory.per_rank_total; None on the CPU)."""


def recipe_args(ctx: Context, model: str, precision: tuple[str, ...], dump: Path) -> list[str]:
    steps = 4 if ctx.gpu else 2
    scale = [] if ctx.gpu else [*CPU_SCALE, *SMALL[model]]
    if precision is FP32:  # Muon's Newton-Schulz in bf16 (auto on a GPU) is not a float32 run
        scale += ["--optimizer.muon_ns_dtype", "float32"]
    return [
        "--job.config_file", str(ROOT / "train_configs" / RECIPES[model]),
        *precision, *scale,
        "--training.steps", str(steps), "--training.compile", "false",
        "--lr_scheduler.warmup_steps", "1",
        "--metrics.enable_tensorboard", "false", "--metrics.log_freq", "100", "--metrics.peak_tflops", "1",
        "--checkpoint.enable", "false", "--validation.enable", "false", "--evaluation.enable", "false",
        "--data.cache_dir", str(ctx.workdir / "data_cache"), "--job.dump_folder", str(dump),
    ]  # fmt: skip


def train(ctx: Context, model: str, precision: tuple[str, ...], on_cpu: bool) -> RunResult:
    """The run, in this process on ctx.device, or (`on_cpu` on a CUDA machine) in a child process that
    sees no GPU: the trainer picks its device from what is visible."""
    name = f"{model}_{'fp32' if precision is FP32 else 'mixed'}_{'cpu' if on_cpu else ctx.device.type}"
    key = ("run", name)
    if key in ctx.memo:
        return ctx.memo[key]
    dump = ctx.workdir / name
    argv = recipe_args(ctx, model, precision, dump)
    if on_cpu and ctx.gpu:
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TITAN_THD_DEBUG": ""}
        proc = subprocess.run(
            [sys.executable, "-m", "titan_thd.train", *argv], env=env, capture_output=True, text=True
        )
        if proc.returncode:
            raise RuntimeError(
                f"CPU reference run exited {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}"
            )
        peak = estimate = None
    else:
        from titan_thd.config import load_config
        from titan_thd.startup import resolve_run
        from titan_thd.train import Trainer

        cuda = ctx.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(ctx.device)
        trainer = Trainer(resolve_run(load_config(argv)))
        try:
            trainer.train()
            peak = torch.cuda.max_memory_allocated(ctx.device) if cuda else None
            estimate = trainer.memory.per_rank_total if cuda else None
        finally:
            trainer.close()
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    timed = records[1:] or records
    seconds = sum(r["step_time"] for r in timed)
    result = RunResult(
        losses=[r["loss"] for r in records],
        tps=sum(r["tps"] * r["step_time"] for r in timed) / seconds,
        tflops=sum(r["tflops"] * r["step_time"] for r in timed) / seconds,
        peak_bytes=peak,
        estimate_bytes=estimate,
    )
    ctx.memo[key] = result
    return result


def compare(got: list[float], ref: list[float], bound: float, what: str) -> Outcome:
    rel = [abs(a - b) / abs(b) for a, b in zip(got, ref, strict=True)]
    ok = len(got) == len(ref) and max(rel) <= bound and all(map(torch.isfinite, torch.tensor(got)))
    figure = f"max |dloss|/loss {max(rel):.1e} (bound {bound:.0e}) {what}"
    return Outcome(
        "PASS" if ok else "FAIL", figure, {"losses": got, "reference": ref, "rel": rel, "bound": bound}
    )


def losses_step(model: str, precision: tuple[str, ...]) -> Step:
    mixed = precision is MIXED

    def run(ctx: Context) -> Outcome:
        ref = train(ctx, model, FP32, on_cpu=True).losses
        if not mixed and not ctx.gpu:
            got = ref
            if not ref[-1] < ref[0] * 1.5 or not all(map(torch.isfinite, torch.tensor(ref))):
                return Outcome("FAIL", f"losses {ref}", {"losses": ref})
            return Outcome(
                "PASS", f"losses {ref[0]:.3f} -> {ref[-1]:.3f} (the CPU reference)", {"losses": got}
            )
        got = train(ctx, model, precision, on_cpu=False).losses
        return compare(got, ref, U_BF16 if mixed else FP32_BOUND, f"vs CPU float32, {len(ref)} steps")

    label = "mixed bf16" if mixed else "float32"
    return Step(f"1 {model} {label}", run, limit_s=(240.0, 30.0))


def throughput_step(model: str) -> Step:
    """Tokens/s and MFU of the mixed bf16 run (step 1's when it ran), peak memory against the estimate."""

    def run(ctx: Context) -> Outcome:
        r = train(ctx, model, MIXED, on_cpu=False)
        details = {"tokens_per_s": r.tps, "tflops": r.tflops}
        if not ctx.gpu:
            return Outcome(
                "PASS", f"{r.tps:,.0f} tokens/s on the CPU (MFU and device memory: needs CUDA)", details
            )
        name, peak = gpu_peak_tflops(ctx.device)
        mfu = f"MFU {100 * r.tflops / peak:.1f}% of {peak:.0f} TFLOP/s" if peak else "MFU: peak unknown"
        ratio = r.peak_bytes / r.estimate_bytes if r.estimate_bytes else float("nan")
        details |= {
            "gpu": name,
            "peak_tflops": peak,
            "peak_bytes": r.peak_bytes,
            "estimate_bytes": r.estimate_bytes,
        }
        # The estimate must not be exceeded by much: a plan that under-counts sends long jobs out of memory.
        ok = r.estimate_bytes is not None and r.peak_bytes <= 1.15 * r.estimate_bytes + 256 * 2**20
        figure = (
            f"{r.tps:,.0f} tok/s, {mfu} ({name}); peak {r.peak_bytes / 2**30:.2f} GiB vs estimate "
            f"{(r.estimate_bytes or 0) / 2**30:.2f} GiB ({ratio:.2f}x)"
        )
        return Outcome("PASS" if ok else "FAIL", figure, details)

    return Step(f"3 {model} speed+memory", run, limit_s=(180.0, 30.0))


STEPS = [
    losses_step("llama", FP32),
    losses_step("llama", MIXED),
    losses_step("dsv4", FP32),
    losses_step("dsv4", MIXED),
    throughput_step("llama"),
    throughput_step("dsv4"),
]
