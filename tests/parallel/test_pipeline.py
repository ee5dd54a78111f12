"""Pipeline parallelism: the stage split, its user errors, and the schedule against one process.

The schedule test runs a 4-layer llama in float64 on 3 gloo ranks (a middle stage) over steps whose
microbatch count changes (1 < pp, 2, 5, 3) and whose microbatches are the ones that broke the seeds'
metadata broadcasts: a zero-length document, a padding-only microbatch, one document filling T.
Every stage builds its own BatchMeta; the reference is the unsplit model on one process, run on the
same microbatches. Losses and every stage's gradients must agree to float64 rounding, for our
1F1B and GPipe and for torch's Schedule1F1B (rebuilt per step, on the steps with K >= pp).
"""

import copy

import numpy as np
import pytest
import torch

from tests._dist import spawn
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import load_config
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packer import pack_microbatch
from titan_thd.models.llama import spec as LLAMA
from titan_thd.models.llama.args import LlamaArgs
from titan_thd.models.llama.model import build_llama
from titan_thd.pipeline.schedule import PipelineSchedule, StageInput, max_in_flight, rank_actions, timetable
from titan_thd.pipeline.split import chunk_views, split_model, stage_layers
from titan_thd.startup import resolve_run


# ============================================================================ split and errors
def test_stage_layers_defaults_and_explicit():
    assert stage_layers(4, 3) == [[0, 1], [2], [3]]
    assert stage_layers(43, 8)[0] == [0, 1, 2, 3, 4, 5] and sum(map(len, stage_layers(43, 8))) == 43
    assert stage_layers(6, 2, layers_per_stage=3) == [[0, 1, 2], [3, 4, 5]]
    assert stage_layers(6, 3, explicit="0-2|3,4|5") == [[0, 1, 2], [3, 4], [5]]
    # Interleaved: pp x v stages, stage s on rank s % pp.
    assert stage_layers(6, 2, virtual=2) == [[0, 1], [2, 3], [4], [5]]
    assert stage_layers(8, 2, layers_per_stage=2, virtual=2) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(
        ValueError, match=r"degree = 2 x parallelism.pipeline_parallel_virtual_stages = 3: more stages \(6\)"
    ):
        stage_layers(4, 2, virtual=3)


@pytest.mark.parametrize(
    "args, message",
    [
        ((2, 3), r"pipeline_parallel_degree = 3: more stages \(3\) than the model's 2 layers"),
        ((6, 4, 2), r"layers_per_stage = 2 x 4 stages = 8, but the model has 6 layers"),
        ((4, 2, 0, "0,1|3"), r"misses layer\(s\) \[2\] of 4"),
        ((4, 2, 0, "0-2|2,3"), r"repeats layer\(s\) \[2\]"),
        ((4, 2, 0, "0,1|2-4"), r"layer 4 does not exist \(0..3\)"),
        ((4, 2, 0, "2,3|0,1"), r"layers must run in order"),
        ((4, 3, 0, "0,1|2,3"), r"has 2 stages, pipeline_parallel_degree = 3"),
    ],
)
def test_stage_layers_errors(args, message):
    with pytest.raises(ValueError, match=message):
        stage_layers(*args)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["--parallelism.pipeline_parallel_virtual_stages", "2"],
            r"virtual_stages = 2 with pipeline_parallel_schedule = 1F1B: expected 0 \(auto\), or >= 2 with",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_virtual_stages",
                "1",
            ],
            r"virtual_stages = 1 with pipeline_parallel_schedule = Interleaved1F1B",
        ),
        (
            [
                "--parallelism.pipeline_parallel_schedule",
                "Interleaved1F1B",
                "--parallelism.pipeline_parallel_stage_layers",
                "0|1|2|3",
            ],
            r"has 4 stages, pipeline_parallel_degree = 4 x virtual_stages 2 = 8",
        ),
        (["--parallelism.pipeline_parallel_schedule", "ZBV"], "expected one of 1F1B, GPipe"),
        (
            ["--parallelism.pipeline_parallel_stage_layers", "0,1|2"],
            r"has 2 stages, pipeline_parallel_degree = 4",
        ),
        (["--parallelism.pipeline_parallel_stage_layers", "0,x|2|3|4"], r"stage 0 has 'x'"),
        (["--parallelism.pipeline_parallel_layers_per_stage", "-1"], "expected 0 .* or >= 1"),
        (
            [
                "--parallelism.pipeline_parallel_stage_layers",
                "0|1|2|3",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "1",
            ],
            "both set the stage split",
        ),
    ],
)
def test_config_errors(overrides, message, tmp_path):
    with pytest.raises(ValueError, match=message):  # llama debug: 8 layers
        cfg = load_config(
            ["--parallelism.pipeline_parallel_degree", "4", "--job.dump_folder", str(tmp_path), *overrides]
        )
        resolve_run(cfg, 4)


