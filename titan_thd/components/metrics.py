"""Per-step metrics: console line, TensorBoard scalars and `<dump_folder>/metrics.jsonl`.

Definitions (docs/design.md §3.6). Token counts are global (all data-parallel replicas):
    loss          token-mean cross-entropy of the step (the language-model loss; aux losses,
                  already normalised by the same trained-token count, are logged as `aux/<name>`
                  and added to it for the gradient)
    tps           real (non-padding) tokens per second of the whole job
    tps_per_rank  tps / world size
    padding_frac  1 - tokens_real / tokens_slots (slots = the rows computed: microbatches x T x
                  data-parallel degree, fewer with data.trim_padding)
    tflops        model FLOPs per second per rank (attention from real document lengths)
    mfu           tflops as a percentage of one rank's peak: `metrics.peak_tflops`, else a GPU's
                  dense bf16 peak (components/hardware.py's table), else a measured matmul peak of
                  the compute dtype (on a CPU divided by the ranks that share it)
    imbalance     slowest replica's planner cost / mean cost (1.0 = perfectly balanced)
    step_time     seconds of this step; wall_time: seconds since training started
    time/<phase>  seconds of the step's phases (sum = step_time up to the logging in between):
                  data (the dataloader's next step), forward_backward (every microbatch, with the
                  collectives inside it: FSDP gathers and reduce-scatters, CP, EP, PP sends),
                  comm (gradient-norm reduction and clipping, the step's loss sums: the
                  collectives outside forward/backward), optimizer (optimizer, LR and router-bias
                  updates). On CUDA each phase ends with a device synchronisation.

Only the logging rank writes; the other ranks build a disabled logger.
"""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from titan_thd.components import hardware
from titan_thd.components.run_settings import write_run_file
from titan_thd.config import Metrics as MetricsConfig
from titan_thd.data.dataloader import StepBatch

logger = logging.getLogger("titan_thd")

_PEAK_CACHE: dict[tuple[torch.dtype, str], float] = {}


PEAK_TRIES = 4
"""Rounds of the matmul peak measurement, a short pause between them: on a shared machine one
round can fall entirely into someone else's burst (a peak measured low makes the MFU exceed 100 %)."""


def measure_matmul_tflops(dtype: torch.dtype, device: torch.device, seconds: float = 0.6) -> float:
    """Best square-matmul TFLOP/s of `device` in `dtype` over `PEAK_TRIES` rounds spread over
    `seconds`, measured once per process, in about 2 to 7 x `seconds` whatever the speed.

    The size grows from 256 (to 2048 on CPU, 8192 on CUDA) while one product of twice the size is
    predicted to take at most `seconds`: a CPU without native bf16 emulates a 2048 x 2048 bf16
    product in about a minute (AVX2, 2 cores), and six of them, on rank 0 only, were a 5-minute
    silence in which the other ranks' barrier timed out (docs/results.md §14). On CPU every core
    available to the process is used for the measurement, so the result is the whole machine's peak.
    """
    key = (dtype, str(device))
    if key in _PEAK_CACHE:
        return _PEAK_CACHE[key]
    n_max = 2048 if device.type == "cpu" else 8192
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(len(os.sched_getaffinity(0)))

    def timed(a: torch.Tensor, b: torch.Tensor) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - t0

    try:
        n = 256
        while True:
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            torch.matmul(a, b)  # warm-up (kernel selection, page faults)
            best = timed(a, b)
            if n >= n_max or 8 * best > seconds:  # the next size's product: 8 x the work
                break
            n *= 2
        for attempt in range(PEAK_TRIES):
            if attempt:
                time.sleep(seconds / PEAK_TRIES / 2)  # the next round at another moment
            start = time.perf_counter()
            while time.perf_counter() - start < seconds / PEAK_TRIES / 2:
                best = min(best, timed(a, b))
    finally:
        torch.set_num_threads(threads)
    _PEAK_CACHE[key] = 2 * n**3 / best / 1e12
    return _PEAK_CACHE[key]


def peak_tflops_per_rank(
    cfg: MetricsConfig, dtype: torch.dtype, device: torch.device, local_world_size: int
) -> float:
    """MFU denominator of one rank: the configured peak, else a GPU's dense bf16 peak from
    `hardware.PEAK_BF16_TFLOPS`, else the measured matmul peak (CPU: shared by its ranks)."""
    if cfg.peak_tflops > 0:
        return cfg.peak_tflops
    if device.type == "cuda" and (table := hardware.gpu_peak_tflops(device)[1]) is not None:
        return table
    peak = measure_matmul_tflops(dtype, device)
    return peak / local_world_size if device.type == "cpu" else peak


