"""Every parallel dimension composes: TP x PP, TP x EP, HSDP, all at once, through the Trainer.

References are runs of the same trainer on one process (tiny 4-layer llama with AdamW, the dsv4
recipe at the micro flavor with Muon and float64 Newton-Schulz; float64, 3 steps, clipping on for
llama so that a wrong norm changes the later steps). Losses, dsv4's MTP and indexer terms and the
gradient norms rel <= 1e-12: the layouts only reorder sums (partial sums over head / column / expert
shards, the vocabulary-parallel softmax, reduce-scatters then all-reduces under HSDP), ~1e-16 each
in float64 (tests/test_train_tp.py argues the bound).

Default suite (one 4-process spawn, 2 steps each):
- llama PP2 x TP2 with Interleaved1F1B (2 stages per rank: the boundary carries each tp rank's
  sequence-parallel rows [T/tp, D], from a stage's view to the next rank's);
- llama HSDP 2 x 2 (parameters sharded over 2 ranks, gradients all-reduced across 2 replicas; the
  planner's 4 data-parallel ranks each read their own share);
- dsv4 EP2 x TP2 (experts split by expert over ep and by hidden column over tp).
Extended: dsv4 PP2 x TP2 (GPipe), llama PP2 x TP2 (1F1B), dsv4 HSDP 2 x 2 with EP2; DCP resume of
a PP2 x TP2 checkpoint on HSDP 2 x 2 and of an HSDP 2 x 2 checkpoint on PP2 x TP2 (tp x pp and
replicate x shard both change); and PP2 x DP2 x CP2 x TP2 x EP2 on 16 processes for dsv4 (five
dimensions > 1 need 16: pp, dp, cp and tp each take processes, ep is carved out of dp_shard x cp;
the dp 2 are HSDP replicas, each sharding its parameters over its 2 cp ranks).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests import _tiny_llama
from tests._dist import spawn
from tests.test_train_layouts import records
from titan_thd.config import load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
ROOT = Path(__file__).resolve().parents[1]
STEPS, SPLIT = 3, 2
KEYS = ("loss", "grad_norm", "aux/mtp", "aux/indexer")

PP2, TP2 = ["--parallelism.pipeline_parallel_degree", "2"], ["--parallelism.tensor_parallel_degree", "2"]
EP2, CP2 = ["--parallelism.expert_parallel_degree", "2"], ["--parallelism.context_parallel_degree", "2"]
HSDP = ["--parallelism.data_parallel_replicate_degree", "2", "--parallelism.data_parallel_shard_degree", "2"]
SCHEDULE = "--parallelism.pipeline_parallel_schedule"

# name -> (model, world, parallelism args, steps)
DEFAULT = {
    "llama-pp2-tp2-interleaved": ("llama", 4, [*PP2, *TP2, SCHEDULE, "Interleaved1F1B"], SPLIT),
    "llama-hsdp2x2": ("llama", 4, HSDP, SPLIT),
    "dsv4-ep2-tp2": ("dsv4", 4, [*EP2, *TP2], SPLIT),
}
EXTENDED = {
    "llama-pp2-tp2-1f1b": ("llama", 4, [*PP2, *TP2], STEPS),
    "dsv4-pp2-tp2-gpipe": ("dsv4", 4, [*PP2, *TP2, SCHEDULE, "GPipe"], STEPS),
    "dsv4-hsdp2x2-ep2": ("dsv4", 4, [*HSDP, *EP2], STEPS),
}
RESUMES = {  # resumed run -> (the run whose step-SPLIT checkpoint it continues, its parallelism args)
    "llama-hsdp-from-pp2-tp2": ("llama-pp2-tp2-1f1b", HSDP),
    "llama-pp2-tp2-from-hsdp": ("llama-hsdp2x2-3", [*PP2, *TP2]),
}
# pp 2 x dp 2 (HSDP: 2 replicas, each sharded over its 2 cp ranks) x cp 2 x tp 2, ep 2 over the cp ranks
REPLICAS2 = [
    "--parallelism.data_parallel_replicate_degree",
    "2",
    "--parallelism.data_parallel_shard_degree",
    "1",
]
FIVE_D = ("dsv4", 16, [*PP2, *REPLICAS2, *CP2, *TP2, *EP2], SPLIT)


def config(dump: Path, model: str, steps: int, *extra: str):
    common = [
        "--training.steps", str(steps),
        "--training.dtype", "float64",
        "--lr_scheduler.total_steps", str(STEPS),
        "--checkpoint.enable", "true",
        "--checkpoint.interval", str(SPLIT),
        "--metrics.enable_tensorboard", "false",
        "--metrics.peak_tflops", "1",
        "--metrics.log_freq", "100",
        "--job.dump_folder", str(dump),
        "--data.cache_dir", str(dump.parent / "data_cache"),
    ]  # fmt: skip
    if model == "llama":
        own = [
            "--model.flavor", _tiny_llama.DEEP,
            "--data.source", "jsonl",
            "--data.path", "chat_sft.jsonl.gz",
            "--training.global_batch_size", "8",
            "--training.tokens_per_microbatch", "512",
            "--data.pad_to_multiple", "4",
            "--training.max_norm", "0.05",
            "--optimizer.name", "adamw",
            "--optimizer.lr", "3e-3",
        ]  # fmt: skip
    else:  # the recipe (Muon) at the micro flavor: MTP on the last stage, a hash-routed layer
        own = [
            "--job.config_file", str(ROOT / "train_configs" / "dsv4_flash_thd.toml"),
            "--model.flavor", "micro",
            "--training.tokens_per_microbatch", "256",
            "--training.global_batch_size", "8",
            "--optimizer.muon_ns_dtype", "float64",
        ]  # fmt: skip
    return load_config([*own, *common, *extra])


def run(dump: Path, model: str, steps: int, *extra: str) -> Trainer:
    trainer = Trainer(resolve_run(config(dump, model, steps, *extra)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def _env(rank: int, world: int) -> None:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def _meshes(trainer: Trainer) -> list[tuple[str, ...]]:
    """The mesh dimension names of this rank's parameters (what sharded them)."""
    return sorted(
        {p.device_mesh.mesh_dim_names for p in trainer.model.parameters() if isinstance(p, DTensor)}
    )


