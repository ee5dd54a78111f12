"""The Trainer under pipeline parallelism vs one process (4-layer tiny llama, float64, 5 steps).

References are runs of the same trainer on one process. Layouts, all on gloo:
- PP2 with GPipe, Muon (float64 Newton-Schulz);
- PP3 (stages of 2 | 1 | 1 layers: a middle stage), 1F1B, AdamW;
- PP2 x DP2 with Interleaved1F1B (2 stages of one layer per rank: layers 0 and 2 on pp rank 0,
  each stage's view FSDP-sharded over the 2 data-parallel ranks), Muon;
- PP2 x CP2 (zigzag; FSDP over the 2 context-parallel ranks of each stage), 1F1B, Muon (`extended`:
  test_train_adversarial runs PP2 x CP2 of dsv4 in the default suite).
Losses and gradient norms rel <= 1e-12 (float64: another summation order perturbs by ~1e-16 per
operation). Clipping is on (training.max_norm below every step's norm), so a norm that missed
another stage's squared sum would change the update and the later losses.

Checkpoints (Muon: its momentum reshards too): a PP2 checkpoint of step 3 resumed on one process,
and a one-process checkpoint of step 3 resumed on PP2 (1F1B), train steps 4-5 on the same documents
with the uninterrupted run's losses.

dsv4 (the recipe at the micro flavor, Muon): PP3, PP2 x CP2 (contiguous), and a one-process
checkpoint resumed on PP3; loss, MTP, indexer KL and gradient norm rel <= 1e-12.
The fake-process-group dry run with pp prints every stage's share.
"""

import dataclasses
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests import _tiny_llama
from tests._dist import spawn
from tests.test_train_layouts import records
from titan_thd.config import load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
STEPS, SPLIT = 5, 3
ROOT = Path(__file__).resolve().parents[1]
AUX = ("loss", "grad_norm", "aux/mtp", "aux/indexer")


def config(dump: Path, optimizer: str, *extra: str):
    return load_config(
        [
            "--model.flavor",
            _tiny_llama.DEEP,
            "--data.source",
            "jsonl",
            "--data.path",
            "chat_sft.jsonl.gz",
            "--data.cache_dir",
            str(dump.parent / "data_cache"),
            "--training.global_batch_size",
            "8",
            "--training.tokens_per_microbatch",
            "512",
            "--data.pad_to_multiple",
            "4",  # zigzag CP 2 cuts every document into 4 chunks
            "--training.steps",
            str(STEPS),
            "--training.max_norm",
            "0.05",
            "--optimizer.name",
            optimizer,
            "--optimizer.muon_ns_dtype",
            "float64",
            "--training.dtype",
            "float64",
            "--optimizer.lr",
            "3e-3",
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            str(SPLIT),
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_tflops",
            "1",
            "--metrics.log_freq",
            "100",
            "--job.dump_folder",
            str(dump),
            *extra,
        ]
    )


def run(cfg) -> None:
    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
    finally:
        trainer.close()


def _env(rank: int, world_size: int) -> None:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}


def _pp2_runs(rank: int, world_size: int, dumps: dict[str, Path]):
    _env(rank, world_size)
    pp = ("--parallelism.pipeline_parallel_degree", "2")
    run(config(dumps["muon"], "muon", *pp, "--parallelism.pipeline_parallel_schedule", "GPipe"))
    run(config(dumps["from_pp1"], "muon", *pp))


def _pp3_run(rank: int, world_size: int, dump: Path):
    _env(rank, world_size)
    run(config(dump, "adamw", "--parallelism.pipeline_parallel_degree", "3"))


def _world4_run(rank: int, world_size: int, dump: Path, *extra: str):
    _env(rank, world_size)
    run(config(dump, "muon", "--parallelism.pipeline_parallel_degree", "2", *extra))