def peak_source(cfg: MetricsConfig, device: torch.device) -> str:
    """Where `peak_tflops_per_rank` takes the peak from, for the run header."""
    if cfg.peak_tflops > 0:
        return "metrics.peak_tflops"
    if device.type == "cuda":
        name, table = hardware.gpu_peak_tflops(device)
        if table is not None:
            return f"dense bf16 peak of the {name}, vendor data sheet"
    return "measured matmul peak"


def step_record(
    step: int, result: dict[str, float], batch: StepBatch, *, flops: float, **timing: Any
) -> dict[str, Any]:
    """The metrics.jsonl record of optimizer step `step` from its global values (`result`: loss,
    grad_norm, lr, the aux terms and any val/* metrics) and its batch's counts; `timing`: step_time,
    wall_time, world_size, peak_tflops, phase_times as `step_metrics` takes them."""
    val = {k: v for k, v in result.items() if k.startswith("val/")}
    aux = {k: v for k, v in result.items() if k not in ("loss", "grad_norm", "lr", *val)}
    return (
        step_metrics(
            step=step,
            loss=result["loss"],
            grad_norm=result["grad_norm"],
            lr=result["lr"],
            tokens_real=batch.real_tokens,
            tokens_trained=batch.trained_tokens,
            tokens_slots=batch.slot_tokens,
            flops=flops,
            num_microbatches=batch.num_microbatches,
            imbalance=batch.imbalance,
            aux_losses=aux,
            **timing,
        )
        | val
    )


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
    phase_times: dict[str, float] | None = None,
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
    record.update({f"time/{k}": v for k, v in (phase_times or {}).items()})
    return record


PHASES = ("data", "forward_backward", "comm", "optimizer")
_PHASE_LABELS = {"data": "data", "forward_backward": "fwd+bwd", "comm": "comm", "optimizer": "opt"}


class StepTimer:
    """Seconds per phase of one step (`time/<phase>` in the module docstring)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        assert name in self.seconds, name
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:  # kernels are asynchronous: count them in the phase that queued them
                torch.cuda.synchronize()
            self.seconds[name] += time.perf_counter() - t0

    def pop(self) -> dict[str, float]:
        """The step's phase seconds, and a fresh start for the next step."""
        out, self.seconds = self.seconds, dict.fromkeys(PHASES, 0.0)
        return out


ETA_AFTER = 3
"""Steps timed (after the first step of the process: compilation, allocations, page faults) before
the progress line gives an ETA; before that it says `ETA warming up`."""


def progress_line(step: int, last_step: int, recent_step_times: Sequence[float]) -> str:
    """`step 20/40 (50%), 3.10 s/step (last 10), ETA 1m02s`: steps left x the recent mean step time."""
    head = f"progress: step {step}/{last_step} ({100 * step / last_step:.0f}%)"
    if len(recent_step_times) < ETA_AFTER:
        return f"{head}, ETA warming up"
    per_step = sum(recent_step_times) / len(recent_step_times)
    eta = round((last_step - step) * per_step)
    hours, rest = divmod(eta, 3600)
    clock = f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"
    return f"{head}, {per_step:.2f} s/step (last {len(recent_step_times)}), ETA {clock}"


def mfu_warning(record: dict[str, Any], configured: bool) -> str | None:
    """The warning for an MFU above 100 %: the peak it divides by is too low, which the user can fix."""
    if record["mfu"] <= 100.0:
        return None
    where = (
        "metrics.peak_tflops is set below what the device does"
        if configured
        else "the matmul peak measured at start-up came out low (a busy or shared machine?)"
    )
    return (
        f"metrics: mfu {record['mfu']:.1f} % at step {record['step']} is above 100 %: {where}; "
        f"peak used {100 * record['tflops'] / record['mfu']:.3f} TFLOP/s per rank, step {record['tflops']:.3f}: set "
        "--metrics.peak_tflops to the device's peak per rank (dense, the compute dtype)"
    )


def console_line(r: dict[str, Any]) -> str:
    aux = "".join(f"  {k} {v:.4f}" for k, v in r.items() if k.startswith("aux/"))
    phases = " ".join(f"{_PHASE_LABELS[p]} {r[f'time/{p}']:.2f}" for p in PHASES if f"time/{p}" in r)
    return (
        f"step {r['step']:>5}  loss {r['loss']:.4f}{aux}  grad_norm {r['grad_norm']:.3f}  lr {r['lr']:.2e}  "
        f"tps {r['tps']:,.0f}  pad {100 * r['padding_frac']:.1f}%  tflops {r['tflops']:.3f}  "
        f"mfu {r['mfu']:.1f}%  mb {r['num_microbatches']}  imb {r['imbalance']:.3f}  {r['step_time']:.2f}s"
        + (f" ({phases})" if phases else "")
    )


