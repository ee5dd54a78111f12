"""End to end through ./run_train.sh: a real 20-step run whose loss falls, a 2-rank run with the
same losses, a fake-process-group dry run, and the user errors of the launcher."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
        ["./run_train.sh", *args], cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
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
    keys = {
        "step",
        "loss",
        "grad_norm",
        "lr",
        "tps",
        "tokens_real",
        "tokens_slots",
        "padding_frac",
        "tflops",
        "mfu",
        "num_microbatches",
        "imbalance",
        "wall_time",
    }
    assert keys <= set(recs[0])
    first = sum(r["loss"] for r in recs[:3]) / 3
    last = sum(r["loss"] for r in recs[-3:]) / 3
    assert last < first - 1.0, (first, last)  # bytes: ~6 at init; the chat format is learnt fast
    assert all(0 <= r["padding_frac"] < 1 and r["tps"] > 0 and r["num_microbatches"] >= 1 for r in recs)
    assert list((dump / "tb").glob("events.out.tfevents.*"))
    assert "step    20  loss" in proc.stdout + proc.stderr  # console line of the last step


@pytest.mark.slow
def test_two_ranks_reproduce_the_single_rank_losses(run20, tmp_path):
    """FSDP over 2 gloo ranks: same data, same init, global-token loss -> the same losses."""
    proc = run_train(
        "--config",
        CONFIG,
        *SMALL,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.enable_tensorboard",
        "false",
        env={"NGPU": "2"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    one, two = records(run20[0])[:3], records(tmp_path)
    for a, b in zip(one, two):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
        assert b["tokens_real"] == a["tokens_real"] and b["tokens_trained"] == a["tokens_trained"]
    assert "[rank1]" not in proc.stdout + proc.stderr  # LOG_RANK defaults to rank 0 only


@pytest.mark.slow
def test_resume_from_checkpoint_continues_the_run(run20, tmp_path):
    """Stop after step 2 (checkpoint), resume to step 4: the steps match the uninterrupted run."""
    common = [
        "--config",
        CONFIG,
        *SMALL,
        "--checkpoint.enable",
        "true",
        "--lr_scheduler.total_steps",
        "20",
        "--job.dump_folder",
        str(tmp_path),
        "--metrics.enable_tensorboard",
        "false",
    ]
    for steps in ("2", "4"):
        proc = run_train(*common, "--training.steps", steps)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "checkpoint: resumed from" in proc.stderr
    resumed, reference = records(tmp_path), records(run20[0])[:4]
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(resumed, reference):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["lr"] == pytest.approx(
            b["lr"], rel=1e-12
        )


@pytest.mark.slow
def test_fake_mode_dry_run_and_too_many_processes(tmp_path):
    proc = run_train(
        "--config", CONFIG, *SMALL, "--job.dump_folder", str(tmp_path), env={"COMM_MODE": "fake", "NGPU": "4"}
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 4 on cpu (fake process group): dp 4" in proc.stderr
    assert [r["step"] for r in records(tmp_path)] == [1]
    proc = run_train(
        "--config",
        CONFIG,
        "--parallelism.data_parallel_shard_degree",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        env={"COMM_MODE": "fake", "NGPU": "2"},
    )
    assert proc.returncode == 2
    assert "parallel degrees multiply to 1" in proc.stderr and "the world has 2 processes" in proc.stderr
    assert "Traceback" not in proc.stderr


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
    assert err.startswith("error: data.overlong: got 'cut', expected one of truncate, drop")
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
    )
    assert proc.returncode == 0 and "seed = -3" in proc.stdout