def _runs(rank: int, world: int, base: Path, runs: dict) -> dict[str, list]:
    _env(rank, world)
    return {
        name: _meshes(run(base / name, model, steps, *extra))
        for name, (model, _, extra, steps) in runs.items()
    }


def _resumes(rank: int, world: int, base: Path) -> None:
    _env(rank, world)
    for name, (_, extra) in RESUMES.items():
        run(base / name, "llama", STEPS, *extra)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    path = tmp_path_factory.mktemp("compose")
    try:
        for model in ("llama", "dsv4"):
            run(path / f"{model}-one", model, STEPS)
    finally:
        torch.set_num_threads(threads)
    return path


def _spawn(fn, world: int, *args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return spawn(fn, world, *args, timeout=1200)
    finally:
        torch.set_num_threads(threads)


def _compare(base: Path, name: str, model: str, reference: str | None = None) -> None:
    one, got = records(base / (reference or f"{model}-one")), records(base / name)
    steps = [r["step"] for r in got]
    one = [r for r in one if r["step"] in steps]
    assert steps and steps == [r["step"] for r in one], (name, steps)
    for a, b in zip(one, got, strict=True):
        print(
            f"{name} step {a['step']} (K {b['num_microbatches']}): "
            + ", ".join(f"{k} rel {abs(b[k] / a[k] - 1):.1e}" for k in KEYS if k in a)
        )
        assert b.keys() == a.keys() and b["tokens_trained"] == a["tokens_trained"]
        for key in (k for k in KEYS if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=0), (name, a["step"], key)
    if model == "dsv4":
        assert one[0]["aux/mtp"] > 0 and one[0]["aux/indexer"] > 0


@pytest.mark.slow
def test_tp_pp_hsdp_tp_ep_match_one_process(base):
    meshes = _spawn(_runs, 4, base, DEFAULT)[0]
    for name, (model, *_rest) in DEFAULT.items():
        _compare(base, name, model)
    # What sharded the parameters: HSDP's 2-D mesh; the experts' (efsdp, ep, tp) under TP x EP.
    assert ("replicate", "shard") in meshes["llama-hsdp2x2"]
    assert ("expert_ep", "expert_tp") in [m[-2:] for m in meshes["dsv4-ep2-tp2"]]
    assert ("tp",) in [m[-1:] for m in meshes["llama-pp2-tp2-interleaved"]]


@pytest.mark.slow
@pytest.mark.extended
def test_more_layouts_and_resume_across_tp_pp_and_replicate_shard(base):
    runs = EXTENDED | {"llama-hsdp2x2-3": ("llama", 4, HSDP, STEPS)}
    _spawn(_runs, 4, base, runs)
    for name, (model, *_rest) in runs.items():
        _compare(base, name, model)
    for name, (source, _) in RESUMES.items():
        src = base / source / "checkpoint" / f"step-{SPLIT}"
        shutil.copytree(src, base / name / "checkpoint" / f"step-{SPLIT}")
    _spawn(_resumes, 4, base)
    for name in RESUMES:
        assert [r["step"] for r in records(base / name)] == list(range(SPLIT + 1, STEPS + 1))
        _compare(base, name, "llama")


@pytest.mark.slow
@pytest.mark.extended
def test_five_dimensions_at_once(base):
    model, world, extra, steps = FIVE_D
    _spawn(_runs, world, base, {"dsv4-5d": FIVE_D})
    _compare(base, "dsv4-5d", model)
