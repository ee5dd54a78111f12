"""Bad input never ends in a traceback: every case below exits with code 2 and one `error:` line that
names the file (and line / record), the field, the value and what is allowed; the input files are
byte-identical afterwards. Most cases run `titan_thd.train.main(argv)` in this process (the code path
of every rank, and of the preflight that run_train.sh runs before torchrun when NGPU > 1); a few run
./run_train.sh for real (its config preflight, NGPU=2 and NGPU=4 runs stopped by the preflight before
any rank starts, one process, and the debug switch TITAN_THD_DEBUG=1 that shows the traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.bad_input_cases import (
    BASE,
    CASES,
    GOOD,
    Case,
    chat,
    checkpoint,
    file_hashes,
    jsonl,
    with_tmp,
    write_files,
)
from tests.e2e.test_train_cli import FAULTS
from tests.e2e.test_train_cli import run_train as e2e_run_train
from titan_thd.train import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def case_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("case")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The in-process cases that build a model do it on one thread (2 shared cores: no oversubscription)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def error_line(err: str) -> str:
    """The `error:` line, which ends stderr (only indented detail lines may follow it)."""
    lines = err.rstrip("\n").splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("error: ")), None)
    assert first is not None, err[-2000:]
    assert all(line.startswith("  ") for line in lines[first + 1 :]), err[-2000:]
    return lines[first]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_one_clear_line(case: Case, case_dir: Path, capsys, monkeypatch):
    write_files(case_dir, case.files)
    before = file_hashes(case_dir)
    monkeypatch.delenv("TITAN_THD_DEBUG", raising=False)
    for k, v in case.env.items():
        monkeypatch.setenv(k, v)
    argv = [with_tmp(a, case_dir) for a in BASE + case.args]  # the case's args override BASE
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out + err)[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    line = error_line(err)
    for want in case.expect:
        assert with_tmp(want, case_dir) in line, line
    assert {k: v for k, v in file_hashes(case_dir).items() if k in before} == before  # inputs untouched


def test_preflight_passes_good_inputs_and_fills_the_data_cache(case_dir, monkeypatch, caplog):
    """The counterpart of the preflight cases: good data, a resumable checkpoint of this model, NGPU=2."""
    write_files(case_dir, {"a.jsonl": jsonl(*[GOOD] * 4), "run": checkpoint})
    monkeypatch.setenv("NGPU", "2")
    args = ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl", "--checkpoint.enable", "true"]
    args += ["--job.dump_folder", "{tmp}/run", "--job.preflight", "true"]
    with caplog.at_level("INFO", logger="titan_thd"):
        assert main([with_tmp(a, case_dir) for a in BASE + args]) == 0
    assert "preflight: inputs of a 2-process run are fine" in caplog.text
    (cache,) = (case_dir / "run" / "data_cache").iterdir()  # what rank 0 of the run then reuses
    assert json.loads((cache / "meta.json").read_text())["num_samples"] == 4
    assert sorted(p.name for p in (case_dir / "run").iterdir()) == ["checkpoint", "data_cache"]


def test_the_table_is_large_enough():
    assert len(CASES) >= 40 and len({c.name for c in CASES}) == len(CASES)


def test_debug_switch_shows_the_traceback(case_dir, monkeypatch):
    """TITAN_THD_DEBUG=1: the same user error propagates (Python prints its traceback)."""
    monkeypatch.setenv("TITAN_THD_DEBUG", "1")
    with pytest.raises(ValueError, match="training.steps: got -5"):
        main([with_tmp(a, case_dir) for a in BASE] + ["--training.steps", "-5"])


def test_a_bug_keeps_its_traceback(case_dir, monkeypatch):
    """Only user errors become one line: anything else (a bug) propagates with its traceback."""
    from titan_thd.models import resolve  # start-up's resolution of [model], with the tokenizer

    def broken(*args, **kwargs):
        raise KeyError("a bug")

    monkeypatch.setattr(resolve, "build_tokenizer", broken)
    with pytest.raises(KeyError, match="a bug"):
        main([with_tmp(a, case_dir) for a in BASE])


# ============================================================================ through ./run_train.sh
def run_train(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    # The e2e helper, with the debug switch off unless a case turns it on ("" means off).
    return e2e_run_train(*args, env={"TITAN_THD_DEBUG": "", **env}, timeout=300)


LAUNCHER_CASES = [
    # the config preflight (no torch import)
    Case("toml syntax", [], ["{tmp}/c.toml", "invalid TOML", "line 2"], {"c.toml": "[training]\nsteps = = 3\n"}),
    # NGPU=2: the train preflight reads the data before torchrun starts any rank
    Case("NGPU=2, broken data line", ["--data.source", "jsonl", "--data.path", "{tmp}/a.jsonl"],
         ["{tmp}/a.jsonl:2", "invalid JSON"], {"a.jsonl": jsonl(GOOD, "{oops")}, env={"NGPU": "2"}),
    Case("NGPU=4, cp 3", ["--parallelism.context_parallel_degree", "3", "--training.tokens_per_microbatch", "264",
                          "--data.pad_to_multiple", "6"],
         ["context_parallel_degree 3", "does not fit 4 processes"], env={"NGPU": "4"}),
    # one process: the trainer itself
    Case("dump_folder is a file", ["--job.dump_folder", "{tmp}/out.txt"],
         ["job.dump_folder", "{tmp}/out.txt", "not a folder"], {"out.txt": "x"}),
]  # fmt: skip


@pytest.mark.parametrize("case", LAUNCHER_CASES, ids=[c.name for c in LAUNCHER_CASES])
def test_run_train_prints_one_line(case: Case, case_dir: Path):
    write_files(case_dir, {"c.toml": "", **case.files})
    before = file_hashes(case_dir)
    args = ["--config", str(case_dir / "c.toml")] + [with_tmp(a, case_dir) for a in BASE + case.args]
    proc = run_train(args, case.env)
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    both = proc.stdout + proc.stderr
    assert "Traceback" not in both and "ChildFailedError" not in both, both[-3000:]
    assert "[rank" not in both  # no rank was started
    line = error_line(proc.stderr)
    assert proc.stderr.rstrip("\n").splitlines()[-1] == line
    for want in case.expect:
        assert with_tmp(want, case_dir) in line, line
    assert {k: v for k, v in file_hashes(case_dir).items() if k in before} == before


def test_run_train_debug_switch(case_dir: Path):
    (case_dir / "c.toml").write_text("")
    (case_dir / "a.jsonl").write_text(jsonl(GOOD, chat(("user", "q"), ("narrator", "a"))))
    args = ["--config", str(case_dir / "c.toml"), *[with_tmp(a, case_dir) for a in BASE]]
    proc = run_train([*args, "--data.source", "jsonl", "--data.path", str(case_dir / "a.jsonl")],
                     {"TITAN_THD_DEBUG": "1"})  # fmt: skip
    assert proc.returncode == 1
    assert "Traceback (most recent call last)" in proc.stderr
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith(f"ValueError: {case_dir}/a.jsonl:2: messages[1].role: unknown role 'narrator'")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, code, line",
    [
        ("raise:ValueError:2:1", 2, "error: test fault: ValueError on rank 1 at step 2"),
        pytest.param(  # the same path with exit code 1 (exits.py's unit tests cover the codes)
            "raise:CheckpointError:2:0",
            1,
            "error: test fault: CheckpointError on rank 0 at step 2",
            marks=pytest.mark.extended,
        ),
    ],
    ids=["user error on rank 1", "run failure on rank 0"],
)
def test_a_rank_that_fails_mid_run_is_one_line(case_dir: Path, fault: str, code: int, line: str):
    """NGPU=2, an error that only one rank meets, after start-up (a test fault at step 2): the console
    shows that rank's one line, last, and its exit code; no traceback, neither of that rank nor of
    the other one (which loses its peer in a collective), and no torchrun failure report."""
    args = ["--config", str(ROOT / "train_configs" / "debug_dense_thd.toml")] + [
        with_tmp(a, case_dir) for a in BASE
    ]
    env = {"NGPU": "2", "PYTHONPATH": str(FAULTS), "TITAN_THD_TEST_FAULT": fault}
    proc = run_train([*args, "--training.steps", "3"], env)
    both = proc.stdout + proc.stderr
    assert proc.returncode == code, both[-3000:]
    assert "Traceback" not in both and "FAILED" not in both and "exitcode" not in both, both[-3000:]
    assert proc.stderr.rstrip("\n").splitlines()[-1] == line, both[-3000:]
    assert both.count("error: ") == 1, both[-3000:]


@pytest.mark.slow
def test_a_rank_that_crashes_mid_run_keeps_its_traceback(case_dir: Path):
    """A bug on rank 1 (not the rank shown): torchrun's report with rank 1's traceback; rank 0, which
    lost its peer, adds one line instead of its own traceback of the lost connection."""
    args = ["--config", str(ROOT / "train_configs" / "debug_dense_thd.toml")] + [
        with_tmp(a, case_dir) for a in BASE
    ]
    env = {"NGPU": "2", "PYTHONPATH": str(FAULTS), "TITAN_THD_TEST_FAULT": "raise:KeyError:2:1"}
    proc = run_train([*args, "--training.steps", "3"], env)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    err = proc.stderr
    assert "Traceback (most recent call last)" in err and "in failing_next" in err, err[-3000:]
    assert "KeyError: 'test fault: KeyError on rank 1 at step 2'" in err
    assert "traceback : rank 1 crashed: KeyError" in err  # rank 0's entry of the report
    assert err.count("Traceback (most recent call last)") == 1, err[-5000:]


# ============================================================================ devices (#47)
def load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_gpus(monkeypatch, count: int) -> None:
    """This process sees `count` CUDA devices (nothing calls into CUDA before the check refuses)."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")


