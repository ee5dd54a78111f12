"""Mixed precision through the Trainer on one process (FSDP2 over a group of one; docs/design.md §5.6).

- the small-step test: one AdamW step at lr 1e-5 under bf16 compute on float32 master weights
  moves every element whose gradient is nonzero; pure bf16 drops most of them (measured, printed);
- the dtypes at each place: sharded master weights, their gradients and the optimizer state
  float32; the parameters a unit gathers and the activations bfloat16; every FSDP unit reduces in
  float32;
- DCP resume is bitwise under mixed precision (float32 master state in the checkpoint), and a
  checkpoint saved under one precision setting loads bitwise under the other;
- 20 steps of both recipes: mixed bf16 within one bf16 roundoff of float32 per step, pure bf16
  farther (extended: a minute or more each);
- parallel layouts under mixed bf16 vs one process under mixed bf16 (dp, pp; tp, cp and dsv4's
  ep extended), bound 2 bf16 roundoffs;
- dsv4: the mHC and the router compute in float32; the HF export of a mixed run is its float32
  master.

The tiny llama (dsv4 micro for ep and the export), one thread; bf16 compute is emulated on AVX2-only CPUs, which these tests allow
(no timing, and only exact statements: an element moved or not, a dtype, a bitwise equality).
"""

import json
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests.conftest import TRAIN_ARGS
from titan_thd.config import load_config
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
MIXED = ("--training.dtype", "float32", "--training.mixed_precision_param", "bfloat16")
FP32 = ("--training.dtype", "float32", "--training.mixed_precision_param", "float32")
PURE = ("--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16")
SMALL = ("--training.global_batch_size", "4", "--training.tokens_per_microbatch", "256")
"""4 conversations per step in microbatches of 256 tokens: cheap also where bf16 is emulated."""


@pytest.fixture(scope="module")
def tiny(tiny_llama):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield tiny_llama
    torch.set_num_threads(threads)


def config(dump: Path, steps: int, *extra: str):
    return load_config(
        [
            *TRAIN_ARGS,
            *SMALL,
            "--model.flavor",
            "test_tiny",
            "--data.cache_dir",
            str(dump.parent / "data_cache"),
            "--training.steps",
            str(steps),
            "--metrics.peak_tflops",
            "1",
            "--metrics.log_freq",
            "100",
            "--job.dump_folder",
            str(dump),
            *extra,
        ]
    )


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def one_small_step(dump: Path, *precision: str) -> tuple[int, int, int]:
    """(elements with a nonzero gradient, how many of them the step left bitwise unchanged, all
    elements) of one AdamW step at lr 1e-5 (no warmup, no decay, no clipping)."""
    cfg = config(
        dump,
        1,
        *precision,
        "--optimizer.lr",
        "1e-5",
        "--optimizer.weight_decay",
        "0",
        "--lr_scheduler.warmup_steps",
        "0",
        "--lr_scheduler.decay",
        "none",
        "--training.max_norm",
        "0",
    )
    trainer = Trainer(resolve_run(cfg))
    try:
        before = {n: full(p) for n, p in trainer.model.named_parameters()}
        grads: dict[str, torch.Tensor] = {}
        step = trainer.optimizers.step

        def recording_step() -> None:
            grads.update({n: full(p.grad) for n, p in trainer.model.named_parameters()})
            step()

        trainer.optimizers.step = recording_step
        trainer.train()
        after = {n: full(p) for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
    moved = nonzero = total = 0
    for n in before:
        g = grads[n] != 0
        nonzero += int(g.sum())
        moved += int((after[n] != before[n])[g].sum())
        total += g.numel()
        assert torch.equal(after[n][~g], before[n][~g]), n  # no gradient, no decay: no change
    return nonzero, nonzero - moved, total


def test_small_step_mixed_moves_every_weight_pure_bf16_drops_most(tiny, tmp_path):
    nonzero, unchanged, total = one_small_step(tmp_path / "mixed", *MIXED)
    assert nonzero > 0.8 * total  # all but embedding rows of tokens not in the batch
    assert unchanged == 0, f"{unchanged} of {nonzero} elements with a gradient did not move"
    nonzero_bf16, lost, _ = one_small_step(tmp_path / "pure", *PURE)
    print(
        f"one AdamW step at lr 1e-5: mixed bf16 left 0 of {nonzero} elements with a gradient unchanged; "
        f"pure bf16 left {lost} of {nonzero_bf16} ({lost / nonzero_bf16:.0%}) unchanged"
    )
    # |update| ~ lr = 1e-5 < half a bf16 step of |w| > 2.6e-3: most of the 0.02-std init and all the norms.
    assert lost > 0.5 * nonzero_bf16


def test_dtypes_at_each_place(tiny, tmp_path):
    """Master weights, gradients and AdamW state float32 (sharded, on a mesh of one rank); inside
    the forward each block's parameters and activations bfloat16; reduction float32; the loss
    float32 (the logits are upcast inside the loss)."""
    trainer = Trainer(resolve_run(config(tmp_path, 1, *MIXED)))
    seen: list[tuple[str, torch.dtype, torch.dtype]] = []
    try:
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in trainer.model.modules() if isinstance(m, FSDPModule)]
        assert len(units) == 3  # two blocks and the root
        for u in units:
            mp = u._get_fsdp_state()._mp_policy
            assert (mp.param_dtype, mp.reduce_dtype) == (torch.bfloat16, torch.float32)
        wq = trainer.model.layers["0"].attention.wq
        wq.register_forward_hook(lambda m, args, out: seen.append(("wq", m.weight.dtype, out.dtype)))
        head = trainer.model.output
        head.register_forward_hook(lambda m, args, out: seen.append(("output", args[0].dtype, out.dtype)))
        trainer.train()
        for n, p in trainer.model.named_parameters():
            assert isinstance(p, DTensor) and p.dtype == torch.float32, n
            assert p.grad is not None and p.grad.dtype == torch.float32, n
        states = trainer.optimizers.optimizers[0].state.values()
        assert states and all(s["exp_avg"].dtype == s["exp_avg_sq"].dtype == torch.float32 for s in states)
    finally:
        trainer.close()
    assert seen and all(w == o == torch.bfloat16 for _, w, o in seen), seen
    assert {name for name, *_ in seen} == {"wq", "output"}