@pytest.fixture(scope="module")
def runs(tiny_llama, tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("pp")
    d = {name: base / name for name in ("adamw", "muon", "pp2_muon", "pp3", "pp2_dp2")}
    d |= {"pp1_from_pp2": base / "pp1_from_pp2", "pp2_from_pp1": base / "pp2_from_pp1"}
    try:
        run(config(d["adamw"], "adamw"))
        run(config(d["muon"], "muon"))
        shutil.copytree(
            d["muon"] / "checkpoint" / f"step-{SPLIT}", d["pp2_from_pp1"] / "checkpoint" / f"step-{SPLIT}"
        )
        spawn(_pp2_runs, 2, {"muon": d["pp2_muon"], "from_pp1": d["pp2_from_pp1"]}, timeout=600)
        shutil.copytree(
            d["pp2_muon"] / "checkpoint" / f"step-{SPLIT}", d["pp1_from_pp2"] / "checkpoint" / f"step-{SPLIT}"
        )
        run(config(d["pp1_from_pp2"], "muon"))
        spawn(_pp3_run, 3, d["pp3"], timeout=600)
        spawn(
            _world4_run,
            4,
            d["pp2_dp2"],
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
            timeout=600,
        )
    finally:
        torch.set_num_threads(threads)
    return d


def _compare(reference: list[dict], got: list[dict], label: str) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in reference], label
    for a, b in zip(reference, got, strict=True):
        print(
            f"{label} step {a['step']}: loss {b['loss']!r} vs {a['loss']!r} (rel {abs(b['loss'] / a['loss'] - 1):.1e}), "
            f"grad_norm rel {abs(b['grad_norm'] / a['grad_norm'] - 1):.1e}"
        )
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"])
        # Microbatches per data-parallel replica: each of 2 replicas packs about half of the step.
        # pp2_dp2 is interleaved: each replica's K is rounded up to a multiple of pp = 2.
        if "dp2" in label:
            assert b["num_microbatches"] <= a["num_microbatches"] and b["num_microbatches"] % 2 == 0
        else:
            assert b["num_microbatches"] == a["num_microbatches"]
        assert b.keys() == a.keys()
        assert b["grad_norm"] > 0.05  # clipping is active in every step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12, abs=0)


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout, reference",
    [
        ("pp2_muon", "muon"),
        ("pp3", "adamw"),
        ("pp2_dp2", "muon"),
    ],
)
def test_pipeline_matches_one_process(runs, layout, reference):
    one, got = records(runs[reference]), records(runs[layout])
    assert len(one) == STEPS
    _compare(one, got, layout)


