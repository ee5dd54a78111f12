"""[evaluation] in the trainer: val/accuracy & co. in metrics.jsonl, and on two FSDP ranks (each answers half
of the problems with a copy gathered from the shards) the same replies and the same metrics as on one process.
The grading is wrapped to record every (expected answer, reply) pair of each rank."""

import json
import os
from pathlib import Path

import pytest

from tests import _tiny_llama
from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from titan_thd.config import load_config
from titan_thd.inference import evaluation
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
EVAL = "--evaluation.enable true --evaluation.limit 6 --evaluation.freq 1 --evaluation.max_new_tokens 24"
GRADE = evaluation.grade_reply


def run(dump: Path, rank: int = 0) -> tuple[dict, list[tuple[str, str]]]:
    """One training step with evaluation; (the step's metrics record, the graded (expected, reply) pairs)."""
    _tiny_llama.register()
    graded = []

    def recording(reply, expected):
        graded.append((str(expected), reply))
        return GRADE(reply, expected)

    evaluation.grade_reply = recording  # this process only (a spawned worker, or restored by the test)
    argv = [
        *TRAIN_ARGS,
        "--model.flavor",
        _tiny_llama.NAME,
        "--training.steps",
        "1",
        "--training.dtype",
        "float64",
    ]
    cfg = load_config([*argv, *EVAL.split(), "--job.dump_folder", str(dump), "--metrics.peak_tflops", "1"])
    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
    finally:
        trainer.close()
    record = json.loads((dump / "metrics.jsonl").read_text().splitlines()[-1]) if rank == 0 else {}
    return record, graded


def _dp2(rank: int, world_size: int, dump: Path):
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return run(dump, rank)


@pytest.mark.slow
def test_val_accuracy_is_logged_and_layout_free(tmp_path, monkeypatch, tiny_llama):
    monkeypatch.setattr(evaluation, "grade_reply", GRADE)  # restored after run() replaced it
    one, graded = run(tmp_path / "dp1")
    (two, graded_0), (_, graded_1) = spawn(_dp2, 2, tmp_path / "dp2", timeout=600)
    val = {k: v for k, v in one.items() if k.startswith("val/")}
    assert {"val/accuracy", "val/format_accuracy"} <= set(val) and any(
        k.startswith("val/accuracy/") for k in val
    )
    assert len(graded) == len(evaluation.problems(evaluation.heldout_conversations(limit=6)))
    assert 0 < len(graded_0) < len(graded)  # each rank answered a share
    assert sorted(graded_0 + graded_1) == sorted(graded)
    assert {k: v for k, v in two.items() if k.startswith("val/")} == val
