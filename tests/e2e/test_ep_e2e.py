"""Expert parallelism end to end (dsv4 recipe, micro flavor; every layout on 4 gloo processes in one
launch) against one process, 5 steps:

- EP2 x CP2 (dp 2 x cp 2, the ep group is one replica's two CP ranks, experts FSDP-sharded over
  efsdp 2), AdamW and Muon: losses (CE, MTP, indexer) and grad norms rel <= 1e-12 in float64
  (Muon's Newton-Schulz then runs in float64 too). In float64 another summation order perturbs
  by ~1e-16 and no top-k choice flips (tests/e2e/test_cp_e2e.py explains why a float32 run with
  routing cannot be bounded).
- DCP resume across ep degrees, Muon: EP2 (dp 4, efsdp 2) steps 1-2 -> ep1 step 3 -> ep4 (efsdp 1)
  steps 4-5, one checkpoint folder: the same tokens and, rel <= 1e-12, the same numbers as the
  straight one-process run.
- float32, EP2 x CP2 vs one process, AdamW, rel <= 1e-5, on a flavor without discrete choices
  (every token to every expert, no CSA indexer, `register_float32_flavor`): the layouts then run
  the same arithmetic up to summation order (FSDP reduce-scatter, the loss sums over ranks, the
  CP halo split; EP itself only moves rows). Each such sum of n terms is off by at most
  ~n·u·(sum of |terms|) with u = 2^-24 = 6e-8, in practice ~sqrt(n)·u: ~1e-6 relative for the
  n <= 2048 tokens of a step. AdamW's step lr·m/(sqrt(v)+eps) is a ratio of those sums and does
  not amplify a relative perturbation (|d(g/(|g|+eps))/dg|·|g| <= 1/4), so after 5 steps of
  lr <= 3e-3 the weights differ by <= 5·lr·1e-6 relative and the losses by ~1e-6: the 1e-5 bound
  holds with a margin of ~10.
"""

import dataclasses
import os
from pathlib import Path

import pytest
import torch

from tests._dist import spawn
from titan_thd.config import load_config
from titan_thd.models.dsv4.args import flavors

ROOT = Path(__file__).resolve().parents[2]
STEPS = 5
REL = 1e-12
F32_REL = 1e-5  # derived in the module docstring
KEYS = ("loss", "aux/mtp", "aux/indexer", "grad_norm")
FLOAT32_FLAVOR = "micro_ep_f32"


def args(dump: Path, *extra: str) -> list[str]:
    return [
        "--job.config_file", str(ROOT / "train_configs" / "dsv4_flash_thd.toml"),
        "--model.flavor", "micro",
        "--training.tokens_per_microbatch", "256",
        "--training.global_batch_size", "8",
        "--training.dtype", "float64",
        "--training.steps", str(STEPS),
        "--lr_scheduler.total_steps", str(STEPS),  # resumed runs stop early on the same schedule
        "--metrics.enable_tensorboard", "false",
        "--metrics.peak_tflops", "1",
        "--data.cache_dir", str(dump.parent / "data_cache"),
        "--job.dump_folder", str(dump),
        *extra,
    ]  # fmt: skip


ADAMW = ("--optimizer.name", "adamw")
EP2 = ("--parallelism.expert_parallel_degree", "2")
CP2 = ("--parallelism.context_parallel_degree", "2")
F32 = ("--training.dtype", "float32", "--model.flavor", FLOAT32_FLAVOR, "--optimizer.name", "adamw")
SAVE = ("--checkpoint.enable", "true", "--checkpoint.interval", "1000")  # the final step only
RUNS = {  # name -> extra arguments; all on 4 processes, in this order
    "ep2cp2_adamw": (*ADAMW, *EP2, *CP2),
    "ep2cp2_muon": (*EP2, *CP2),
    # Muon (momentum state per expert to reshard), one checkpoint folder: ep2 (dp 4) steps 1-2,
    # then ep1 step 3, then ep4 steps 4-5; together the EP2 run of the list (steps 1-2).
    "ep2_muon": (*EP2, *SAVE, "--training.steps", "2"),
    "resume_ep1": (*SAVE, "--training.steps", "3"),
    "resume_ep4": (*SAVE, "--parallelism.expert_parallel_degree", "4"),
    "ep2cp2_f32": (*F32, *EP2, *CP2),
}
REFERENCES = {"one_adamw": ADAMW, "one_muon": (), "one_f32": F32}