@pytest.mark.slow
@pytest.mark.extended
def test_pp2_cp2_matches_one_process(runs, tmp_path):
    """Extended: PP x CP trains like one process in the default suite too, for dsv4 with adversarial
    lengths (test_train_adversarial, `pp2 cp2`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        spawn(_world4_run, 4, tmp_path, "--parallelism.context_parallel_degree", "2", timeout=600)
    finally:
        torch.set_num_threads(threads)
    _compare(records(runs["muon"]), records(tmp_path), "pp2_cp2")


@pytest.mark.slow
@pytest.mark.parametrize("resumed", ["pp1_from_pp2", "pp2_from_pp1"])
def test_resume_across_pipeline_degrees(runs, resumed):
    straight, got = records(runs["muon"]), records(runs[resumed])
    assert [r["step"] for r in got] == list(range(SPLIT + 1, STEPS + 1))
    _compare(straight[SPLIT:], got, resumed)


# ============================================================================ dsv4
def dsv4_config(dump: Path, *extra: str):
    """The dsv4 recipe shrunk to the micro flavor (4 layers: the hash-routed one on stage 0; MTP on
    the last stage with its copy of the embedding) in float64, Muon with float64 Newton-Schulz."""
    return load_config(
        [
            "--job.config_file",
            str(ROOT / "train_configs" / "dsv4_flash_thd.toml"),
            "--model.flavor",
            "micro",
            "--training.tokens_per_microbatch",
            "256",
            "--training.global_batch_size",
            "8",
            "--training.steps",
            "4",
            "--training.dtype",
            "float64",
            "--optimizer.muon_ns_dtype",
            "float64",
            "--lr_scheduler.total_steps",
            "4",
            "--data.cache_dir",
            str(dump.parent / "data_cache"),
            "--checkpoint.enable",
            "true",
            "--checkpoint.interval",
            "2",
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_tflops",
            "1",
            "--metrics.log_freq",
            "100",
            "--job.dump_folder",
            str(dump),
            *extra,
        ]
    )


def _dsv4_pp3_runs(rank: int, world_size: int, dumps: dict[str, Path]):
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    # 2 | 1 | 1 layers: the embedding's copy lives two stages away (a {first, last} group of its own)
    run(dsv4_config(dumps["pp3"], "--parallelism.pipeline_parallel_degree", "3"))
    run(dsv4_config(dumps["pp3_from_pp1"], "--parallelism.pipeline_parallel_degree", "3"))


def _dsv4_pp2_cp2_run(rank: int, world_size: int, dump: Path):
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    cp = ("--parallelism.context_parallel_degree", "2")
    pp = ("--parallelism.pipeline_parallel_degree", "2")
    run(dsv4_config(dump, *pp, *cp, "--checkpoint.enable", "false", "--training.steps", "3"))


def _dsv4_pp2_ep2_run(rank: int, world_size: int, dump: Path):
    """Pipeline and expert parallelism together: 2 stages x 2 data-parallel ranks, each stage's
    MoE layers split over its 2 ranks (experts all-to-all inside the schedule's microbatches)."""
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    ep = ("--parallelism.expert_parallel_degree", "2")
    pp = ("--parallelism.pipeline_parallel_degree", "2")
    run(dsv4_config(dump, *pp, *ep, "--checkpoint.enable", "false", "--training.steps", "3"))


@pytest.fixture(scope="module")
def dsv4_runs(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("pp_dsv4")
    d = {name: base / name for name in ("one", "pp3", "pp3_from_pp1", "pp2_cp2", "pp2_ep2")}
    try:
        run(dsv4_config(d["one"]))
        shutil.copytree(d["one"] / "checkpoint" / "step-2", d["pp3_from_pp1"] / "checkpoint" / "step-2")
        spawn(_dsv4_pp3_runs, 3, d, timeout=600)
        spawn(_dsv4_pp2_cp2_run, 4, d["pp2_cp2"], timeout=600)
        spawn(_dsv4_pp2_ep2_run, 4, d["pp2_ep2"], timeout=600)
    finally:
        torch.set_num_threads(threads)
    return d


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.parametrize("layout", ["pp3", "pp3_from_pp1", "pp2_cp2", "pp2_ep2"])
def test_dsv4_pipeline_matches_one_process(dsv4_runs, layout):
    """Losses, MTP and indexer terms, gradient norms: the MTP's gradient into the embedding reaches
    stage 0's copy (and a one-process checkpoint restores both copies), or step 2 on would differ."""
    one, got = records(dsv4_runs["one"]), records(dsv4_runs[layout])
    if "from" in layout:
        one = one[2:]
    if "2_" in layout:  # pp2_cp2, pp2_ep2: 3 steps (4 processes on 2 cores)
        one = one[:3]
    assert [r["step"] for r in got] == [r["step"] for r in one] and got
    for a, b in zip(one, got, strict=True):
        print(
            f"dsv4 {layout} step {a['step']}: "
            + ", ".join(f"{k} rel {abs(b[k] / a[k] - 1):.1e}" for k in AUX)
        )
        assert b.keys() == a.keys() and a["aux/mtp"] > 0 and a["aux/indexer"] > 0
        assert b["tokens_trained"] == a["tokens_trained"]
        for key in AUX:
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=0), key


# ============================================================================ dry run
@pytest.mark.slow
def test_fake_mode_dry_run_prints_every_stage(tmp_path):
    """COMM_MODE=fake with pp 2 x dp 4: one line per stage; the stages' parameters add up to the
    model's, each rank holds a quarter of its stage (the debug model's dimensions divide by 4)."""
    from tests.e2e.test_train_cli import CONFIG, SMALL, run_train
    from titan_thd.memory import activations
    from titan_thd.models import get_model_args, get_model_spec
    from titan_thd.models.llama.model import build_llama
    from titan_thd.models.spec import count_params

    proc = run_train(
        "--config",
        CONFIG,
        *SMALL,
        "--parallelism.pipeline_parallel_degree",
        "2",
        "--metrics.peak_tflops",
        "1",
        "--job.dump_folder",
        str(tmp_path),
        env={"COMM_MODE": "fake", "NGPU": "8"},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "world 8 on cpu (fake process group): dp 4, cp 1 (zigzag), tp 1, pp 2" in proc.stderr
    stages = re.findall(
        r"pp rank (\d): layers (\d+)-(\d+), ([\d,]+) parameters; ([\d,]+) parameters per rank.*"
        r"in-flight microbatch inputs <= (\d) x",
        proc.stderr,
    )
    assert [(s[0], s[1], s[2], s[5]) for s in stages] == [("0", "0", "3", "2"), ("1", "4", "7", "1")]
    args = dataclasses.replace(get_model_args("llama", "debug"), vocab_size=320)
    with torch.device("meta"):
        full = count_params(build_llama(args))
    per_stage = [int(s[3].replace(",", "")) for s in stages]
    assert sum(per_stage) == full
    assert [int(s[4].replace(",", "")) * 4 for s in stages] == per_stage
    # Saved activations: 1F1B keeps 2 microbatches in flight on stage 0, 1 on stage 1, each worth
    # the stage's measured bytes for one microbatch of T = 1024 tokens.
    saved = activations.measure(get_model_spec("llama"), args, 1024, torch.float32)
    shown = [float(x) for x in re.findall(r"saved activations <= \d x ([\d.]+) MiB", proc.stderr)]
    want = [
        saved.of([str(i) for i in range(4)], True, False),
        saved.of([str(i) for i in range(4, 8)], False, True),
    ]
    assert shown == [round(w / 2**20, 1) for w in want]


# ============================================================================ host memory
def _refusal_pp2(rank: int, world_size: int, dump: Path):
    """Both ranks of a PP2 run on one host: the refusal against 1 byte less than the plan's host sum
    (its message, raised on every rank), then against exactly enough ("" = it passes)."""
    import titan_thd.train as train_module
    from titan_thd.parallel import distributed as dist_utils

    _env(rank, world_size)
    trainer = Trainer(resolve_run(config(dump, "adamw", "--parallelism.pipeline_parallel_degree", "2")))
    try:
        plan = dist_utils.broadcast_object(trainer.memory)  # rank 0's: the one the refusal reads
        need = plan.host_bytes(2)
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        messages = []
        for available in (need - 1, need):
            train_module.available_host_bytes = lambda available=available: available
            try:
                trainer._refuse_beyond_host_memory()
                messages.append("")
            except ValueError as e:
                messages.append(str(e))
    finally:
        trainer.close()
    return plan, messages


@pytest.mark.slow
def test_a_pipeline_run_beyond_the_hosts_memory_is_refused_with_the_numbers(tiny_llama, tmp_path):
    """The refusal reads the memory plan on every layout: under PP2 the host holds pipeline ranks 0
    and 1, whose different figures it names and sums (start-up peak included)."""
    from titan_thd.memory.state import size

    torch.set_num_threads(1)
    (plan, messages), (_, other) = spawn(_refusal_pp2, 2, tmp_path, timeout=600)
    assert other == messages and messages[1] == ""  # every rank refuses together; enough passes
    r0, r1 = plan.ranks
    assert r0.total_bytes != r1.total_bytes and min(r0.saved_bytes, r1.saved_bytes) > 0
    need = r0.total_bytes + r1.total_bytes
    for part in (
        f"memory: 2 rank(s) on this host: 1 x {size(r0.total_bytes)}",
        f"(pp rank 0) + 1 x {size(r1.total_bytes)} (pp rank 1) estimated per rank",
        f") = {size(need)}, more than the {size(need - 1)} this machine has available",
        "activation_checkpoint.mode = none",
        "--activation_checkpoint.mode full",
    ):
        assert part in messages[0], (part, messages[0])