def records(dump: Path) -> list[dict]:
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def state_of(trainer: Trainer) -> tuple[dict, list]:
    params = {n: full(p) for n, p in trainer.model.named_parameters()}
    states = [
        {k: full(v) for k, v in s.items()} for o in trainer.optimizers.optimizers for s in o.state.values()
    ]
    return params, states


def train(cfg) -> tuple[dict, list]:
    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
        return state_of(trainer)
    finally:
        trainer.close()


CKPT = ("--checkpoint.enable", "true", "--lr_scheduler.warmup_steps", "1", "--lr_scheduler.total_steps", "4")


def test_resume_bitwise_and_across_precision_settings(tiny, tmp_path):
    """4 steps straight == 2 + resume + 2 under mixed bf16 (losses, weights and optimizer state
    bitwise); the step-2 checkpoint holds float32 master state, so a float32 run resumed from it
    starts from bitwise the same weights and AdamW state, and a mixed run resumes bitwise from a
    float32 run's checkpoint."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    final = train(config(straight, 4, *MIXED, *CKPT))
    at_two = train(config(split, 2, *MIXED, *CKPT))
    _assert_bitwise(train(config(split, 4, *MIXED, *CKPT)), final)
    assert [r["loss"] for r in records(split)] == [r["loss"] for r in records(straight)]

    for saved, other in ((MIXED, FP32), (FP32, MIXED)):
        src = tmp_path / f"src_{saved[-1]}"
        expect = at_two if saved is MIXED else train(config(src, 2, *saved, *CKPT))
        if saved is MIXED:
            src = split
        dst = tmp_path / f"dst_{other[-1]}"
        (dst / "checkpoint").mkdir(parents=True)
        (dst / "checkpoint" / "step-2").symlink_to(src / "checkpoint" / "step-2")
        trainer = Trainer(resolve_run(config(dst, 2, *other, *CKPT)))
        try:
            trainer.checkpointer.load()
            _assert_bitwise(state_of(trainer), expect)
            assert trainer.step == 2
        finally:
            trainer.close()


def _assert_bitwise(got: tuple[dict, list], expect: tuple[dict, list]) -> None:
    (p1, s1), (p2, s2) = got, expect
    assert p1.keys() == p2.keys()
    for n in p1:
        assert p1[n].dtype == torch.float32 and torch.equal(p1[n], p2[n]), n
    assert len(s1) == len(s2)
    for a, b in zip(s1, s2, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------- losses over 20 steps, layouts
U_BF16 = 2.0**-8
"""bf16's unit roundoff (8 significant bits): the relative error of rounding one value to bf16."""

