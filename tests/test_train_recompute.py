"""Activation recomputation through the whole trainer on every parallelism: AC on = AC off.

Both models train 2 steps of mock documents in float64 on 4 gloo processes under DP 2 x CP 2, PP 2
(1F1B and Interleaved1F1B), CP 2 x EP 2 (dsv4) and TP 2, each with recomputation off and on (`full`,
`full` on the first block of each stage, every selective region alone, all of them together). Against the
same layout without recomputation the losses, auxiliary losses, gradient norms and the router loads
of every step and the router biases at the end are bitwise equal (the recomputation runs the same
ops on the same inputs, and every decision is replayed); against one process without recomputation
rel <= 1e-12 (the layouts' own tolerance, tests/test_train_layouts.py). Under EP the experts'
counts all-to-all runs once per MoE layer and microbatch, never in a recomputation. The default
suite runs one layout, in one launch of 4 processes: dsv4 `full` under CP 2 x EP 2, which replays the
CP halo, the entry all-gather and the EP all-to-alls in lockstep (collectives inside a
recomputation). `extended` runs the rest, one launch per model and layout (Interleaved1F1B with
every dsv4 region, llama's TP redistributions replayed under `full`); tests/models/test_recompute.py
covers every mode of both models on one process.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests import _tiny_llama
from tests._dist import spawn
from titan_thd.config import load_config
from titan_thd.models import get_model_spec
from titan_thd.parallel import expert_parallel
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
T = 256
REL = 1e-12
MODELS = {
    "llama": ["--model.name", "llama", "--model.flavor", _tiny_llama.DEEP, "--data.pad_to_multiple", "8"],
    "dsv4": ["--model.name", "dsv4", "--model.flavor", "micro"],
}  # fmt: skip
LAYOUTS = {
    "dp2 cp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2 1F1B": ["--parallelism.pipeline_parallel_degree", "2"],
    "pp2 interleaved": ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B"],
    "cp2 ep2": ["--parallelism.context_parallel_degree", "2", "--parallelism.expert_parallel_degree", "2"],
    "tp2": ["--parallelism.tensor_parallel_degree", "2"],
}  # fmt: skip
MODEL_LAYOUTS = {"llama": [n for n in LAYOUTS if n != "cp2 ep2"], "dsv4": list(LAYOUTS)}


def modes(model: str) -> dict[str, list[str]]:
    regions = list(get_model_spec(model).ac_regions)
    ac = "--activation_checkpoint."
    return {
        "none": [],
        "full": [ac + "mode", "full"],
        "full first1": [ac + "mode", "full", ac + "layers", "1"],
        **{r: [ac + "mode", "selective", ac + "regions", r] for r in regions},
        "all": [ac + "mode", "selective", ac + "regions", ",".join(regions)],
    }


DEFAULT = [("dsv4", "cp2 ep2", "full")]
"""(model, layout, mode) runs of the default suite (each with its layout's run without recomputation)."""


def args(model: str, dump: Path, *extra: str) -> list[str]:
    mock = {
        "mode": "distribution",
        "type": "lognormal",
        "min_seq_len": 8,
        "max_seq_len": T,
        "mean_seq_len": 64,
        "lognormal_sigma": 1.0,
    }
    return [
        *MODELS[model],
        "--data.source", "mock", "--data.mock_config", json.dumps(mock), "--data.num_samples", "64",
        "--training.global_batch_size", "8", "--training.tokens_per_microbatch", str(T),
        "--training.steps", "2", "--training.dtype", "float64", "--optimizer.name", "adamw",
        "--lr_scheduler.warmup_steps", "0", "--metrics.enable_tensorboard", "false", "--metrics.peak_tflops", "1",
        "--job.dump_folder", str(dump), *extra,
    ]  # fmt: skip


def train(argv: list[str]) -> dict:
    """Metrics of every step, the router loads before each optimizer step, the router biases at the
    end (this rank's stages), and how often the EP counts exchange ran."""
    trainer = Trainer(resolve_run(load_config(argv)))
    loads: list[dict[str, torch.Tensor]] = []
    step = trainer.optimizers.step

    def recording_step() -> None:
        loads.append({n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith(".load")})
        step()

    trainer.optimizers.step = recording_step
    calls = {"splits": 0}
    splits = expert_parallel._splits

    def counting(*a, **k):
        calls["splits"] += 1
        return splits(*a, **k)

    expert_parallel._splits = counting
    try:
        trainer.train()
    finally:
        expert_parallel._splits = splits
        trainer.close()
    path = Path(argv[argv.index("--job.dump_folder") + 1]) / "metrics.jsonl"
    biases = {n: b.clone() for n, b in trainer.model.named_buffers() if n.endswith(".bias")}
    return {
        "records": [json.loads(line) for line in path.read_text().splitlines()],
        "loads": loads,
        "biases": biases,
        "splits": calls["splits"],
    }


def _runs(rank: int, world_size: int, cases: list[tuple[str, str, str]], base: Path) -> dict:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    return {
        (model, layout, mode): train(
            args(model, base / f"{model}-{layout}-{mode}", *LAYOUTS[layout], *modes(model)[mode])
        )
        for model, layout, mode in cases
    }


def _cases(kind: str, model: str = "", layout: str = "") -> list[tuple[str, str, str]]:
    """The runs of one launch, each layout's run without recomputation first."""
    every = [(model, layout, mode) for mode in modes(model) if mode != "none"] if model else []
    chosen = DEFAULT if kind == "default" else [c for c in every if c not in DEFAULT]
    plain = sorted(
        {(m, lay, "none") for m, lay, _ in chosen}, key=lambda c: (c[0], list(LAYOUTS).index(c[1]))
    )
    return plain + chosen


CASES = [pytest.param("default", "", "", marks=pytest.mark.slow, id="default")] + [
    pytest.param("extended", model, layout, marks=pytest.mark.extended, id=f"{model}-{layout}")
    for model in sorted(MODELS)
    for layout in MODEL_LAYOUTS[model]
]


@pytest.mark.slow
@pytest.mark.parametrize("kind, model, layout", CASES)
def test_recomputation_trains_like_no_recomputation_on_every_layout(
    kind, model, layout, tiny_llama, tmp_path
):
    cases = _cases(kind, model, layout)
    one = {m: train(args(m, tmp_path / f"one-{m}"))["records"] for m in sorted({c[0] for c in cases})}
    runs = spawn(_runs, 4, cases, tmp_path, timeout=900)[0]
    for (m, layout, mode), run in runs.items():
        records, plain = run["records"], runs[(m, layout, "none")]
        keys = [k for k in one[m][0] if k in ("loss", "grad_norm") or k.startswith("aux/")]
        assert len(keys) >= (2 if m == "llama" else 4), keys  # dsv4: MTP and indexer terms too
        assert [r["step"] for r in records] == [1, 2], (m, layout, mode)
        for a, b, c in zip(one[m], records, plain["records"], strict=True):
            for k in keys:
                assert b[k] == pytest.approx(a[k], rel=REL, abs=0), (
                    m,
                    layout,
                    mode,
                    b["step"],
                    k,
                    a[k],
                    b[k],
                )
                assert b[k] == c[k], (m, layout, mode, b["step"], k, c[k], b[k])  # bitwise
        for got, want in zip(run["loads"], plain["loads"], strict=True):
            assert got.keys() == want.keys(), (m, layout, mode)
            assert all(torch.equal(got[n], want[n]) for n in got), (m, layout, mode)
        assert run["biases"].keys() == plain["biases"].keys()
        assert all(torch.equal(run["biases"][n], plain["biases"][n]) for n in run["biases"]), (
            m,
            layout,
            mode,
        )
        # The counts exchange of every MoE layer runs in the forwards only, never in a recomputation.
        assert run["splits"] == plain["splits"], (m, layout, mode, run["splits"], plain["splits"])
        assert plain["splits"] > 0 or "ep" not in layout
        assert m == "llama" or len(run["loads"][0]) > 0  # the learned routers' loads were compared
