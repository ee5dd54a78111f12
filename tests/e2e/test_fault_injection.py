"""Crash safety through real runs: dev/fault_injection.py with reduced counts, dense recipe.

An uninterrupted reference run, then one chain in one folder (SIGKILL at a random moment, resume,
SIGKILL during a save, resume to the end: every resumed record bitwise equal to the reference,
metrics.jsonl and TensorBoard one value per step), then a NaN loss that stops the run before its
optimizer step, keeping the checkpoints before it. The dsv4 recipe runs the same code paths (the
trainer, checkpointer and metrics do not depend on the model) at ~4x the cost, so CI leaves it to
the script: its full counts, every fault on both recipes, recoveries and DP=2, are reported by
`dev/fault_injection.py --json` (see its docstring). Damaged checkpoints and full disks on one
of two ranks are tested in tests/components. Plus: a rank dies with its torchrun.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("fault_injection", ROOT / "dev" / "fault_injection.py")
FI = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = FI  # its dataclasses look their module up there
_spec.loader.exec_module(FI)
FH = importlib.import_module("fault_harness")  # dev/fault_harness.py: runs, processes (on sys.path via FI)

CASES = {  # the damage kinds, full disks and the dsv4 recipe: component tests and the script
    "dense": ["--cases", "mixed,nan"],
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", list(CASES))
def test_faults_of_a_recipe(recipe, tmp_path):
    out = tmp_path / "counts.json"
    args = ["--recipes", recipe, "--ngpu", "1", "--steps", "6", "--no-recover", "--seed", "1", *CASES[recipe]]
    rc = FI.main([*args, "--workdir", str(tmp_path / "work"), "--json", str(out)])
    report = json.loads(out.read_text())
    bad = [t for t in report["trials"] if not t["ok"]]
    assert rc == 0 and not bad, json.dumps(bad, indent=1)[-4000:]
    counts = {row["case"]: row["trials"] for row in report["rows"]}
    assert counts["SIGKILL at a random moment"] == 1 and counts["SIGKILL during a save"] == 1
    assert counts["chain end"] >= 1
    assert counts.get("NaN/Inf loss or gradient", 0) == (recipe == "dense")
    assert counts.get("full disk during a save", 0) == (recipe == "dsv4")
    saved = [t for t in report["trials"] if t["case"] == "SIGKILL during a save"]
    assert saved[0]["in_save"], saved  # the kill landed while a step-N.tmp folder existed


def test_a_rank_dies_with_its_launcher():
    """What torchrun does: a child in a session of its own. SIGKILL the parent: the child follows."""
    child = (
        "import os, time; from titan_thd.parallel.distributed import die_with_launcher; "
        "die_with_launcher(); print(os.getpid(), flush=True); time.sleep(120)"
    )
    parent = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True); time.sleep(120)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", parent],
        cwd=ROOT,
        env={**os.environ, "TORCHELASTIC_RUN_ID": "test"},
        stdout=subprocess.PIPE,
        text=True,
    )
    pid = int(proc.stdout.readline())
    assert FH.running(pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 10
    while FH.running(pid) and time.monotonic() < deadline:
        time.sleep(0.01)
    alive = FH.running(pid)
    if alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive
