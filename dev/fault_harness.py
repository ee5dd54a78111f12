"""The machinery of dev/fault_injection.py: the worker that patches one fault into a trainer
process (NaN loss, Inf gradient, full disk), the recipes and the runs it starts and kills (process
groups, descendants), and what it reads back from a run folder (complete checkpoints, metrics.jsonl,
TensorBoard, the resume line, folder digests)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPARED = ("loss", "grad_norm", "lr", "tokens_real", "tokens_trained", "num_microbatches")


# ============================================================================ worker (fault hooks)
def worker(fault: str, argv: list[str]) -> int:
    """Run `titan_thd.train.main(argv)` with one fault patched in (this process only)."""
    import torch
    from torch.distributed.tensor import DTensor

    from titan_thd import train
    from titan_thd.pipeline import runner

    kind, step, *only = fault.split(":")
    step = int(step)
    rank = int(os.environ.get("RANK", "0"))
    mine = not only or int(only[0]) == rank
    if kind == "nan_loss":  # the loss of every microbatch of the step, hence its gradients too
        cross_entropy_sum = runner.cross_entropy_sum
        train_step = train.Trainer.train_step
        current = {"step": 0}

        def step_of(self, step_batch):
            current["step"] = self.step
            return train_step(self, step_batch)

        def nan_ce(*args, **kwargs):
            ce = cross_entropy_sum(*args, **kwargs)
            return ce * float("nan") if current["step"] == step and mine else ce

        train.Trainer.train_step = step_of
        runner.cross_entropy_sum = nan_ce
    elif kind == "inf_grad":  # one gradient element of this rank's shard, after the step's backward
        clip_gradients = train.Trainer.clip_gradients

        def inf_grad(self):
            if self.step == step and mine:
                grad = next(self.model.parameters()).grad
                (grad.to_local() if isinstance(grad, DTensor) else grad).view(-1)[0] = math.inf
            return clip_gradients(self)

        train.Trainer.clip_gradients = inf_grad
    elif kind == "enospc":  # this rank's checkpoint files of the step take 4 kB, then the disk is full
        fs = torch.distributed.checkpoint.filesystem.FileSystem
        fs.create_stream = _full_disk(fs.create_stream, f"step-{step}.tmp-" if mine else None, 4096)
    else:
        raise SystemExit(f"unknown fault {fault!r}")
    return train.main(argv)


def _full_disk(create_stream, where: str | None, limit: int):
    @contextlib.contextmanager
    def patched(self, path, mode):
        with create_stream(self, path, mode) as stream:
            if where is None or where not in str(path):
                yield stream
                return
            written = 0

            class Full:
                def __getattr__(self, name):
                    return getattr(stream, name)

                def write(self, data):
                    nonlocal written
                    if written + len(data) > limit:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                    written += len(data)
                    return stream.write(data)

            yield Full()

    return patched


# ============================================================================ runs
@dataclass
class Recipe:
    name: str
    config: str
    overrides: list[str]
    steps: int = 8
    interval: int = 2

    def args(self, dump: Path, cache: Path) -> list[str]:
        return [
            *self.overrides,
            "--training.steps",
            str(self.steps),
            "--lr_scheduler.warmup_steps",
            "2",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            str(self.interval),
            "--metrics.peak_tflops",
            "1",
            "--metrics.log_freq",
            "1",
            "--data.cache_dir",
            str(cache),
            "--job.dump_folder",
            str(dump),
        ]

    @property
    def saves(self) -> list[int]:
        return sorted({*range(self.interval, self.steps + 1, self.interval), self.steps})


RECIPES = {
    "dense": Recipe(
        "dense",
        "debug_dense_thd.toml",
        ["--training.global_batch_size", "4", "--training.tokens_per_microbatch", "512"],
    ),
    "dsv4": Recipe(
        "dsv4",
        "dsv4_flash_thd.toml",
        [
            "--model.flavor",
            "micro",
            "--training.global_batch_size",
            "8",
            "--training.tokens_per_microbatch",
            "256",
            "--optimizer.muon_ns_dtype",
            "float32",
        ],
    ),
}


@dataclass
class Run:
    proc: subprocess.Popen
    log: Path

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def wait(self, timeout: float) -> int | None:
        """Exit status, or None (and the group killed) when it ran past `timeout`: a hang."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> list[int]:
        """SIGKILL the launcher's process group, as `kill -9 -<pgid>` does (run_train.sh and
        torchrun; torchrun's ranks have sessions of their own and must die with torchrun).
        Returns the processes still running 2 s later (then killed one by one)."""
        tree = descendants(self.proc.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        deadline = time.monotonic() + 2
        while (alive := [p for p in tree if running(p)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        for pid in alive:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return alive


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # state, ppid, ... (the name may hold spaces)


def running(pid: int) -> bool:
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def descendants(pid: int) -> list[int]:
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (stat := _stat(int(entry))) is not None:
            parents[int(entry)] = int(stat[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, pp in parents.items() if pp in frontier]
        found += children
        frontier = children
    return found


@dataclass
class Harness:
    workdir: Path
    ngpu: int
    timeout: float = 600.0
    runs: int = 0
    python: str = sys.executable

    def launch(
        self, recipe: Recipe, dump: Path, fault: str | None = None, extra: tuple[str, ...] = ()
    ) -> Run:
        """run_train.sh as a user starts it; with a fault, this script's worker (torchrun when
        ngpu > 1). A new session, so that SIGKILL reaches torchrun and every rank at once."""
        dump.mkdir(parents=True, exist_ok=True)
        self.runs += 1
        log = dump / f"run-{self.runs}.log"
        args = recipe.args(dump, self.workdir / "data_cache") + list(extra)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "NGPU": str(self.ngpu), "LOG_RANK": "0,1"}
        if fault is None:
            cmd = ["./run_train.sh", "--config", recipe.config, *args]
        else:
            script = str(Path(__file__).with_name("fault_injection.py"))  # its --worker mode runs `worker`
            worker_args = [script, "--worker", fault, "--job.config_file", f"train_configs/{recipe.config}"]
            if self.ngpu == 1:
                cmd = [self.python, *worker_args, *args]
            else:
                torchrun = str(Path(self.python).parent / "torchrun")
                cmd = [torchrun, f"--nproc_per_node={self.ngpu}", "--rdzv_backend", "c10d"]
                cmd += ["--rdzv_endpoint=localhost:0", "--role", "rank", "--tee", "3", *worker_args, *args]
        with open(log, "w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        return Run(proc, log)


# ============================================================================ observations
def complete_steps(dump: Path) -> list[int]:
    folder = dump / "checkpoint"
    if not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir() if (m := re.match(r"^step-(\d+)$", p.name)))


def tmp_dirs(dump: Path) -> list[Path]:
    folder = dump / "checkpoint"
    return sorted(p for p in folder.iterdir() if ".tmp-" in p.name) if folder.is_dir() else []


def read_metrics(dump: Path) -> tuple[list[dict], list[str]]:
    """The records of metrics.jsonl, and what is wrong with the file as bytes."""
    path = dump / "metrics.jsonl"
    if not path.exists():
        return [], []
    data = path.read_bytes()
    problems, records = [], []
    lines = data.split(b"\n")
    if lines[-1]:
        problems.append(f"torn last line ({len(lines[-1])} bytes)")
    for i, line in enumerate(lines[:-1], 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            problems.append(f"line {i} is not JSON: {line[:60]!r}...")
    return records, problems


def compare(records: list[dict], ref: dict[int, dict], upto: int | None = None) -> list[str]:
    """Problems of `records` against the reference: steps 1..last exactly once, equal values."""
    steps = [r["step"] for r in records]
    last = upto if upto is not None else (steps[-1] if steps else 0)
    problems = []
    if steps != list(range(1, last + 1)):
        problems.append(f"steps {_ranges(steps)}, expected 1-{last}")
    for r in records:
        want = ref.get(r["step"])
        keys = [k for k in COMPARED if k in r] + [k for k in r if k.startswith("aux/")]
        bad = [k for k in keys if want is None or r[k] != want.get(k)]
        if bad:
            problems.append(f"step {r['step']}: {', '.join(bad)} differ from the reference")
    return problems


def _ranges(steps: list[int]) -> str:
    return ",".join(map(str, steps)) if len(steps) < 12 else f"{steps[:5]}...{steps[-5:]} ({len(steps)})"


def tb_steps(dump: Path, tag: str = "loss") -> list[tuple[int, float]]:
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logging.getLogger("tensorboard").setLevel(logging.ERROR)  # "purging expired events": expected
    acc = EventAccumulator(str(dump / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)] if tag in acc.Tags()["scalars"] else []


def compare_tb(dump: Path, ref: dict[int, dict]) -> list[str]:
    import numpy as np

    got = tb_steps(dump)
    want = [(s, float(np.float32(ref[s]["loss"]))) for s in sorted(ref)]
    if got == want:
        return []
    return [f"TensorBoard loss: steps {_ranges([s for s, _ in got])}, values equal: {got == want}"]


def resumed_from(log: str) -> str | None:
    """The checkpoint folder a run's log says it resumed from ('' when there was none)."""
    if m := re.search(r"checkpoint: resumed from (\S+) in ", log):
        return m.group(1)
    return "" if "nothing to resume" in log else None


def wait_for(pred, run: Run, poll: float, timeout: float) -> bool:
    """Poll `pred()` until true; False when the run ended first (or a timeout)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if run.proc.poll() is not None:
            return bool(pred())
        time.sleep(poll)
    return False


def digest(folder: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }
