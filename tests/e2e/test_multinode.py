"""Several nodes through ./run_train.sh: two launchers on 127.0.0.1, two one-process "nodes" of one
c10d rendezvous, train bit for bit like one node of two processes; SIGTERM to every process of
both (how SLURM signals a job step, torchrun included) saves and exits 0; the launch environment's
user errors; COMM_MODE=fake over all nodes; the SLURM example's derivation of that environment."""

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from tests.e2e.test_train_cli import CONFIG, SMALL, records, run_train

ROOT = Path(__file__).resolve().parents[2]
LAUNCH_VARS = ("NGPU", "NNODES", "NODE_RANK", "RDZV_ENDPOINT", "RDZV_ID", "MASTER_ADDR", "MASTER_PORT")
# Steps of 4 samples, 2 per rank (a quarter of a second of compute each): the runs are all start-up
# otherwise. The schedule does not depend on training.steps, so runs of different lengths share
# their steps.
COMMON = [
    "--config",
    CONFIG,
    *SMALL,
    "--training.global_batch_size",
    "4",
    "--training.tokens_per_microbatch",
    "512",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
    "--metrics.peak_tflops",
    "1",  # no peak measurement: it is rank 0's alone and only feeds the MFU
    "--lr_scheduler.total_steps",
    "20",
]
SAME = ("loss", "grad_norm", "lr", "tokens_real", "tokens_trained", "padding_frac", "num_microbatches")
TIMEOUT = 180


def clean_env(**launch) -> dict:
    """The test's environment without launch settings it may have inherited, plus `launch`."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    return {**env, "OMP_NUM_THREADS": "1", **launch}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants (torchrun starts its ranks in sessions of their own)."""
    ps = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True)
    children: dict[int, list[int]] = {}
    for pid, ppid in zip(*[iter(map(int, ps.stdout.split()))] * 2):
        children.setdefault(ppid, []).append(pid)
    tree, todo = [], [root]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def signal_tree(root: int, sig: int) -> None:
    for pid in process_tree(root):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


