"""Tensor (+ sequence) parallelism through the Trainer equals one process, for llama and dsv4.

Runs of 5 steps (gloo, one thread per process) of the tiny llama and the dsv4 micro flavor, each
layout against the same config on one process:
- layouts TP2 (2 processes), TP2 x DP2 and TP2 x CP2 (4 processes);
- float64 with AdamW: losses (and dsv4's MTP / indexer losses) and grad norms rel <= 1e-12, the
  house bound for "same arithmetic up to summation order" (tests/test_train_layouts.py): TP
  only reorders sums (partial sums over head / column shards, the vocabulary-parallel softmax),
  each reordering perturbs by ~1e-16 relative, 5 steps of AdamW amplify that by far less than 1e4;
- float32 with Muon (float32 Newton-Schulz, AdamW for vectors), rel <= 1e-5 (the issue's bound):
  one reordering perturbs a float32 sum by <= K u (u = 6e-8, K the terms of the sum) in the worst
  case and ~sqrt(K) u typically, ~1e-6 for the K <= 256 reductions here; the loss is a smooth
  function of O(10) such layers and Muon's update is normalised (its relative error is that of its
  input), so after 5 steps the loss moves by ~1e-6, and 1e-5 leaves a factor ~10 of headroom
  while a wrong orthogonalisation (a TP shard instead of the whole matrix) moves it by ~1e-2.
  Routing is discrete: a perturbation can flip one token's expert or indexer choice, which no
  arithmetic bound covers (tests/e2e/test_cp_e2e.py saw 1.7e-5 under DP2 x CP2); in these runs no
  choice flips and the worst values (printed) are ~6e-7 (AVX2 EPYC), a flip would fail the test;
- DCP resume across TP degrees: a one-process checkpoint of step 3 continues on TP2, a TP2
  checkpoint of step 3 continues on one process; steps 4-5 equal the straight run (float64);
- training.compile (dsv4, float64) under TP2 equals eager on one process, rel <= 1e-12;
- zero cross-document leakage under TP2 x CP2: the gradient of one document's logits reaches
  the embedding output of that document's rows only (exactly zero elsewhere).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests import _tiny_llama
from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from titan_thd.config import ActivationCheckpoint, load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = [pytest.mark.filterwarnings("ignore:'set_vital' is deprecated"), pytest.mark.extended]
STEPS, SPLIT = 5, 3
MODELS = {
    "llama": ["--model.flavor", _tiny_llama.NAME],
    "dsv4": ["--model.name", "dsv4", "--model.flavor", "micro"],
}
VARIANTS = {  # name -> (args, relative bound)
    "f64-adamw": (["--training.dtype", "float64", "--optimizer.name", "adamw"], 1e-12),
    "f32-muon": (
        ["--training.dtype", "float32", "--optimizer.name", "muon", "--optimizer.muon_ns_dtype", "float32"],
        1e-5,
    ),
}
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# name -> (world size, parallelism args, variants). Muon in float32 on the 4-process layouts runs on
# TP2 x CP2 only (its 2-D (fsdp, tp) mesh is the same as TP2 x DP2's), for the test-time budget.
LAYOUTS = {
    "tp2": (2, TP2, ("f64-adamw", "f32-muon")),
    "tp2-dp2": (4, TP2, ("f64-adamw",)),
    "tp2-cp2": (4, [*TP2, "--parallelism.context_parallel_degree", "2"], ("f64-adamw", "f32-muon")),
}
RESUME = "f64-adamw"  # the variant whose checkpoints cross TP degrees


def args(dump: Path, model: str, variant: str, steps: int = STEPS, *extra: str) -> list[str]:
    return [
        *TRAIN_ARGS,
        *MODELS[model],
        *VARIANTS[variant][0],
        "--training.global_batch_size", "2",
        "--training.tokens_per_microbatch", "256",
        "--data.pad_to_multiple", "4",
        "--data.cache_dir", str(dump.parent.parent / "data_cache"),
        "--training.steps", str(steps),
        "--optimizer.lr", "3e-3",
        "--lr_scheduler.warmup_steps", "2",
        "--lr_scheduler.total_steps", str(STEPS),
        "--metrics.peak_tflops", "1",
        "--metrics.log_freq", "100",
        "--job.dump_folder", str(dump),
        *extra,
    ]  # fmt: skip


def run(argv: list[str]) -> None:
    trainer = Trainer(resolve_run(load_config(argv)))
    try:
        trainer.train()
    finally:
        trainer.close()


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def checkpointed(dump: Path, model: str, variant: str) -> list[str]:
    return args(
        dump, model, variant, STEPS, "--checkpoint.enable", "true", "--checkpoint.interval", str(SPLIT)
    )


def _env(rank: int, world: int) -> None:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def _tp2_runs(rank: int, world: int, base: Path) -> None:
    """Every TP2 run (world 2): each model and variant, and the continuation of the one-process
    checkpoint of step 3."""
    _env(rank, world)
    for model in MODELS:
        for variant in VARIANTS:
            dump = base / "tp2" / f"{model}-{variant}"
            run(checkpointed(dump, model, variant) if variant == RESUME else args(dump, model, variant))
        run(args(base / "from-tp1" / model, model, RESUME, STEPS, "--checkpoint.enable", "true"))
    run(args(base / "tp2-compiled" / "dsv4", "dsv4", "f64-adamw", STEPS, "--training.compile", "true"))


def _world4_runs(rank: int, world: int, base: Path) -> dict[str, list[int]]:
    _env(rank, world)
    for layout in ("tp2-dp2", "tp2-cp2"):
        for model in MODELS:
            for variant in LAYOUTS[layout][2]:
                run(args(base / layout / f"{model}-{variant}", model, variant, STEPS, *LAYOUTS[layout][1]))
    return {model: _leak_rows(model) for model in MODELS}


def _leak_rows(model_name: str) -> list[int]:
    """Rows (of the whole microbatch) whose embedding output gets a gradient from the logits of
    document LEAK_DOC, under TP2 x CP2 on a random microbatch of 4 documents and tail padding."""
    from tests.models.dsv4._util import doc_slices, packed
    from titan_thd.data.batch_meta import BatchMeta, CPContext
    from titan_thd.data.cp_partition import partition
    from titan_thd.models import get_model_args, get_model_spec
    from titan_thd.parallel.parallel_dims import ParallelDims

    spec = get_model_spec(model_name)
    margs = get_model_args(model_name, MODELS[model_name][-1])
    dims = ParallelDims(pp=1, dp_shard=1, cp=2, tp=2, world_size=4)
    dims.build_meshes("cpu")
    torch.manual_seed(0)
    model = spec.parallelize(
        spec.build(margs).double(),
        dims,
        ac=ActivationCheckpoint(),
    )
    _tokens, batch = packed([21, 47, 9, 30], margs.vocab_size, pad_to=4, tail=24, seed=5)
    mode = spec.parallel.cp_mode
    cp = CPContext(size=2, rank=dims.mesh_rank("cp"), group=dims.get_mesh("cp").get_group(), mode=mode)
    local = partition(batch, 2, cp.rank, mode)
    meta = BatchMeta.from_batch(local, cp=cp, full=batch)
    leak = doc_slices(batch)[1]
    in_doc = (local.row_index >= leak.start) & (local.row_index < leak.stop)
    embed = model.tok_embeddings if model_name == "llama" else model.embed
    kept = {}

    def keep(_module, _inputs, output):
        if "out" not in kept:  # the main embedding (dsv4's MTP embeds the next tokens afterwards)
            output.retain_grad()
            kept["out"] = output

    handle = embed.register_forward_hook(keep)
    with torch.distributed.tensor.parallel.loss_parallel():
        logits = model(local.tokens, meta).logits
    handle.remove()
    # Each tp rank's share of the vocabulary; the sum over tp is the whole document's logits.
    logits.to_local()[in_doc].square().sum().backward()
    grad = kept["out"].grad  # [T/cp/tp, d]: this rank's sequence-parallel rows
    n = grad.shape[0]
    rows = local.row_index[dims.mesh_rank("tp") * n : (dims.mesh_rank("tp") + 1) * n]
    touched = rows[grad.abs().sum(-1).cpu() > 0]
    out: list[list[int]] = [None] * 4  # type: ignore[list-item]
    dist.all_gather_object(out, touched.tolist())
    return sorted(r for part in out for r in part)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the module: one process, TP2, the resumes, then the 4-process layouts."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    base = tmp_path_factory.mktemp("tp")
    try:
        for model in MODELS:
            for variant in VARIANTS:
                dump = base / "one" / f"{model}-{variant}"
                run(checkpointed(dump, model, variant) if variant == RESUME else args(dump, model, variant))
            src = base / "one" / f"{model}-{RESUME}" / "checkpoint" / f"step-{SPLIT}"
            shutil.copytree(src, base / "from-tp1" / model / "checkpoint" / f"step-{SPLIT}")
        spawn(_tp2_runs, 2, base, timeout=900)
        for model in MODELS:  # the TP2 checkpoint of step 3 continues on one process
            src = base / "tp2" / f"{model}-{RESUME}" / "checkpoint" / f"step-{SPLIT}"
            shutil.copytree(src, base / "from-tp2" / model / "checkpoint" / f"step-{SPLIT}")
            run(args(base / "from-tp2" / model, model, RESUME, STEPS, "--checkpoint.enable", "true"))
        leaks = spawn(_world4_runs, 4, base, timeout=900)[0]
    finally:
        torch.set_num_threads(threads)
    return base, leaks


def _compare(ref: list[dict], got: list[dict], rel: float, what: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in ref], what
    worst = 0.0
    for a, b in zip(ref, got):
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"]), what
        for key in [k for k in a if k in ("loss", "grad_norm") or k.startswith("aux/")]:
            worst = max(worst, abs(b[key] / a[key] - 1))
            assert b[key] == pytest.approx(a[key], rel=rel, abs=0), (what, a["step"], key)
    print(f"{what}: worst rel {worst:.1e} (bound {rel:.0e})")


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("model", list(MODELS))
def test_tp_layouts_match_one_process(runs, model, layout):
    base, _ = runs
    for variant in LAYOUTS[layout][2]:
        rel = VARIANTS[variant][1]
        ref = records(base / "one" / f"{model}-{variant}")
        got = records(base / layout / f"{model}-{variant}")
        assert len(ref) == STEPS
        _compare(ref, got, rel, f"{model} {layout} {variant}")


@pytest.mark.slow
def test_compiled_dsv4_under_tp2_matches_one_eager_process(runs):
    """training.compile under TP (dsv4's MTP feeds a vocabulary-parallel embedding into a compiled
    norm: tests/models/test_compile.py's regression) equals eager on one process, float64."""
    base, _ = runs
    ref = records(base / "one" / "dsv4-f64-adamw")
    _compare(ref, records(base / "tp2-compiled" / "dsv4"), 1e-12, "dsv4 tp2 compiled f64-adamw")


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_checkpoints_resume_across_tp_degrees(runs, model):
    base, _ = runs
    straight = records(base / "one" / f"{model}-{RESUME}")
    for source in ("from-tp1", "from-tp2"):
        resumed = records(base / source / model)
        assert [r["step"] for r in resumed] == list(range(SPLIT + 1, STEPS + 1)), source
        _compare(straight[SPLIT:], resumed, 1e-12, f"{model} {source}")


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_no_gradient_crosses_documents_under_tp_cp(runs, model):
    from tests.models.dsv4._util import doc_slices, packed
    from titan_thd.models import get_model_args

    margs = get_model_args(model, MODELS[model][-1])
    _tokens, batch = packed([21, 47, 9, 30], margs.vocab_size, pad_to=4, tail=24, seed=5)
    leak = doc_slices(batch)[1]
    assert runs[1][model] == list(range(leak.start, leak.stop))
