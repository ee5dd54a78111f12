"""How a run ends, in this process: a stop signal after a step (the line that names the checkpoint and
the command that resumes), Ctrl-C during start-up, the failure report that the other ranks and the
launcher read (a real rendezvous-style TCPStore), and the launcher's choice of the line to print.
The real signals to real runs through ./run_train.sh are in tests/e2e/test_train_cli.py."""

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tests.conftest import TRAIN_ARGS
from titan_thd import exits, launcher
from titan_thd import train as train_module
from titan_thd.components.signals import StopSignal
from titan_thd.config import load_config
from titan_thd.train import Trainer, main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_stop_signal_records_the_first_signal_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    stop = StopSignal(announce=False)
    stop.install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.received == signal.SIGTERM
        os.kill(os.getpid(), signal.SIGTERM)  # a repeated SIGTERM changes nothing
        os.kill(os.getpid(), signal.SIGINT)  # nor does Ctrl-C after SIGTERM (only a second Ctrl-C aborts)
        assert stop.received == signal.SIGTERM
    finally:
        stop.restore()
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


@pytest.mark.parametrize("checkpoint", ["false", "true"])
def test_ctrl_c_in_a_step_stops_after_it(tmp_path, tiny_llama, one_thread, monkeypatch, caplog, checkpoint):
    """A SIGINT that arrives during step 2 of 6: the step finishes, main() returns 0, the last line
    says where the checkpoint is and how to resume, or how to turn checkpoints on."""
    train_step = Trainer.train_step

    def interrupted_step(self, step_batch):
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, step_batch)

    monkeypatch.setattr(Trainer, "train_step", interrupted_step)
    config = str(ROOT / "train_configs" / "debug_dense_thd.toml")
    argv = ["--job.config_file", config, *TRAIN_ARGS, "--model.flavor", tiny_llama, "--training.steps", "6"]
    argv += [
        "--metrics.peak_tflops",
        "1",
        "--checkpoint.enable",
        checkpoint,
        "--job.dump_folder",
        str(tmp_path),
    ]
    with caplog.at_level("INFO", logger="titan_thd"):
        assert main(argv) == 0
    assert [json.loads(r)["step"] for r in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    last = caplog.records[-1].getMessage()
    if checkpoint == "false":
        assert last == (
            "stopped by SIGINT after step 2, without a checkpoint (checkpoint.enable = false): run with "
            "--checkpoint.enable true to save one when stopped and to resume from it"
        )
        return
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-2"]
    assert last == (
        f"stopped by SIGINT after step 2: checkpoint {tmp_path / 'checkpoint' / 'step-2'}; resume with: "
        f"./run_train.sh --config debug_dense_thd.toml {' '.join(argv[2:])}"
    )


def test_ctrl_c_during_start_up_is_one_line(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_module, "resolve_run", interrupted)
    assert main([*TRAIN_ARGS, "--job.dump_folder", str(tmp_path)]) == exits.INTERRUPTED
    err = capsys.readouterr().err
    assert err == "stopped by Ctrl-C before the first step: nothing to save\n"


def test_resume_command_names_the_recipe_the_processes_and_the_newest_checkpoint(monkeypatch):
    config = str(ROOT / "train_configs" / "debug_dense_thd.toml")
    argv = ["--job.config_file", config, "--checkpoint.load_step", "3", "--data.path", "my data.jsonl"]
    cfg = load_config([*argv, "--checkpoint.enable", "true"])
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert exits.resume_command(argv, cfg) == (
        "NGPU=4 NNODES=2 ./run_train.sh --config debug_dense_thd.toml --checkpoint.load_step 3 "
        "--data.path 'my data.jsonl' --checkpoint.load_step -1 (on every node)"
    )


@pytest.fixture
def rendezvous(tmp_path, monkeypatch):
    """The torchrun environment of rank `rank` (a function) around one real TCPStore."""
    store = dist.TCPStore(
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10)
    )
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "WORLD_SIZE": "2"}
    common |= {"TORCHELASTIC_RUN_ID": "test", "TORCHELASTIC_RESTART_COUNT": "0", exits.LAUNCHER_ENV: "1"}
    for k, v in common.items():
        monkeypatch.setenv(k, v)

    def rank(r: int) -> Path:
        monkeypatch.setenv("RANK", str(r))
        monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / f"error_{r}.json"))
        return tmp_path / f"error_{r}.json"

    yield rank
    del store


def failures(*files: Path) -> dict[int, ProcessFailure]:
    return {
        r: ProcessFailure(local_rank=r, pid=1, exitcode=1, error_file=str(f)) for r, f in enumerate(files)
    }


def test_a_rank_error_reaches_the_other_ranks_and_the_launcher(rendezvous, capsys):
    """Rank 1 fails with a user error; rank 0 then loses its peer (a RuntimeError of gloo) and
    ends with rank 1's code; the launcher prints rank 1's line, which only the launcher prints."""
    file1 = rendezvous(1)
    assert exits.failure_code(ValueError("data.path = 'x': bad")) == 2
    file0 = rendezvous(0)
    assert exits.failure_code(RuntimeError("Connection closed by peer")) == 2
    assert capsys.readouterr().err == ""
    assert json.loads(file0.read_text())[exits.ERROR_FILE_KEY] == {
        "code": 2,
        "rank": 0,
        "cause": 1,
        "crash": False,
    }
    assert launcher.reported_failure(failures(file0, file1)) == ("error: data.path = 'x': bad", 2)
    assert launcher.reported_failure(failures(file0)) == ("error: data.path = 'x': bad", 2)  # another node


def test_a_crash_is_left_to_torchrun_s_report(rendezvous):
    file1 = rendezvous(1)
    try:
        raise KeyError("a bug")
    except KeyError as e:
        assert exits.failure_code(e) is None
        exits.record_crash()
    assert "KeyError: 'a bug'" in json.loads(file1.read_text())["message"]  # the traceback
    file0 = rendezvous(0)
    assert exits.failure_code(RuntimeError("Connection closed by peer")) == 1
    assert json.loads(file0.read_text())["message"] == "rank 1 crashed: KeyError: 'a bug'"
    assert launcher.reported_failure(failures(file0, file1)) is None
    assert launcher.reported_failure(failures(file0)) is None


def test_rank_0_s_line_wins_over_another_rank_s(rendezvous):
    file1 = rendezvous(1)
    exits.report("error: one", 2)
    file0 = rendezvous(0)
    exits.report("error: zero", 1)
    assert launcher.reported_failure(failures(file0, file1)) == ("error: zero", 1)


def test_without_torchrun_the_line_goes_to_stderr(monkeypatch, capsys):
    for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", exits.LAUNCHER_ENV):
        monkeypatch.delenv(k, raising=False)
    assert exits.failure_code(FloatingPointError("step 3: not finite")) == 1
    assert capsys.readouterr().err == "error: step 3: not finite\n"
    assert exits.failure_code(KeyError("a bug")) is None
    monkeypatch.setenv(exits.DEBUG_ENV, "1")
    assert exits.failure_code(ValueError("x")) is None and capsys.readouterr().err == ""