# ============================================================================ schedule vs one process
T, ARGS = 64, LlamaArgs(dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden_dim=64, vocab_size=128)


class _Sample:
    def __init__(self, ids: np.ndarray, trained: bool = True):
        self.input_ids = ids
        self.target_mask = np.full(len(ids), trained)
        if len(ids):
            self.target_mask[0] = False


def hard_steps() -> list[list]:
    """Microbatch lists of the steps: K = 1, 2, 5, 3 (pp is 3), with the seeds' problem cases."""
    rng = np.random.default_rng(0)

    def doc(n: int) -> _Sample:
        return _Sample(rng.integers(1, ARGS.vocab_size, n))

    full = pack_microbatch([doc(T)], T, 1, 0)  # one document filling T (no padding document)
    empty = pack_microbatch([], T, 1, 0)  # padding only: no trained token, no real token
    zero = pack_microbatch([doc(10), _Sample(np.zeros(0, np.int64)), doc(20)], T, 1, 0)  # a 0-length doc
    assert full.num_docs == 1 and empty.num_real_tokens == 0 and zero.seqlens.tolist() == [10, 0, 20, 34 - 34]
    mixed = [pack_microbatch([doc(n) for n in lens], T, 1, 0) for lens in ([5, 30, 9], [63], [1, 1, 40])]
    return [[zero], [full, empty], [mixed[0], empty, full, zero, mixed[1]], [mixed[2], full, empty]]


def _inputs(mb) -> StageInput:
    meta = BatchMeta.from_batch(mb)
    return StageInput(mb.tokens, meta, mb.labels, mb.loss_mask)


class _Logits(torch.nn.Module):
    """A stage for torch's PipelineStage: tensors in, tensors out, BatchMeta as a keyword."""

    def __init__(self, stage: torch.nn.Module):
        super().__init__()
        self.stage = stage

    def forward(self, x: torch.Tensor, meta: BatchMeta) -> torch.Tensor:
        return self.stage(x, meta).logits


