"""The memory plan (memory/plan.py, memory/state.py) of a LoRA run whose frozen base stays as released
(`lora.base_dtype = "released"`, models/packed_weight.py), against independent counts:

- the stored bytes per rank equal a count by hand (codes: 1 B per FP8 value, 0.5 B per FP4 value;
  one scale byte per 16 x 16 FP8 block and per 1 x 32 FP4 block) over the local shapes written out
  here for the dsv4 micro flavor under ep 2, tp 2, tp 2 x ep 2 and pp 2, and the `PackedWeight` boxes of
  the model the trainer's own `build` cuts on a fake process group (tp: the plan counts before the
  tp split, as all its figures, an upper bound of the real boxes);
- none of it is in the FSDP-sharded parameters: the master-base plan of the same layout holds
  exactly those values more, in the master dtype, sharded;
- one `PackedWeight.dense` holds at its peak what `Format.dense_bytes` says (live tensors): the larger of its
  byte lookup (an int32 index per code byte and the values) and its scaling (the values, the scale
  grid, expanded where the box ends on a partial block, and the product);
- a real one-process LoRA run on a release-format folder allocates the planned codes and scales,
  and its peak of live tensors over two steps agrees with the plan within 10 %;
- the dry run fills the resident boxes at their stored bytes; the header's lines name every part.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from tests.models.dsv4._release import write_micro_release
from titan_thd.config import load_config
from titan_thd.memory.dry_run import fill_resident
from titan_thd.memory.live import LiveBytes
from titan_thd.memory.plan import plan_memory
from titan_thd.memory.state import local_numel, resident_bytes, size
from titan_thd.models.hf.quant import Format
from titan_thd.models.packed_weight import PackedWeight, packed_weights
from titan_thd.parallel import distributed
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.pipeline.runner import build
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
BLOCK = (16, 16)  # FP8 blocks the tp 2 cuts of the micro flavor fall on
T = 256
LORA = [
    "--model.name", "dsv4", "--model.flavor", "micro", "--optimizer.name", "adamw",
    "--lora.enable", "true", "--lora.rank", "4", "--lora.targets", "attention,shared_expert,experts",
]  # fmt: skip
RELEASED = ["--lora.base_dtype", "released"]
P = "--parallelism."

# dsv4's tensor-parallel cuts (models/dsv4/parallelize.py `_block_plan`), written out: the dimension
# tp splits, by the end of a key; every other resident weight is whole on every tp rank.
TP_DIM = {
    ".attn.wq_b.weight": 0,
    ".attn.wo_a.weight": 0,
    ".attn.wo_b.weight": 1,
    ".ffn.shared_experts.w1.weight": 0,
    ".ffn.shared_experts.w3.weight": 0,
    ".ffn.shared_experts.w2.weight": 1,
    ".ffn.experts.w1": 1,
    ".ffn.experts.w3": 1,
    ".ffn.experts.w2": 2,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_micro_release(tmp_path_factory.mktemp("resident_plan") / "micro", BLOCK)


def _cfg(dump: Path, *extra: str):
    lengths = dump / "lengths.csv"
    dump.mkdir(parents=True, exist_ok=True)
    lengths.write_text(",".join([str(T)] * 8))
    return load_config(
        [
            *LORA,
            "--data.source", "mock", "--data.mock_config", f'{{"mode": "file", "path": "{lengths}"}}',
            "--training.global_batch_size", "2", "--training.tokens_per_microbatch", str(T),
            "--training.steps", "2", "--training.dtype", "float64", "--checkpoint.enable", "false",
            "--metrics.enable_tensorboard", "false", "--job.dump_folder", str(dump / "run"), *extra,
        ]
    )  # fmt: skip


def _by_hand(model, ep: int, tp: int, layers: set[str] | None) -> tuple[int, int, int]:
    """(codes, scales, values) of the release's quantised weights (every frozen 2-D `.weight` but the
    embedding, head and routers: FP8 in 16 x 16 blocks; the routed expert stacks: FP4 in 1 x 32) as
    this rank holds them: 1 / ep of each stack, tp's dimension / tp; `layers`: its pipeline stage's
    blocks ("layers.0", "mtp.0", ...), None for all."""
    codes = scales = values = 0
    for name, p in model.named_parameters():
        if p.requires_grad or (layers is not None and ".".join(name.split(".")[:2]) not in layers):
            continue
        shape = list(p.shape)
        expert = ".ffn.experts.w" in name
        if not expert and (
            len(shape) != 2
            or not name.endswith(".weight")  # mHC's matrices stay float32
            or name in ("embed.weight", "head.weight")
            or name.endswith(".ffn.gate.weight")
        ):
            continue
        if expert:
            shape[0] //= ep
        for end, dim in TP_DIM.items():
            if name.endswith(end):
                shape[dim] //= tp
        values += math.prod(shape)
        if expert:  # two codes a byte, one e8m0 byte per 32 values of a row
            e, rows, cols = shape
            codes, scales = codes + e * rows * cols // 2, scales + e * rows * -(-cols // 32)
        else:
            rows, cols = shape
            codes, scales = codes + rows * cols, scales + -(-rows // 16) * -(-cols // 16)
    return codes, scales, values


def _built_on_fake_world(run, world: int) -> dict[str, PackedWeight]:
    """Rank 0's `PackedWeight`s as the trainer's `build` cuts the meta model on a fake process group."""
    distributed.init_fake(world)
    try:
        run.dims.build_meshes("cpu")
        model = build_on_meta(run.build_model).to(run.precision.master)
        parts = build(model, run, torch.device("cpu"), init=None)
        found = packed_weights(parts.module)
        filled = fill_resident(parts.module, torch.device("cpu"))  # the dry run's step
        assert filled == sum(r.stored_bytes for r in found.values())
        for r in found.values():
            assert r.codes.nbytes + r.scale.nbytes == r.stored_bytes, r
        return found
    finally:
        distributed.destroy()


LAYOUTS = {  # name: (world, args, ep, tp, pipeline stage 0's blocks or None)
    "ep2": (2, [P + "expert_parallel_degree", "2"], 2, 1, None),
    "tp2": (2, [P + "tensor_parallel_degree", "2"], 1, 2, None),
    "tp2-ep2": (4, [P + "tensor_parallel_degree", "2", P + "expert_parallel_degree", "2"], 2, 2, None),
    "pp2": (2, [P + "pipeline_parallel_degree", "2"], 1, 1, {"layers.0", "layers.1"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_stored_bytes_per_rank_match_a_count_by_hand_and_the_built_boxes(folder, tmp_path, layout):
    world, extra, ep, tp, stage0 = LAYOUTS[layout]
    run = resolve_run(_cfg(tmp_path, "--model.hf_path", str(folder), *RELEASED, *extra), world)
    assert run.resident and {f.block for f in run.resident.values()} == {BLOCK, (1, 32)}
    with torch.device("meta"):
        meta = run.build_model()
    plan = plan_memory(run, measure=False).ranks[0].state.resident
    codes, scales, values = _by_hand(meta, ep, tp, stage0)
    built = resident_bytes({k: (r.fmt, r.shape) for k, r in _built_on_fake_world(run, world).items()})
    assert (built.codes, built.scales, built.values) == (codes, scales, values), layout
    if tp == 1:
        assert (plan.codes, plan.scales, plan.values) == (codes, scales, values), layout
    else:  # before the tp split (the plan's convention under tp): the count at tp 1, an upper bound
        assert (plan.codes, plan.scales, plan.values) == _by_hand(meta, ep, 1, stage0), layout
        assert plan.total > built.total
    assert dict(plan.by_kind).keys() == {"fp4", "fp8"} and sum(n for _, n in plan.by_kind) == plan.total


def test_the_resident_base_leaves_the_sharded_parameters_and_nothing_else(folder, tmp_path):
    """ep 2 on 4 ranks (FSDP over 4): the master-base plan holds the resident weights as sharded
    parameters (their FSDP shards in the master dtype); the released plan holds the same adapters,
    grads and optimizer state, and the rest of the base in the master dtype as before."""
    extra = ["--model.hf_path", str(folder), P + "expert_parallel_degree", "2"]
    master = resolve_run(_cfg(tmp_path / "m", *extra), 4)
    released = resolve_run(_cfg(tmp_path / "r", *extra, *RELEASED), 4)
    pm, pr = plan_memory(master, measure=False).ranks[0], plan_memory(released, measure=False).ranks[0]
    with torch.device("meta"):
        meta = released.build_model()
    shares = sum(local_numel(p.shape, 4) for n, p in meta.named_parameters() if n in released.resident)
    assert pm.state.params - pr.state.params == shares
    assert pm.state.param_bytes - pr.state.param_bytes == shares * 8  # float64 masters
    assert (pm.state.grad_bytes, pm.state.optimizer_bytes) == (pr.state.grad_bytes, pr.state.optimizer_bytes)
    assert pm.state.trained_params == pr.state.trained_params
    assert pm.state.resident.values == 0 and pm.transient_bytes == 0 and pr.transient_bytes > 0
    assert pr.state.total_bytes == pr.state.param_bytes + pr.state.grad_bytes + pr.state.optimizer_bytes + (
        pr.state.resident.total
    )
    # The largest FSDP unit leaves the resident weights out (FSDP ignores them)
    assert pr.largest_unit_bytes < pm.largest_unit_bytes
    assert master.resident == {} and pm.gather_bytes == 0


DENSE = {  # (block, shape whole on blocks, shape ending on partial blocks)
    "fp8": ((128, 128), (384, 512), (400, 520)),
    "fp4": ((1, 32), (3, 256, 512), (3, 256, 528)),
}


@pytest.mark.parametrize("kind", ["fp8", "fp4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("edge", ["whole", "partial"])
def test_one_dequantisation_holds_what_the_plan_counts(kind, dtype, edge):
    block, whole, partial = DENSE[kind]
    shape = whole if edge == "whole" else partial
    r = PackedWeight("w", Format(kind, block, 1), shape, tuple(slice(0, n) for n in shape))
    *lead, rows, cols = shape
    r.codes = torch.randint(0, 0x78, (*lead, rows, cols if kind == "fp8" else cols // 2), dtype=torch.uint8)
    r.scale = torch.full((*lead, -(-rows // block[0]), -(-cols // block[1])), 127, dtype=torch.uint8)
    r.dense(dtype, 1 if lead else None)  # FP4's byte table is made once per dtype, then kept
    with LiveBytes([r.codes, r.scale]) as live:
        w = r.dense(dtype, 1 if lead else None)  # one expert of a stack
    assert w.shape == (rows, cols)
    held = live.peak - r.codes.nbytes - r.scale.nbytes
    matrix = rows * cols * dtype.itemsize
    # by hand, the larger of: the int32 index of every code byte with the values it looks up; the
    # values, their product with the scales and the grid in `dtype` (or, a partial edge block, the
    # grid expanded to every row and to whole blocks of columns in its place)
    codes = r.codes[1 if lead else slice(None)].numel()
    grid = -(-rows // block[0]) * -(-cols // block[1]) * dtype.itemsize
    if edge == "partial":
        grid = rows * -(-cols // block[1]) * block[1] * dtype.itemsize
    want = max(4 * codes + matrix, 2 * matrix + grid)
    assert held == want == Format(kind, block, 1).dense_bytes(shape, dtype), (held, want, matrix)


def test_a_one_process_run_allocates_the_plan_and_peaks_where_it_says(folder, tmp_path):
    cfg = _cfg(tmp_path, "--model.hf_path", str(folder), *RELEASED)
    trainer = Trainer(resolve_run(cfg))
    try:
        (plan,) = trainer.memory.ranks
        found = packed_weights(trainer.model)
        allocated = [t for r in found.values() for t in (r.codes, r.scale)]
        assert sum(t.nbytes for t in allocated) == plan.state.resident.total > 0
        assert sum(r.codes.nbytes for r in found.values()) == plan.state.resident.codes
        # One process, no mixed precision: no FSDP, nothing gathered; one float64 matrix dequantised
        # (FP8 on whole 16 x 16 blocks: the index (4 B a value) and the values (8 B) < the values,
        # the product and the grid).
        assert plan.gather_bytes == 0
        largest = max(math.prod(r.shape[-2:]) for r in found.values())
        assert plan.dequant_bytes == (2 * largest + largest // 256) * 8
        with LiveBytes([*trainer.model.parameters(), *trainer.model.buffers(), *allocated]) as live:
            trainer.train()
    finally:
        trainer.close()
    assert plan.activation_bytes > 0.2 * plan.steady_bytes  # the activations are a real part of it
    assert abs(plan.steady_bytes - live.peak) <= 0.10 * live.peak, (
        plan.steady_bytes / 2**20,
        live.peak / 2**20,
    )


def test_the_lines_name_every_part(folder, tmp_path):
    run = resolve_run(
        _cfg(tmp_path, "--model.hf_path", str(folder), *RELEASED, P + "expert_parallel_degree", "2"), 2
    )
    plan = plan_memory(run)
    (r,) = plan.ranks
    st = r.state
    state_line, (activation, parts, startup) = plan.state_line(), plan.stage_lines()
    assert (
        f"base as released {size(st.resident.total)} (codes {size(st.resident.codes)} + scales" in state_line
    )
    assert f"{st.resident.values:,} base values kept as released" in state_line
    assert (
        f"total with the state, the base as released and its transients {size(r.steady_bytes)}" in activation
    )
    base = st.param_bytes * st.frozen_params // st.params
    for part in (
        "pp rank 0 (each of its 2 ranks): ",
        f"base codes {size(st.resident.codes)} + scales {size(st.resident.scales)}",
        f"+ other frozen base {size(base)} + adapters {size(st.param_bytes - base)}",
        f"+ their grads {size(st.grad_bytes)} + their optimizer state {size(st.optimizer_bytes)}",
        f"+ saved activations {size(r.activation_bytes - r.backward_bytes)}",
        f"+ backward transient {size(r.backward_bytes)}",
        f"+ dequantisation {size(r.dequant_bytes)} (of mtp.0.e_proj.weight [128, 128] in float64)",
        f"+ largest FSDP all-gather {size(r.gather_bytes)} = {size(r.steady_bytes)}",
    ):
        assert part in parts, (part, parts)
    assert r.steady_bytes == st.total_bytes + r.activation_bytes + r.dequant_bytes + r.gather_bytes
    assert startup.startswith("start-up peak per rank")
    # The same run on the master base: no parts line, the plan's lines as before.
    master = plan_memory(dataclasses.replace(run, resident={}))
    assert master.parts_lines() == [] and len(master.stage_lines()) == 2
    assert "kept as released" not in master.state_line()