SCRIPT_ARGS = {
    "generate.py": ["--config", "debug_dense_thd.toml", "--untrained", "--prompt", "hi"],
    "evaluate.py": ["--config", "debug_dense_thd.toml", "--untrained", "--limit", "1"],
}
DEVICE_CASES = [  # (script, --device, CUDA devices faked (None: this machine as it is), the line's substrings)
    ("generate.py", "cuda", None, ["--device cuda", "no CUDA", "use --device cpu"]),
    ("evaluate.py", "cuda", None, ["--device cuda", "no CUDA", "use --device cpu"]),
    ("generate.py", "cuda:1", None, ["--device cuda:1", "no CUDA", "use --device cpu"]),
    (
        "generate.py",
        "cuda:2",
        2,
        ["--device cuda:2", "only 2 CUDA devices (Fake GPU)", "use cuda:0 to cuda:1"],
    ),
    (
        "evaluate.py",
        "cuda:5",
        1,
        ["--device cuda:5", "only 1 CUDA device (Fake GPU)", "use cuda:0 to cuda:0"],
    ),
    ("generate.py", "tpu", None, ["--device 'tpu'", "expected auto, cpu, cuda or cuda:N"]),
    ("evaluate.py", "gpu0", None, ["--device 'gpu0'", "expected auto, cpu, cuda or cuda:N"]),
]