@pytest.fixture
def launchers():
    """Starts run_train.sh "nodes"; whatever still runs at the end is killed, ranks included."""
    procs: list[subprocess.Popen] = []

    def start(node_rank: int, args: list[str], log: Path, **launch) -> subprocess.Popen:
        env = clean_env(NNODES="2", NODE_RANK=str(node_rank), NGPU="1", **launch)
        with log.open("w") as out:
            proc = subprocess.Popen(
                ["./run_train.sh", *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            signal_tree(proc.pid, signal.SIGSTOP)  # twice: a rank started meanwhile is caught too
            signal_tree(proc.pid, signal.SIGSTOP)
            signal_tree(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def wait_all(procs: list[subprocess.Popen], logs: list[Path]) -> str:
    """Both launchers' output, once both exited 0."""
    for proc in procs:
        proc.wait(timeout=TIMEOUT)
    out = "".join(f"--- {log.name}\n{log.read_text()}" for log in logs)
    assert [p.returncode for p in procs] == [0, 0], out[-6000:]
    return out


@pytest.fixture(scope="module")
def common(tmp_path_factory) -> list[str]:
    """COMMON with one tokenised-data cache for all runs (the first one writes it)."""
    return [*COMMON, "--data.cache_dir", str(tmp_path_factory.mktemp("data_cache"))]


@pytest.fixture(scope="module")
def one_node(common, tmp_path_factory):
    """The reference: one node, NGPU=2 (one torchrun, its own rendezvous on localhost)."""
    dump = tmp_path_factory.mktemp("one_node")
    proc = run_train(
        *common,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(dump),
        env=clean_env(NGPU="2"),
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = records(dump)
    assert [r["step"] for r in recs] == [1, 2, 3]
    return recs


@pytest.mark.slow
def test_two_launchers_train_like_one_node_of_two(one_node, common, launchers, tmp_path):
    """NNODES=2 x NGPU=1 is the world of NNODES=1 x NGPU=2: the same 2 ranks on the same shards, the
    same gloo all-reduce of 2 terms, so every logged value is equal bit for bit. Both nodes share
    one dump folder, as on a cluster's shared filesystem."""
    args = [*common, "--training.steps", "3", "--job.dump_folder", str(tmp_path / "dump")]
    endpoint = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    # Node 1 first: it waits for node 0's store rather than failing.
    node1 = launchers(1, args, logs[1], RDZV_ENDPOINT=endpoint)
    node0 = launchers(0, args, logs[0], RDZV_ENDPOINT=endpoint)
    out = wait_all([node0, node1], logs)
    assert "world 2 on cpu: dp 2, cp 1" in out
    # LOG_RANK=0 shows local rank 0 of each node: global rank 0 on one of them (the header is its
    # alone), rank 1 on the other. Rank 0 prints both ranks' peak memory, gathered across the nodes.
    texts = [log.read_text() for log in logs]
    assert sorted("model llama/debug" in t for t in texts) == [False, True], out[-6000:]
    peaks = [re.findall(r"peak memory \(max RSS\) per rank: ([0-9.]+), ([0-9.]+) GiB", t) for t in texts]
    assert sorted(len(p) for p in peaks) == [0, 1], out[-6000:]
    assert all(float(gib) > 0 for p in peaks for gib in (p[0] if p else ())), peaks
    got = records(tmp_path / "dump")
    assert [r["step"] for r in got] == [1, 2, 3]
    for a, b in zip(one_node, got):
        assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}


@pytest.mark.slow
def test_sigterm_to_every_process_of_both_nodes_saves_and_exits_zero(one_node, common, launchers, tmp_path):
    """SLURM's --signal / scancel --signal=TERM reach every process of a step: run_train.sh, torchrun
    and the ranks of each node. The ranks agree on a step, save it and exit 0; torchrun neither
    fails nor kills them. Node 1 finds node 0 through MASTER_ADDR/MASTER_PORT."""
    dump = tmp_path / "dump"
    args = [*common, "--training.steps", "20", "--checkpoint.enable", "true", "--job.dump_folder", str(dump)]
    port = free_port()
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    node0 = launchers(0, args, logs[0], RDZV_ENDPOINT=f"127.0.0.1:{port}")
    node1 = launchers(1, args, logs[1], MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    deadline = time.monotonic() + TIMEOUT
    while not any(re.search(r"step +1 +loss", log.read_text()) for log in logs):
        assert node0.poll() is None and node1.poll() is None, "a node exited before step 1"
        assert time.monotonic() < deadline, "no step 1 in time"
        time.sleep(0.2)
    trees = process_tree(node0.pid) + process_tree(node1.pid)
    assert len(trees) >= 6  # per node: run_train.sh, torchrun, one rank
    for pid in trees:  # at once, as SLURM does
        os.kill(pid, signal.SIGTERM)
    out = wait_all([node0, node1], logs)
    assert "Traceback" not in out and "SignalException" not in out, out[-6000:]
    stopped = int(re.search(r"stopped by SIGTERM after step (\d+)", out).group(1))
    assert 1 <= stopped < 20
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == [f"step-{stopped}"]
    got = records(dump)
    assert [r["step"] for r in got] == list(range(1, stopped + 1))
    for a, b in zip(one_node, got):
        assert {k: b[k] for k in SAME} == {k: a[k] for k in SAME}


def test_sigterm_while_waiting_for_the_other_nodes_stops_the_launch(launchers, tmp_path):
    """Node 0 alone waits in the rendezvous (up to 10 minutes) for node 1. With no rank to save
    anything, a SIGTERM to run_train.sh stops torchrun, which itself drops SIGTERM."""
    port = free_port()
    args = ["--config", CONFIG, "--job.dump_folder", str(tmp_path)]
    node0 = launchers(0, args, tmp_path / "node0.log", RDZV_ENDPOINT=f"127.0.0.1:{port}")
    deadline = time.monotonic() + TIMEOUT
    while True:  # until node 0's torchrun hosts the rendezvous store
        assert node0.poll() is None, (tmp_path / "node0.log").read_text()
        assert time.monotonic() < deadline, "no rendezvous store in time"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        time.sleep(0.2)
    tree = process_tree(node0.pid)
    assert len(tree) == 2  # run_train.sh and torchrun, no rank yet
    node0.send_signal(signal.SIGTERM)
    assert node0.wait(timeout=60) == 130, (tmp_path / "node0.log").read_text()
    assert "Traceback" not in (tmp_path / "node0.log").read_text()
    with pytest.raises(ProcessLookupError):
        os.kill(tree[1], 0)


@pytest.mark.parametrize(
    "launch, message",
    [
        ({"NNODES": "2"}, "error: NNODES=2 needs RDZV_ENDPOINT=host:port"),
        ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:29500"}, "error: NODE_RANK=2 with NNODES=2"),
        ({"NNODES": "two"}, "error: NNODES='two': expected a positive integer"),
        ({"NGPU": "0"}, "error: NGPU='0': expected a positive integer"),
        ({"NNODES": "2", "RDZV_ENDPOINT": "h:0"}, "error: RDZV_ENDPOINT='h:0': NNODES=2 needs a fixed port"),
    ],
)
def test_launch_environment_errors_are_one_line(launch, message):
    proc = run_train("--config", CONFIG, env=clean_env(**launch), timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.startswith(message) and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stdout == ""


def test_fake_mode_simulates_every_node(tmp_path):
    """COMM_MODE=fake plays the whole NNODES x NGPU world, no rendezvous needed: a layout for 4
    ranks does not fit 3 x 2 (the trainer says so before building anything)."""
    env = clean_env(COMM_MODE="fake", NNODES="3", NGPU="2", NODE_RANK="1")
    proc = run_train(
        "--config",
        CONFIG,
        "--parallelism.data_parallel_shard_degree",
        "4",
        "--job.dump_folder",
        str(tmp_path),
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "parallel degrees multiply to 4" in proc.stderr and "the world has 6 processes" in proc.stderr


FAKE_SLURM = {
    # Prints the nodes of a nodelist, as `scontrol show hostnames` does.
    "bin/scontrol": '[[ "$1 $2" == "show hostnames" ]] && printf "gpu-a17\\ngpu-b03\\n"',
    # One task per node, each with its SLURM_NODEID (sequential here: the tasks only record).
    "bin/srun": (
        'while [[ "$1" == --* ]]; do echo "$1" >> "$SLURM_SUBMIT_DIR/srun_options"; shift; done\n'
        'for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do SLURM_NODEID=$i "$@" || exit; done'
    ),
    # Stand-ins in the "checkout": the launcher records what each node would start.
    "run_train.sh": (
        'echo "$NODE_RANK $NNODES $NGPU $RDZV_ENDPOINT $RDZV_ID $PWD" >> launches\n'
        'printf "%s|" "$@" >> launches; echo >> launches'
    ),
    "scripts/setup_env.sh": "echo setup >> launches",
}


def test_slurm_example_gives_each_node_its_launch_environment(tmp_path):
    """scripts/slurm_train.sbatch under a stand-in scontrol/srun: it installs once, then starts one
    run_train.sh per node with NODE_RANK from SLURM_NODEID, the job's node count, GPUs per node,
    the first node as rendezvous and the arguments unchanged."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "scripts").mkdir()
    for name, body in FAKE_SLURM.items():
        path = tmp_path / name
        path.write_text(f"#!/usr/bin/env bash\n{body}\n")
        path.chmod(0o755)
    env = clean_env(
        PATH=f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_JOB_NODELIST="gpu-[a17,b03]",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_ID="4242",
        SLURM_GPUS_ON_NODE="8",
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "slurm_train.sbatch"), "--config", "a b.toml", "--x.y", ""],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    args = "--config|a b.toml|--x.y||"
    assert (tmp_path / "launches").read_text().splitlines() == [
        "setup",
        f"0 2 8 gpu-a17:29742 4242 {tmp_path}",
        args,
        f"1 2 8 gpu-a17:29742 4242 {tmp_path}",
        args,
    ]
    assert "--ntasks-per-node=1" in (tmp_path / "srun_options").read_text().split()
