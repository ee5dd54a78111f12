"""Adversarial documents through the whole trainer on every parallelism: the shapes the data decides.

Two steps of mock documents chosen to make the shortest and oddest microbatches (step 1: three
documents of 1-3 tokens; step 2: a document of exactly T, one longer than T (truncated) and one of 2
tokens, which the planner spreads over more microbatches than there are documents, so a replica packs
an empty one) train on 4 gloo processes under CP 2 / 4 in each mode, TP 2, PP 2, EP 2 and combinations,
in float64. Every run must finish, and its losses, auxiliary losses and gradient norms equal those of
one process on the same documents (rel <= 1e-12: float64, where no routing choice can flip; the
trimmed rows differ between layouts, the loss may not). Under CP 4 the micro dsv4 needs 4 x its halo
of 16 rows per microbatch: a trimmed microbatch of 3 crumbs must still be 64 rows (the crash this test
was written for; and under zigzag CP 4 a rank holding only padding rows must still join the K/V
all-gather's backward). The layouts of one model run in one launch of 4 processes; the default suite
runs three per model (the two crashes and one combination), `extended` the rest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests import _tiny_llama
from tests._dist import spawn
from titan_thd.config import load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
T = 256
LENGTHS = [1, 2, 3, T, T + 40, 2]  # G = 3 documents per step, in order
REL = 1e-12
MODELS = {
    "llama": [
        "--model.name", "llama", "--model.flavor", _tiny_llama.NAME, "--data.pad_to_multiple", "8",
    ],
    "dsv4": [
        "--model.name", "dsv4", "--model.flavor", "micro",
    ],
}  # fmt: skip
LAYOUTS = {
    "llama": {
        "cp4 zigzag": ["--parallelism.context_parallel_degree", "4"],
        "cp4 hybrid": ["--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_mode", "hybrid"],
        "dp2 cp2 hybrid": ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_mode", "hybrid"],
        "dp2 tp2": ["--parallelism.tensor_parallel_degree", "2"],
        "dp2 pp2": ["--parallelism.pipeline_parallel_degree", "2"],
        "cp2 tp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        "pp2 cp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"],
    },
    "dsv4": {
        "cp4": ["--parallelism.context_parallel_degree", "4"],
        "dp2 tp2": ["--parallelism.tensor_parallel_degree", "2"],
        "dp2 pp2": ["--parallelism.pipeline_parallel_degree", "2"],
        "dp2 cp2 ep2": ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"],
        "cp2 tp2": ["--parallelism.context_parallel_degree", "2", "--parallelism.tensor_parallel_degree", "2"],
        "pp2 cp2": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.context_parallel_degree", "2"],
    },
}  # fmt: skip


def args(model: str, dump: Path, lengths: Path, *extra: str) -> list[str]:
    mock = {"mode": "file", "path": str(lengths)}
    return [
        *MODELS[model],
        "--data.source", "mock", "--data.mock_config", json.dumps(mock), "--data.shuffle", "false",
        "--training.global_batch_size", "3", "--training.tokens_per_microbatch", str(T),
        "--training.steps", "2", "--training.dtype", "float64", "--optimizer.name", "adamw",
        "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1",
        "--job.dump_folder", str(dump), *extra,
    ]  # fmt: skip


def train(argv: list[str]) -> list[dict]:
    trainer = Trainer(resolve_run(load_config(argv)))
    try:
        trainer.train()
    finally:
        trainer.close()
    path = Path(argv[argv.index("--job.dump_folder") + 1]) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


DEFAULT = {"llama": ("cp4 zigzag", "cp4 hybrid", "cp2 tp2"), "dsv4": ("cp4", "dp2 cp2 ep2", "pp2 cp2")}
"""Layouts of the default suite; `extended` runs the others."""


def _layouts(rank: int, world_size: int, model: str, names: list[str], base: Path, lengths: Path) -> dict:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return {name: train(args(model, base / name, lengths, *LAYOUTS[model][name])) for name in names}


CASES = [
    pytest.param(model, names, marks=marks, id=f"{model}-{kind}")
    for model in sorted(MODELS)
    for kind, names, marks in (
        ("default", DEFAULT[model], pytest.mark.slow),
        ("extended", [n for n in LAYOUTS[model] if n not in DEFAULT[model]], pytest.mark.extended),
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("model, names", CASES)
def test_adversarial_documents_train_on_every_layout_like_one_process(model, names, tiny_llama, tmp_path):
    lengths = tmp_path / "lengths.csv"
    lengths.write_text("\n".join(map(str, LENGTHS)) + "\n")
    one = train(args(model, tmp_path / "one", lengths))
    assert [r["step"] for r in one] == [1, 2]
    runs = spawn(_layouts, 4, model, list(names), tmp_path, lengths, timeout=600)[0]
    assert sorted(runs) == sorted(names)
    keys = [k for k in one[0] if k in ("loss", "grad_norm") or k.startswith("aux/")]
    assert len(keys) >= (2 if model == "llama" else 4), keys  # dsv4: MTP and indexer terms too
    for name, records in runs.items():
        assert [r["step"] for r in records] == [1, 2], name
        for a, b in zip(one, records, strict=True):
            assert (a["tokens_trained"], a["tokens_real"]) == (b["tokens_trained"], b["tokens_real"]), name
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=REL, abs=0), (name, b["step"], k, a[k], b[k])
        print(
            f"{model} {name}: losses {[r['loss'] for r in records]}, rows {[r['tokens_slots'] for r in records]}"
        )