LLAMA = ("--job.config_file", "train_configs/debug_dense_thd.toml", "--model.flavor", "test_tiny")
DSV4 = ("--job.config_file", "train_configs/dsv4_flash_thd.toml", "--model.flavor", "micro")


def losses(dump: Path, steps: int, *extra: str) -> list[float]:
    cfg = load_config(
        [
            *extra,
            "--training.steps",
            str(steps),
            "--data.cache_dir",
            str(dump.parent / "data_cache"),
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_tflops",
            "1",
            "--metrics.log_freq",
            "100",
            "--job.dump_folder",
            str(dump),
        ]
    )
    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
    finally:
        trainer.close()
    return [r["loss"] for r in records(dump)]


def assert_mixed_tracks_float32(tmp_path: Path, recipe: tuple[str, ...], steps: int) -> None:
    """Bound: every step's mixed loss within U_BF16 (relative) of the float32 run's, i.e. within
    one bf16 rounding of the loss itself. Why it holds: the master weights take the float32
    update every step, so the runs differ only by the bf16 rounding inside each forward and
    backward (relative ~U_BF16 per operation, independent across the thousands of tokens a loss
    averages, so the mean moves far less) and by the gradient's own relative ~U_BF16 perturbation
    carried by lr-sized steps; nothing accumulates the way lost updates do. Pure bf16, whose
    updates below ~|w| / 256 vanish, is farther from float32 on average."""
    ref = losses(tmp_path / "fp32", steps, *recipe, *SMALL, *FP32)
    mixed = losses(tmp_path / "mixed", steps, *recipe, *SMALL, *MIXED)
    pure = losses(tmp_path / "pure", steps, *recipe, *SMALL, *PURE)
    rel_mixed = [abs(a - b) / b for a, b in zip(mixed, ref, strict=True)]
    rel_pure = [abs(a - b) / b for a, b in zip(pure, ref, strict=True)]
    print(
        f"{recipe[1]}, {steps} steps, max / mean |dloss| / loss vs float32: mixed bf16 "
        f"{max(rel_mixed):.1e} / {sum(rel_mixed) / steps:.1e}, pure bf16 {max(rel_pure):.1e} / "
        f"{sum(rel_pure) / steps:.1e} (bound {U_BF16:.1e})"
    )
    assert len(ref) == steps and ref[-1] < ref[0]  # it trains
    assert max(rel_mixed) <= U_BF16, rel_mixed
    assert sum(rel_mixed) < sum(rel_pure)


@pytest.mark.slow
@pytest.mark.extended
def test_mixed_losses_track_float32_llama(tiny, tmp_path):
    assert_mixed_tracks_float32(tmp_path, LLAMA, 20)


@pytest.mark.slow
@pytest.mark.extended
def test_mixed_losses_track_float32_dsv4(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert_mixed_tracks_float32(tmp_path, DSV4, 20)
    finally:
        torch.set_num_threads(threads)


LAYOUTS = {  # name: (recipe, layout)
    "dp2": (LLAMA, ("--parallelism.data_parallel_shard_degree", "2")),
    "pp2": (LLAMA, ("--parallelism.pipeline_parallel_degree", "2")),
    "tp2": (LLAMA, ("--parallelism.tensor_parallel_degree", "2")),
    "cp2": (LLAMA, ("--parallelism.context_parallel_degree", "2")),
    "ep2": (DSV4, ("--parallelism.expert_parallel_degree", "2")),
}
LAYOUT_STEPS = 2


def _layout_runs(rank: int, world_size: int, base: Path, names: list[str]) -> dict[str, list[float]]:
    import os

    from tests import _tiny_llama

    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    torch.manual_seed(0)
    out = {}
    for name in names:
        recipe, layout = LAYOUTS[name]
        dump = base / name
        cfg = load_config(
            [
                *recipe,
                *SMALL,
                *MIXED,
                *layout,
                "--training.steps",
                str(LAYOUT_STEPS),
                "--job.dump_folder",
                str(dump),
            ]
            + ["--data.cache_dir", str(base / "data_cache"), "--metrics.enable_tensorboard", "false"]
            + ["--metrics.peak_tflops", "1"]
        )
        trainer = Trainer(resolve_run(cfg))
        try:
            if name == "pp2":  # the boundary tensors are allocated (and checked) in the compute dtype
                assert trainer.runner.dtype == torch.bfloat16
            trainer.train()
            for n, p in trainer.model.named_parameters():
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32, (name, n)
        finally:
            trainer.close()
        out[name] = [r["loss"] for r in records(dump)] if rank == 0 else []
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "names",
    [
        ["dp2", "pp2"],
        pytest.param(["tp2", "cp2", "ep2"], marks=pytest.mark.extended),
    ],
    ids=["dp-pp", "tp-cp-ep"],
)
def test_parallel_layouts_under_mixed_equal_one_process(tiny, tmp_path, names):
    """Each layout under mixed bf16 vs one process under mixed bf16, 2 steps (dsv4 for ep).
    Bound 2 U_BF16 per step: both runs compute the same float32-master step; a layout only
    changes which bf16 roundings happen (tp rounds each partial matmul sum before its all-reduce,
    dp and cp split the rows and the attention, pp sends bf16 boundary tensors, ep sends bf16
    tokens to the experts), each a relative U_BF16 of its value, so each run is within U_BF16 of
    the exact step (the bound of `assert_mixed_tracks_float32`) and the two within twice that."""
    from tests._dist import spawn

    refs = {
        recipe: losses(
            tmp_path / f"one_{recipe[1].rsplit('/', 1)[-1]}", LAYOUT_STEPS, *recipe, *SMALL, *MIXED
        )
        for recipe in {LAYOUTS[n][0] for n in names}
    }
    runs = spawn(_layout_runs, 2, tmp_path, names, timeout=1200)[0]
    for name, got in runs.items():
        one = refs[LAYOUTS[name][0]]
        rel = [abs(a - b) / b for a, b in zip(got, one, strict=True)]
        print(f"{name}: max |dloss| / loss vs one process {max(rel):.1e}")
        assert max(rel) <= 2 * U_BF16, (name, rel)