@pytest.mark.parametrize(
    "script, device, gpus, expect", DEVICE_CASES, ids=[f"{c[0]} {c[1]}" for c in DEVICE_CASES]
)
def test_a_device_that_is_not_there_is_one_line(script, device, gpus, expect, capsys, monkeypatch):
    """--device of the scripts that take one: refused before the model is built, in one line naming the
    flag, the value, what this machine has and the fix."""
    import torch

    if gpus is None and device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    if gpus is not None:
        fake_gpus(monkeypatch, gpus)
    code = load_script(script).main([*SCRIPT_ARGS[script], "--device", device])
    out, err = capsys.readouterr()
    assert code == 2, (out + err)[-2000:]
    assert "Traceback" not in out + err
    line = error_line(err)
    assert err.strip() == line  # nothing loaded, nothing else said
    for want in expect:
        assert want in line, line


def test_more_processes_per_node_than_gpus_is_one_line(case_dir, capsys, monkeypatch):
    """NGPU=4 on a node with 2 GPUs: every rank (torchrun's LOCAL_WORLD_SIZE=4) refuses at start-up, before
    any process group, naming NGPU, the GPUs and the fix (the launcher shows one rank's line)."""
    fake_gpus(monkeypatch, 2)
    monkeypatch.delenv("TITAN_THD_DEBUG", raising=False)
    for k, v in {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "3", "RANK": "3", "WORLD_SIZE": "4"}.items():
        monkeypatch.setenv(k, v)
    code = main([with_tmp(a, case_dir) for a in BASE])
    out, err = capsys.readouterr()
    assert code == 2, (out + err)[-2000:]
    line = error_line(err)
    for want in ("NGPU=4 processes per node", "only 2 CUDA devices (Fake GPU)", "set NGPU=2 or fewer"):
        assert want in line, line


def test_the_device_line_says_why_cuda_is_missing(monkeypatch):
    """A CUDA build that sees no device (CUDA_VISIBLE_DEVICES hides them) says so, not 'CPU-only'."""
    import torch

    from titan_thd.parallel.distributed import parse_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    want = r"^--device cuda: torch .* \(CUDA 13.0\) sees no CUDA device, CUDA_VISIBLE_DEVICES=''; use --device cpu"
    with pytest.raises(ValueError, match=want):
        parse_device("cuda")
    assert parse_device("auto") == torch.device("cpu") and parse_device("cpu") == torch.device("cpu")


def test_a_python_without_torchdata_is_one_line():
    """An air-gapped node's preinstalled torch may come without torchdata: the trainer says what to
    install (and how without a network) in one line instead of an import traceback."""
    block = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torchdata':\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import runpy; runpy.run_module('titan_thd.train', run_name='__main__')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", block, "--help"], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.startswith("error: titan_thd needs torchdata") and proc.stderr.count("\n") == 1, (
        proc.stderr
    )