def register_float32_flavor() -> None:
    """micro with no discrete choice left: every token goes to all 4 experts (k = E; hash layers
    too), and no CSA layer (its indexer picks top-k entries); HCA and sliding layers attend every
    visible entry. Routing then never flips, and a float32 layout differs from one process only
    by summation order."""
    base = flavors["micro"]
    flavors[FLOAT32_FLAVOR] = dataclasses.replace(
        base, n_activated_experts=base.n_experts, layer_types=("sliding", "hca", "sliding", "hca")
    )


def _cfg(dumps: dict[str, Path], name: str):
    extra = RUNS[name] if name in RUNS else REFERENCES[name]
    if name.startswith("resume"):  # the checkpoint folder of the ep2 run, its newest step
        extra = (*extra, "--checkpoint.folder", str(dumps["ep2_muon"] / "checkpoint"))
    return load_config(args(dumps[name], *extra))


def _train(cfg) -> None:
    from titan_thd.startup import resolve_run
    from titan_thd.train import Trainer

    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
    finally:
        trainer.close()


def _ep_runs(rank: int, world: int, dumps: dict[str, Path]):
    register_float32_flavor()
    os.environ |= {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    for name in RUNS:
        _train(_cfg(dumps, name))


def records(dump: Path) -> list[dict]:
    import json

    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.extended
@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
def test_expert_parallel_layouts_match_one_process(tmp_path, monkeypatch, request):
    monkeypatch.setitem(flavors, FLOAT32_FLAVOR, flavors["micro"])
    register_float32_flavor()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernels of the ranks (spawn runs them on one thread each)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    dumps = {name: tmp_path / name for name in (*REFERENCES, *RUNS)}
    for name in REFERENCES:
        _train(_cfg(dumps, name))
    spawn(_ep_runs, 4, dumps, timeout=600)
    ref = {name: records(dumps[name]) for name in REFERENCES}
    got = {name: records(dumps[name]) for name in RUNS}

    def compare(name: str, reference: str, steps: list[int], rel: float) -> float:
        by_step = {r["step"]: r for r in ref[reference]}
        assert [r["step"] for r in got[name]] == steps, (name, [r["step"] for r in got[name]])
        worst = 0.0
        for b in got[name]:
            a = by_step[b["step"]]
            # The same documents each step (token stream), then the same numbers.
            assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"]), name
            for key in KEYS:
                assert b[key] == pytest.approx(a[key], rel=rel, abs=0), (name, b["step"], key, a[key], b[key])
                if a[key]:  # the float32 flavor has no CSA layer: its indexer loss is 0 in both
                    worst = max(worst, abs(b[key] - a[key]) / abs(a[key]))
        return worst

    all_steps = list(range(1, STEPS + 1))
    report = {
        "ep2cp2_adamw": compare("ep2cp2_adamw", "one_adamw", all_steps, REL),
        "ep2cp2_muon": compare("ep2cp2_muon", "one_muon", all_steps, REL),
        "ep2_muon": compare("ep2_muon", "one_muon", [1, 2], REL),
        "resume_ep1": compare("resume_ep1", "one_muon", [3], REL),
        "resume_ep4": compare("resume_ep4", "one_muon", [4, 5], REL),
        "ep2cp2_f32": compare("ep2cp2_f32", "one_f32", all_steps, F32_REL),
    }
    assert got["ep2cp2_muon"][-1]["loss"] < got["ep2cp2_muon"][0]["loss"]
    print("max rel diff vs one process: " + ", ".join(f"{k} {v:.1e}" for k, v in report.items()))
