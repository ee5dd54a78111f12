"""The memory plan (titan_thd/memory/plan.py) of a toy model whose every figure is counted by hand:
sharded state, stage copy, activations in flight, backward transient, start-up peak and largest
FSDP unit per pipeline rank; the host sum over the ranks a host holds; the refusal's message under
pipeline parallelism."""

import dataclasses
import functools
import tempfile

import torch
from torch import nn

from titan_thd.components.precision import Precision
from titan_thd.config import ActivationCheckpoint, load_config
from titan_thd.memory import activations
from titan_thd.memory.host import host_refusal
from titan_thd.memory.plan import plan_memory
from titan_thd.memory.state import size
from titan_thd.models.spec import ModelOutput, ModelSpec, ParallelSpec, PipelineSpec
from titan_thd.parallel import seeded_init
from titan_thd.parallel.parallel_dims import ParallelDims
from titan_thd.pipeline.split import stage_layers
from titan_thd.run import Run
from titan_thd.startup import resolve_run

T, D, V, N = 64, 16, 32, 4
F32 = torch.float32
EMBED, LAYER, HEAD = V * D, D * D + D, D * V + V  # parameters: embedding, Linear(D, D), Linear(D, V)


class _Toy(nn.Module):
    """embed -> N x (Linear, ReLU) -> head."""

    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(D, D), nn.ReLU()) for i in range(N)})
        self.head = nn.Linear(D, V)

    def forward(self, tokens, meta):
        h = self.embed(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return ModelOutput(self.head(h), {})


@dataclasses.dataclass
class _ToyArgs:
    vocab_size: int = V


SPEC = ModelSpec(
    "toy_plan",
    {},
    build=_Toy,
    flops_per_step=lambda a, d: 0.0,
    parallel=ParallelSpec("zigzag"),
    pipeline=PipelineSpec(first=("embed",), last=("head",), boundary_shape=lambda args, t: (t, D)),
)


@functools.cache
def _base_run() -> Run:
    return resolve_run(load_config(["--job.dump_folder", tempfile.gettempdir()]), 1)


def _plan(dims, stages, optimizer="adamw", matrix=lambda m: [], schedule="1F1B", precision=None, hf=False):
    """The plan of the toy model on `dims`: a resolved run with the toy's spec (Muon's parameters:
    `matrix`), args, layout and dtypes; one microbatch of T tokens per context-parallel rank, the
    default activation checkpointing, not a dry run (measured whole); `hf`: model.hf_path is read."""
    run = _base_run()
    c = run.cfg
    cfg = dataclasses.replace(
        c,
        training=dataclasses.replace(c.training, tokens_per_microbatch=T * dims.cp),
        optimizer=dataclasses.replace(c.optimizer, name=optimizer),
        parallelism=dataclasses.replace(c.parallelism, pipeline_parallel_schedule=schedule),
        model=dataclasses.replace(c.model, hf_path="hf_folder" if hf else ""),
        activation_checkpoint=ActivationCheckpoint(),
    )
    toy = dataclasses.replace(
        run,
        cfg=cfg,
        spec=dataclasses.replace(SPEC, matrix_params=matrix),
        model_args=_ToyArgs(),
        dims=dims,
        stages=stages,
        precision=precision or Precision(F32, F32, F32),
    )
    assert not toy.fake and toy.tokens_per_rank == T
    return plan_memory(toy)


PP2_DP2 = ParallelDims(pp=2, dp_shard=2, cp=1, tp=1, world_size=4)


def test_a_checkpoint_load_adds_one_tensor_slice_read_and_dequantised():
    """model.hf_path: each rank reads one tensor's slice at a time (its raw bytes, at most float32, and
    the float32 copy): the largest FSDP shard of one tensor, twice, in float32."""
    plain, loads = _plan(PP2_DP2, stage_layers(N, 2)), _plan(PP2_DP2, stage_layers(N, 2), hf=True)
    for r, without, largest in zip(
        loads.ranks, plain.ranks, (V * D, D * V), strict=True
    ):  # embedding, head weight
        assert r.startup_bytes - without.startup_bytes == 2 * 4 * (largest // 2)


def test_every_pipeline_rank_counted_by_hand():
    plan = _plan(PP2_DP2, stage_layers(N, 2))
    r0, r1 = plan.ranks
    # Stage 0: the embedding and layers 0-1; stage 1: layers 2-3 and the head. Every dim 0 is even:
    # each of the 2 FSDP ranks holds half; AdamW: weights, grads and two states in float32.
    stage = [EMBED + 2 * LAYER, 2 * LAYER + HEAD]
    assert (r0.layers, r1.layers) == ("0-1", "2-3") and [r0.params, r1.params] == stage
    for r, n in zip(plan.ranks, stage, strict=True):
        assert r.state.params == n // 2
        assert r.state_bytes == n // 2 * 4 * (1 + 1 + 2)
        assert r.stage_copy_bytes == n * (4 + 4)  # gathered copy (compute) + unsharded grads (reduce)
        # Its own shards, built on the meta device, then filled one init block at a time (no full copy).
        largest = max(V * D, D * D)  # the embedding / head weight: one init block holds it whole
        assert (
            r.startup_bytes
            == n // 2 * 4 + min(seeded_init.BLOCK_BYTES, largest * 4)
            == n // 2 * 4 + largest * 4
        )
    # Largest all-gather: the root's embedding on stage 0 (larger than a block), the head on stage 1.
    assert (r0.largest_unit_bytes, r1.largest_unit_bytes) == (EMBED * 4, HEAD * 4)

    # Activations: layer 0 saves the embedding output and its ReLU output, the later layers their
    # ReLU output, the embedding its int64 indices; 1F1B keeps 2 microbatches on rank 0, 1 on rank 1,
    # and the last stage's backward holds the gradients of the log-softmax and of the logits.
    row = T * D * 4
    after = activations.measure(SPEC, _ToyArgs(), T, F32).after
    assert (r0.in_flight, r1.in_flight) == (2, 1)
    assert (r0.saved_bytes, r1.saved_bytes) == (T * 8 + 3 * row, 2 * row + after)
    assert (r0.backward_bytes, r1.backward_bytes) == (0, 2 * T * V * 4)
    assert r0.activation_bytes == 2 * (T * 8 + 3 * row)
    assert r1.total_bytes == max(r1.startup_bytes, r1.state.total_bytes + 2 * row + after + 2 * T * V * 4)
    assert plan.boundary == (T, D) and plan.boundary_bytes == T * D * 4


def test_one_stage_without_fsdp_and_muon():
    """pp 1 on one rank, pure float32: no FSDP (the whole model is one 'unit'), no stage copy; Muon
    keeps one state for the matrices it updates, AdamW's two for the rest."""
    one = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    matrices = [f"layers.{i}.0.weight" for i in range(N)]
    (r,) = _plan(one, None, "muon", lambda m: matrices).ranks
    total = EMBED + N * LAYER + HEAD
    assert (r.layers, r.params, r.in_flight, r.stage_copy_bytes) == (f"0-{N - 1}", total, 1, 0)
    assert r.state.optimizer_bytes == ((total - N * D * D) * 2 + N * D * D) * 4
    assert r.largest_unit_bytes == total * 4
    assert r.startup_bytes == total * 4 + V * D * 4  # + one init block: the largest tensor, whole


def test_mixed_precision_gathers_units_in_the_compute_dtype():
    plan = _plan(PP2_DP2, stage_layers(N, 2), precision=Precision(F32, torch.bfloat16, F32))
    assert [r.largest_unit_bytes for r in plan.ranks] == [EMBED * 2, HEAD * 2]
    assert plan.ranks[0].stage_copy_bytes == (EMBED + 2 * LAYER) * (2 + 4)


def test_host_sums_the_ranks_it_holds():
    """pp is the outermost mesh axis: of 4 ranks (pp 2 x dp 2), ranks 0-1 are pipeline rank 0 and
    ranks 2-3 pipeline rank 1. 2 ranks per host: the fuller host's; 4: both pipeline ranks."""
    plan = _plan(PP2_DP2, stage_layers(N, 2))
    t0, t1 = (r.total_bytes for r in plan.ranks)
    assert plan.per_rank_total == max(t0, t1)
    assert plan.host_ranks(4) == [(0, 2), (1, 2)] and plan.host_bytes(4) == 2 * t0 + 2 * t1
    assert plan.host_bytes(2) == 2 * max(t0, t1)


def test_refusal_under_pipeline_parallelism_names_the_numbers():
    plan = _plan(PP2_DP2, stage_layers(N, 2))
    need = plan.host_bytes(4)
    message = host_refusal(plan, 4, need - 1, 1024, 1, "none")
    t0, t1 = (size(r.total_bytes) for r in plan.ranks)
    for part in (
        f"memory: 4 rank(s) on this host: 2 x {t0}",
        f"(pp rank 0) + 2 x {t1}",
        "(pp rank 1) estimated per rank (the header's pp rank lines",
        f") = {size(need)}, more than the {size(need - 1)}",
        "--activation_checkpoint.mode full",
    ):
        assert part in message, (part, message)
    assert host_refusal(plan, 4, need, 1024, 1, "none") == ""


def test_header_lines_come_from_the_plan():
    plan = _plan(PP2_DP2, stage_layers(N, 2))
    lines = plan.stage_lines()
    assert [line.split(":")[0] for line in lines[:2]] == ["pp rank 0", "pp rank 1"]
    assert f"{plan.ranks[0].state}" in lines[0] and "in-flight microbatch inputs <= 2 x" in lines[0]
    assert f"total {size(plan.ranks[1].steady_bytes)}" in lines[1]
    assert lines[2].startswith(f"start-up peak per rank {size(plan.ranks[1].startup_bytes)}")
    assert plan.state_line() == str(plan.ranks[0].state)


def test_gpipe_in_flight_is_known_per_step_only():
    (r0, _) = _plan(PP2_DP2, stage_layers(N, 2), schedule="GPipe").ranks
    assert r0.in_flight is None and r0.activation_bytes == r0.saved_bytes  # one counted: a lower bound
