"""The Trainer across parallel layouts and restarts (tiny llama in float64, Muon with float64
Newton-Schulz + AdamW, one thread per process).

References are runs of the same trainer on one process (the independent layout):
- DP=2 (FSDP over 2 gloo ranks) vs DP=1: losses rel <= 1e-12 and full gradients of 5 steps
  within 1e-10 of the gradient's largest entry. Float64, so that the bound is not a float32
  tolerance tuned on one CPU: another summation order perturbs by ~1e-16 per operation, Muon's
  orthogonalisation amplifies that by at most the condition of the update (measured worst
  gradient difference 1.2e-15 on an AVX2 EPYC);
- bitwise resume: 8 steps straight == 4 steps + resume + 4 steps (metrics.jsonl, ==), on one
  process and on DP=2;
- a DP=1 checkpoint resumed on DP=2 trains on the same documents each step, losses rel <= 1e-12;
- the DP=2 checkpoint loads into one process for generation with the DP=1 run's weights;
- a trainer SIGKILLed inside a save resumes from the previous checkpoint;
- bad checkpoints through the trainer: another model, a load_step that does not exist.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests import _tiny_llama
from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from titan_thd.config import load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
STEPS, SPLIT, GRAD_STEPS = 8, 4, 5


def args(dump: Path, steps: int, *extra: str) -> list[str]:
    """8 chat conversations per step in microbatches of 512 tokens (2 to 5 per step); the LR
    schedule is pinned to 8 steps so that a run stopped at 4 continues on the same schedule."""
    return [
        *TRAIN_ARGS,
        "--model.flavor",
        _tiny_llama.NAME,
        "--data.cache_dir",
        str(dump.parent / "data_cache"),
        "--training.steps",
        str(steps),
        "--training.max_norm",
        "0",  # unclipped: a uniform gradient scale error must show in the gradients
        "--optimizer.name",
        "muon",  # Muon for the matrices (momentum state to resume), AdamW for the rest
        "--optimizer.muon_ns_dtype",
        "float64",
        "--training.dtype",
        "float64",
        "--optimizer.lr",
        "3e-3",
        "--lr_scheduler.warmup_steps",
        "2",
        "--lr_scheduler.total_steps",
        str(STEPS),
        "--checkpoint.enable",
        "true",
        "--metrics.peak_tflops",
        "1",
        "--metrics.log_freq",
        "100",
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def config(dump: Path, steps: int, *extra: str):
    return load_config(args(dump, steps, *extra))


def run(cfg, grad_steps: int = 0) -> list[dict[str, torch.Tensor]]:
    """Train `cfg`; the full gradients before each of the first `grad_steps` optimizer steps."""
    trainer = Trainer(resolve_run(cfg))
    grads: list[dict[str, torch.Tensor]] = []
    optimizer_step = trainer.optimizers.step

    def recording_step() -> None:
        if len(grads) < grad_steps:
            grads.append(
                {
                    n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).detach().clone()
                    for n, p in trainer.model.named_parameters()
                }
            )
        optimizer_step()

    trainer.optimizers.step = recording_step
    try:
        trainer.train()
    finally:
        trainer.close()
    return grads


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def _dp2_runs(rank: int, world_size: int, dumps: dict[str, Path]):
    """Every DP=2 run in one launch: straight (gradients of 5 steps), 4 + 4, and 4 more steps from
    the DP=1 checkpoint of step 4."""
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    grads = run(config(dumps["straight"], STEPS), GRAD_STEPS)
    run(config(dumps["split"], SPLIT))
    run(config(dumps["split"], STEPS))
    run(config(dumps["from_dp1"], STEPS))
    return grads if rank == 0 else None


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    """One thread (comparable kernels, and no oversubscription of a busy machine) and the flavor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dp1(tiny, tmp_path_factory):
    base = tmp_path_factory.mktemp("dp1")
    dumps = {"straight": base / "straight", "split": base / "split"}
    grads = run(config(dumps["straight"], STEPS), GRAD_STEPS)
    run(config(dumps["split"], SPLIT))
    run(config(dumps["split"], STEPS))
    return dumps, grads


@pytest.fixture(scope="module")
def dp2(dp1, tmp_path_factory):
    base = tmp_path_factory.mktemp("dp2")
    dumps = {name: base / name for name in ("straight", "split", "from_dp1")}
    shutil.copytree(
        dp1[0]["split"] / "checkpoint" / f"step-{SPLIT}", dumps["from_dp1"] / "checkpoint" / f"step-{SPLIT}"
    )
    grads = spawn(_dp2_runs, 2, dumps, timeout=600)[0]
    return dumps, grads


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (relative to the tensor's scale: elementwise ratios blow up near 0)."""
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.slow
def test_dp2_matches_dp1_losses_and_gradients_over_five_steps(dp1, dp2):
    one, two = records(dp1[0]["straight"]), records(dp2[0]["straight"])
    assert len(dp1[1]) == len(dp2[1]) == GRAD_STEPS
    for step in range(GRAD_STEPS):
        a, b = one[step], two[step]
        assert (a["step"], a["tokens_trained"], a["tokens_real"]) == (
            b["step"],
            b["tokens_trained"],
            b["tokens_real"],
        )
        assert b["num_microbatches"] < a["num_microbatches"]  # each rank packs half of the step
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12, abs=0)
        g1, g2 = dp1[1][step], dp2[1][step]
        assert g1.keys() == g2.keys() and len(g1) == 3 + 2 * 9  # embedding, norm, output + 2 blocks of 9
        worst = max((max_rel(g2[n], g1[n]), n) for n in g1)
        print(
            f"step {step + 1}: loss rel {abs(b['loss'] / a['loss'] - 1):.1e}, worst gradient rel {worst[0]:.1e} ({worst[1]})"
        )
        assert worst[0] <= 1e-10, (step + 1, worst)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["dp1", "dp2"])