def _torch_1f1b(stage, rank: int, world_size: int, group, mbs: list, n: int) -> float:
    """torch.distributed.pipelining's Schedule1F1B over a STATIC stage, built anew for this K
    (docs/cpu.md §4.3: one schedule object cannot change its microbatch count or shapes)."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    def empty(*shape):
        return torch.empty(shape, dtype=torch.float64, requires_grad=True)

    first, last = rank == 0, rank == world_size - 1
    pipe_stage = PipelineStage(
        _Logits(stage),
        rank,
        world_size,
        torch.device("cpu"),
        input_args=torch.zeros(T, dtype=torch.int64) if first else empty(T, ARGS.dim),
        output_args=empty(T, ARGS.vocab_size) if last else empty(T, ARGS.dim),
        group=group,
    )
    losses: list = []
    sched = Schedule1F1B(
        pipe_stage,
        len(mbs),
        loss_fn=lambda logits, mb: cross_entropy_sum(logits, mb.labels, mb.loss_mask) / n,
        scale_grads=False,
    )
    pipe_stage.has_backward = True  # what step() sets: without it backward is silently skipped
    pipe_stage.clear_runtime_states()
    sched._step_microbatches(
        [(mb.tokens,) if first else () for mb in mbs],
        [{"meta": _inputs(mb).meta} for mb in mbs],
        list(mbs) if last else None,
        losses if last else None,
    )
    return float(sum(loss.detach() for loss in losses)) * n if last else 0.0


def _schedule_vs_reference(rank: int, world_size: int, schedules=("1F1B", "GPipe", "torch Schedule1F1B")):
    """The schedules (torch's Schedule1F1B where K >= pp) on this rank's stages;
    (schedule, losses, worst gradient rel, names) each. Interleaved1F1B: 2 stages per rank."""
    torch.manual_seed(0)
    full = build_llama(ARGS).to(torch.float64)
    steps = hard_steps()
    virtual = 2 if "Interleaved1F1B" in schedules else 1
    layers = stage_layers(ARGS.n_layers, world_size, virtual=virtual)
    stage = split_model(LLAMA.pipeline, copy.deepcopy(full), layers, rank, world_size)
    chunks = chunk_views(LLAMA.pipeline, stage, layers, rank, world_size)
    group = torch.distributed.new_group(list(range(world_size)))
    out = []
    for schedule in schedules:
        pipe = PipelineSchedule(
            chunks,
            rank,
            world_size,
            group,
            schedule.removeprefix("torch Schedule"),
            (T, ARGS.dim),
            torch.float64,
            torch.device("cpu"),
        )
        worst_grad, losses = 0.0, []
        for mbs in steps:
            if schedule.startswith("torch") and len(mbs) < world_size:
                continue  # torch's 1F1B needs K >= pp
            n = max(1, sum(int(mb.loss_mask.sum()) for mb in mbs))
            full.zero_grad()
            ref = torch.zeros((), dtype=torch.float64)
            for mb in mbs:  # the independent reference: one process, the whole model
                ce = cross_entropy_sum(full(mb.tokens, _inputs(mb).meta).logits, mb.labels, mb.loss_mask)
                (ce / n).backward()
                ref += ce.detach()
            stage.zero_grad()
            if schedule.startswith("torch"):
                ce = torch.tensor(_torch_1f1b(stage, rank, world_size, group, mbs, n), dtype=torch.float64)
                torch.distributed.all_reduce(ce, group=group)  # the last stage has the loss
                losses.append((float(ce), float(ref)))
            else:
                ce_sum, aux = pipe.step([_inputs(mb) for mb in mbs], n)
                assert aux == {}
                losses.append((float(ce_sum), float(ref)))
            ref_grads = dict(full.named_parameters())
            for name, p in stage.named_parameters():
                assert p.grad is not None, name
                g = ref_grads[name].grad
                worst_grad = max(
                    worst_grad, float((p.grad - g).abs().max() / g.abs().max().clamp_min(1e-300))
                )
        out.append((schedule, losses, worst_grad, sorted(n for n, _ in stage.named_parameters())))
    return out


@pytest.mark.slow
def test_schedules_match_one_process_with_varying_k_and_hard_microbatches():
    results = spawn(_schedule_vs_reference, 3, timeout=240)
    names = [r[0][3] for r in results]
    assert names[0][0] == "layers.0.attention.wk.weight" and "tok_embeddings.weight" in names[0]
    assert all(n.startswith("layers.2.") for n in names[1])  # the middle stage: one block only
    assert "output.weight" in names[2] and "tok_embeddings.weight" not in names[2]
    assert [len(r[1]) for r in results[0]] == [4, 4, 2]  # torch's 1F1B: the steps with K >= 3
    for rank_results in results:
        for schedule, losses, worst, _ in rank_results:
            for got, ref in losses:
                assert got == pytest.approx(ref, rel=1e-12, abs=1e-300)
            print(f"{schedule}: losses {losses}, worst gradient rel {worst:.1e}")
            assert worst <= 1e-12
    assert all(ref > 0 for r in results[0] for _, ref in r[1])  # not a vacuous comparison


@pytest.mark.slow
def test_interleaved_matches_one_process_with_varying_k_and_hard_microbatches():
    """pp 2 x 2 virtual stages of one layer each: rank 0 runs layers 0 and 2, rank 1 layers 1 and 3;
    K = 1, 2, 5, 3 (odd K: the warm-up grows until the order cannot deadlock)."""
    results = spawn(_schedule_vs_reference, 2, ("Interleaved1F1B",), timeout=240)
    names = [r[0][3] for r in results]
    assert {n.split(".")[1] for n in names[0] if n.startswith("layers.")} == {"0", "2"}
    assert {n.split(".")[1] for n in names[1] if n.startswith("layers.")} == {"1", "3"}
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[1]
    for _, losses, worst, _ in (r[0] for r in results):
        assert len(losses) == 4 and all(ref > 0 for _, ref in losses)
        for got, ref in losses:
            assert got == pytest.approx(ref, rel=1e-12, abs=1e-300)
        assert worst <= 1e-12


def test_timetables_run_every_action_once_in_dependency_order():
    """For every schedule, pp, v and K: each (stage, microbatch) forward and backward runs once, after
    its input was produced in an earlier tick, and every message is received in the tick it is sent."""
    cases = [(s, pp, 1) for s in ("GPipe", "1F1B") for pp in (2, 3, 4, 8)]
    cases += [("Interleaved1F1B", pp, v) for pp in (2, 3, 4, 5) for v in (2, 3)]
    for schedule, pp, v in cases:
        for k in range(1, 13):
            ticks = timetable(schedule, pp, v, k)
            assert len({len(t) for t in ticks}) == 1
            when = {}
            for r, rank_ticks in enumerate(ticks):
                for t, tick in enumerate(rank_ticks):
                    if tick.action is not None:
                        a = tick.action
                        key = (a.backward, a.chunk * pp + r, a.mb)
                        assert key not in when
                        when[key] = t
                    for peer, consumer in tick.sends:  # the receiver posts it in the same tick
                        assert (r, consumer) in ticks[peer][t].recvs
            S = pp * v
            assert len(when) == 2 * S * k, (schedule, pp, v, k)
            for (bwd, s, m), t in when.items():
                if not bwd and s > 0:
                    assert when[(False, s - 1, m)] < t
                if bwd:
                    assert when[(False, s, m)] < t and (s == S - 1 or when[(True, s + 1, m)] < t)


def test_schedule_orders_and_in_flight():
    F = lambda c, m: ("F", c, m)  # noqa: E731
    B = lambda c, m: ("B", c, m)  # noqa: E731
    show = lambda acts: [("B" if a.backward else "F", a.chunk, a.mb) for a in acts]  # noqa: E731
    # 1F1B on the first of 3 ranks: 2 warm-up forwards, then alternating (Megatron's order).
    assert show(rank_actions("1F1B", 3, 1, 0, 4)) == [
        F(0, 0),
        F(0, 1),
        F(0, 2),
        B(0, 0),
        F(0, 3),
        B(0, 1),
        B(0, 2),
        B(0, 3),
    ]
    assert show(rank_actions("GPipe", 2, 1, 1, 2)) == [F(0, 0), F(0, 1), B(0, 0), B(0, 1)]
    # Interleaved, pp 2, v 2, K 2, rank 1: warm-up (v-1) x 2 = 2 forwards: chunk 0 then chunk 1.
    assert show(rank_actions("Interleaved1F1B", 2, 2, 1, 2)) == [
        F(0, 0),
        F(0, 1),
        F(1, 0),
        B(1, 0),
        F(1, 1),
        B(1, 1),
        B(0, 0),
        B(0, 1),
    ]
    assert [max_in_flight("1F1B", 4, 1, r, 16) for r in range(4)] == [4, 3, 2, 1]
    assert [max_in_flight("GPipe", 2, 1, r, 6) for r in range(2)] == [6, 6]
    # Interleaved: more chunk inputs in flight, each 1/v of a stage's layers.
    assert [max_in_flight("Interleaved1F1B", 4, 2, r, 16) for r in range(4)] == [11, 9, 7, 5]
    # The bubble shrinks: ticks per rank (a chunk tick is half a stage tick at v = 2).
    assert len(timetable("Interleaved1F1B", 4, 2, 8)[0]) / 2 < len(timetable("1F1B", 4, 1, 8)[0])


def test_boundary_shape():
    assert LLAMA.pipeline.boundary_shape(ARGS, 16) == (16, 32)