class MetricsLogger:
    """Writes every step to metrics.jsonl (+ TensorBoard) and prints every `log_freq` steps.

    Crash safety: a SIGKILL at any moment, then a resume, leaves exactly one whole record per
    step in metrics.jsonl (and one TensorBoard value per step and tag):
    - a record is one `write()` of a whole line followed by `fsync` (3 ms measured on ext4, so the
      records of a checkpoint's steps are on disk before the checkpoint is), and TensorBoard is
      flushed every step;
    - the file is prepared at the first record of a run: a run that starts at step 1 replaces an
      older file; a resumed run keeps the older records before its first step and drops those
      after it (steps logged after the checkpoint it resumes from), and a torn last line (a
      process killed in the middle of a write) with a warning. The kept records are written to
      a temporary file that replaces metrics.jsonl in one rename, so a crash during the rebuild
      leaves the old file or the new one, never a mix;
    - TensorBoard is opened with `purge_step` = the first step: readers discard the events of
      that step and later ones that an earlier, interrupted run wrote; a run that starts at step 1
      deletes the older event files (the run it replaces: components/run_settings.py decides
      beforehand whether a new run may replace the folder's metrics).
    `settings` (the run settings) go to `<dump_folder>/run.json` when the file is prepared, and
    `config` (the merged config as TOML) to `<dump_folder>/config.toml` beside it: what
    scripts/convert_hf.py reads when its --config is omitted.
    """

    def __init__(
        self,
        cfg: MetricsConfig,
        dump_folder: str,
        *,
        enabled: bool,
        settings: dict[str, Any] | None = None,
        config: str | None = None,
    ):
        self.cfg = cfg
        self.enabled = enabled
        self.settings = settings
        self.config = config
        self.path = Path(dump_folder) / "metrics.jsonl"
        self.tb_dir = Path(dump_folder) / "tb"
        self.jsonl: io.RawIOBase | None = None
        self.tb = None
        self.mfu_warned = False

    def _kept_records(self, first_step: int) -> list[bytes]:
        """Lines of the existing file with a step before `first_step`, one per step, in order."""
        if first_step <= 1:
            return []
        if not self.path.exists():
            logger.warning("metrics: resuming at step %d without %s: it starts there", first_step, self.path)
            return []
        data = self.path.read_bytes()
        lines = data.split(b"\n")
        torn = lines.pop()  # b"" when the file ends with a newline, as every complete write does
        if torn:
            logger.warning(
                "metrics: %s ends in a torn record (%d bytes, an interrupted write): dropped",
                self.path,
                len(torn),
            )
        by_step: dict[int, bytes] = {}
        for number, line in enumerate(lines, 1):
            try:
                step = int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                logger.warning("metrics: %s line %d is not a record: dropped", self.path, number)
                continue
            if step < first_step:
                by_step[step] = line  # a later record of a step comes from a later (resumed) run
        steps = sorted(by_step)
        if steps != list(range(1, first_step)):
            missing = sorted(set(range(1, first_step)) - set(steps))
            logger.warning(
                "metrics: %s has no record of %d of the steps before %d (first missing: %d)",
                self.path,
                len(missing),
                first_step,
                missing[0],
            )
        return [by_step[s] for s in steps]

    def _open(self, first_step: int) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept = self._kept_records(first_step)
        tmp = self.path.with_name(self.path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.write(b"".join(line + b"\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        if self.settings is not None:
            write_run_file(self.path.parent, self.settings, self.config)
        if first_step <= 1:  # a new run: the replaced run's events would mix with its own
            for old in self.tb_dir.glob("events.out.tfevents.*"):
                old.unlink()
        fd = os.open(self.path.parent, os.O_RDONLY)  # the rename itself is durable
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        # Unbuffered: each record is one write() system call of a whole line.
        self.jsonl = open(self.path, "ab", buffering=0)  # noqa: SIM115 (open for the whole run)
        if self.cfg.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(self.tb_dir), purge_step=first_step)

    def should_print(self, step: int, last_step: int) -> bool:
        return step == 1 or step == last_step or step % self.cfg.log_freq == 0

    def log(self, record: dict[str, Any], last_step: int) -> None:
        if not self.enabled:
            return
        step = record["step"]
        if self.jsonl is None:
            self._open(step)
        line = memoryview((json.dumps(record) + "\n").encode())
        while line:  # a regular file takes it in one call, short of a full disk
            line = line[self.jsonl.write(line) :]
        os.fsync(self.jsonl.fileno())
        if self.tb is not None:
            for key, value in record.items():
                if key != "step":
                    self.tb.add_scalar(key, value, step)
            self.tb.flush()
        if self.should_print(step, last_step):
            logger.info(console_line(record))
        warning = None if self.mfu_warned else mfu_warning(record, self.cfg.peak_tflops > 0)
        if warning is not None:
            logger.warning("%s", warning)
            self.mfu_warned = True

    def close(self) -> None:
        if self.jsonl is not None:
            self.jsonl.close()
            self.jsonl = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None