def test_resume_is_bitwise(layout, request):
    dumps = request.getfixturevalue(layout)[0]
    straight, split = records(dumps["straight"]), records(dumps["split"])
    print(
        f"{layout} losses, straight: {[r['loss'] for r in straight]}\n{layout} losses, 4 + 4: {[r['loss'] for r in split]}"
    )
    assert [r["step"] for r in split] == list(range(1, STEPS + 1))
    for key in ("loss", "grad_norm", "lr", "tokens_trained"):
        assert [r[key] for r in split] == [r[key] for r in straight], key
    assert sorted(p.name for p in (dumps["split"] / "checkpoint").iterdir()) == [
        f"step-{SPLIT}",
        f"step-{STEPS}",
    ]


@pytest.mark.slow
def test_dp1_checkpoint_resumes_on_dp2_with_the_same_data_stream(dp1, dp2):
    straight, resumed = records(dp1[0]["straight"]), records(dp2[0]["from_dp1"])
    assert [r["step"] for r in resumed] == list(range(SPLIT + 1, STEPS + 1))
    for a, b in zip(straight[SPLIT:], resumed, strict=True):
        print(
            f"step {a['step']}: tokens {a['tokens_real']}/{b['tokens_real']}, loss {a['loss']!r} (dp1) {b['loss']!r} (dp2)"
        )
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"])
        assert b["lr"] == a["lr"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0)


@pytest.mark.slow
def test_a_dp2_checkpoint_loads_into_one_process_for_generation(dp1, dp2):
    """The inference loader (scripts/generate.py, evaluate.py, convert_hf.py to-hf) reads the FSDP-sharded
    DP=2 checkpoint into one process: the weights of the DP=1 run after the same 8 steps (relative 1e-10,
    the gradients' bound), so the same greedy tokens."""
    from titan_thd.inference.loading import load_model

    one = load_model(args(dp1[0]["straight"], STEPS), dp1[0]["straight"], dtype="float64")
    two = load_model(
        args(dp2[0]["straight"], STEPS), dp2[0]["straight"] / "checkpoint" / f"step-{STEPS}", dtype="float64"
    )
    a, b = one.model.state_dict(), two.model.state_dict()
    assert a.keys() == b.keys() and not any(isinstance(v, DTensor) for v in b.values())
    assert max(max_rel(b[k], a[k]) for k in a) <= 1e-10
    prompt = one.chat_prompt([{"role": "user", "content": "What is 12 + 7?"}])
    assert [c.tokens for c in one.generate([prompt], 16)] == [c.tokens for c in two.generate([prompt], 16)]


def test_bad_checkpoints_through_the_trainer(dp1):
    dump = dp1[0]["split"]
    trainer = Trainer(resolve_run(config(dump, STEPS, "--checkpoint.load_step", "3")))
    with pytest.raises(ValueError, match=rf"load_step = 3: .*steps found in .*: {SPLIT}, {STEPS}$"):
        trainer.train()
    trainer.close()
    trainer = Trainer(resolve_run(config(dump, STEPS, "--model.flavor", "debug")))
    with pytest.raises(ValueError, match="saved from another model") as err:
        trainer.train()
    trainer.close()
    assert f"flavor: checkpoint '{_tiny_llama.NAME}', this run 'debug'" in str(err.value)
    assert "layers.0.attention.wq.weight [64, 64] -> [256, 256]" in str(err.value)


@pytest.mark.slow
def test_sigkill_inside_a_trainer_save_keeps_the_previous_checkpoint(dp1, tmp_path):
    """Steps 1-4 with a checkpoint every 2 steps; the save of step 4 hangs after writing its shards
    and the process is killed there. The resumed run continues from step 2 as if nothing happened."""
    dump = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests._slow_save_train", "4", *args(dump, 6, "--checkpoint.interval", "2")],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("inside save"):
                break
        else:
            raise AssertionError(f"trainer ended before the save of step 4: {proc.stderr.read()[-3000:]}")
    finally:
        proc.kill()
        proc.wait(timeout=60)
    folder = dump / "checkpoint"
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == "step-2" and len(names) == 2 and names[1].startswith("step-4.tmp-"), names
    assert any(f.suffix == ".distcp" for f in (folder / names[1]).iterdir())  # killed mid-save

    run(config(dump, 3, "--checkpoint.interval", "2"))
    resumed = records(dump)
    assert [r["step"] for r in resumed] == [1, 2, 3]  # the killed run's step 3 and 4 are replaced
    assert resumed[-1]["loss"] == records(dp1[0]["straight"])[2]["loss"]
