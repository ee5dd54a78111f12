"""A checkpoint in the release's format trains on several ranks as on one: `model.hf_path` naming a
multi-file FP8 / FP4 folder (tests/models/dsv4/_release.py), loaded shard by shard on 4 ranks (expert
parallel 2 x FSDP 2: each rank reads only its slices and its experts), gives the step-1 loss and
gradient norm of the one-process run that reads every tensor whole. float64 master weights (the
dequantised float32 values cast exactly), so the two differ only by the order of the sums over ranks:
1e-12 relative."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from tests.models.dsv4._release import write_release
from titan_thd.config import load_config
from titan_thd.models.dsv4.model import build_dsv4
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

from .test_hf_any_architecture import ARGS as _ARGS

ARGS = dataclasses.replace(
    _ARGS, moe_inter_dim=64
)  # FP4 packs rows of 32: every expert input width a multiple

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def _argv(dump, hf_path, *extra):
    return [
        *TRAIN_ARGS,
        *("--model.name", "dsv4", "--model.hf_path", str(hf_path), "--training.dtype", "float64"),
        *(
            "--training.steps",
            "1",
            "--training.global_batch_size",
            "4",
            "--training.tokens_per_microbatch",
            "256",
        ),
        *("--metrics.peak_tflops", "1", "--job.dump_folder", str(dump), *extra),
    ]


def _first_step(dump) -> dict:
    return json.loads((dump / "metrics.jsonl").read_text().splitlines()[0])


def _train(argv: list[str]) -> None:
    trainer = Trainer(resolve_run(load_config(argv)))
    try:
        trainer.train()
    finally:
        trainer.close()


def _rank(rank: int, world: int, argv: list[str]) -> None:
    os.environ |= {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    _train(argv)


def test_a_release_folder_loads_as_shards_with_the_one_process_step(tmp_path):
    torch.manual_seed(3)
    path = write_release(build_dsv4(ARGS), ARGS, tmp_path / "release")
    assert len(list(path.glob("*.safetensors"))) > 2  # several files, read through the index
    _train(_argv(tmp_path / "one", path))
    spawn(_rank, 4, _argv(tmp_path / "four", path, "--parallelism.expert_parallel_degree", "2"))
    one, four = _first_step(tmp_path / "one"), _first_step(tmp_path / "four")
    for key in ("loss", "grad_norm"):
        assert four[key] == pytest.approx(one[key], rel=1e-12, abs=0), key