@pytest.mark.slow
def test_dsv4_float32_parts_and_hf_export_of_a_mixed_run(tmp_path):
    """dsv4 under mixed bf16: the mHC computes on float32 parameters and the router's weights come
    out float32 (docs/design.md §5.6). convert_hf.py to-hf of a checkpoint saved under mixed bf16 writes what it writes for a
    float32 run: float32 tensors (config dtype float32), bitwise the master weights, not their
    bf16 compute copies."""
    import importlib.util

    from safetensors.torch import load_file

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dump = tmp_path / "run"
    cfg = load_config(
        [*DSV4, *SMALL, *MIXED, "--training.steps", "1", "--checkpoint.enable", "true"]
        + [
            "--job.dump_folder",
            str(dump),
            "--metrics.enable_tensorboard",
            "false",
            "--metrics.peak_tflops",
            "1",
        ]
        + ["--data.cache_dir", str(tmp_path / "data_cache")]
    )
    trainer = Trainer(resolve_run(cfg))
    seen: dict[str, set] = {"hc_fn": set(), "hc_out": set(), "gate_w": set(), "gate_out": set()}
    try:
        from titan_thd.models.dsv4.mhc import HyperConnection
        from titan_thd.models.dsv4.moe import Gate

        def hc_hook(m, args, out) -> None:
            seen["hc_fn"].add(m.fn.dtype)
            seen["hc_out"].add(out[0].dtype)

        def gate_hook(m, args, out) -> None:
            seen["gate_w"].add(m.weight.dtype)
            seen["gate_out"].add(out[1].dtype)

        for m in trainer.model.modules():
            if isinstance(m, HyperConnection):
                m.register_forward_hook(hc_hook)
            if isinstance(m, Gate):
                m.register_forward_hook(gate_hook)
        trainer.train()
        master = {n: full(p) for n, p in trainer.model.named_parameters()}
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    # mHC: float32 parameters (a unit without casting), its collapse of the bf16 streams bf16; the
    # router: a bf16 gathered weight, its routing weights computed in float32.
    assert seen == {
        "hc_fn": {torch.float32},
        "hc_out": {torch.bfloat16},
        "gate_w": {torch.bfloat16},
        "gate_out": {torch.float32},
    }
    script = Path(__file__).resolve().parents[1] / "scripts" / "convert_hf.py"
    spec = importlib.util.spec_from_file_location("convert_hf", script)
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    out = tmp_path / "hf"
    assert convert.main(["to-hf", str(dump / "checkpoint" / "step-1"), str(out), "--flavor", "micro"]) == 0
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"
    exported = load_file(str(out / "model.safetensors"))
    assert exported and all(v.dtype == torch.float32 for v in exported.values() if v.is_floating_point())
    from titan_thd.models.dsv4 import load_hf

    back, _ = load_hf(out)
    for n, p in back.named_parameters():
        assert torch.equal(p, master[n]), n
