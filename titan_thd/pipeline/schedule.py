"""The pipeline schedule: GPipe, 1F1B and Interleaved1F1B as one timetable, run tick by tick.

Each rank's order of work is a list of actions F(chunk, mb) / B(chunk, mb) (`rank_actions`):

    GPipe            all forwards, then all backwards
    1F1B             pp - rank - 1 warm-up forwards, then one forward / one backward, cool-down
    Interleaved1F1B  microbatches in groups of pp; within a group forwards run chunk 0 .. v-1 and
                     backwards chunk v-1 .. 0; warm-up (v - 1) x group + 2 (pp - rank - 1)

`timetable` plays these orders on a global clock, identically on every rank (it depends only on
the schedule, pp, v and K): in each tick a rank runs its next action if that action's input was
produced in an earlier tick, and every tensor produced in a tick is sent in that tick's
communication phase, where the receiver posts the matching receive. So every rank knows, before
the step starts, exactly which sends and receives each tick posts; both sides of every message
post it in the same tick and `batch_isend_irecv` of one tick never waits for a later one, which
is deadlock-free on gloo and NCCL alike. Any K >= 1 works (K < pp only costs bubble); the timetable
is built for each step's K.

Loss (train.py docstring): the last stage backpropagates (CE sum + its aux sums) / N, every other
stage its own aux sums / N (dsv4's indexer KL) together with the received gradient, N being the
step's global trained-token count from the plan. So gradients are those of the one-process run.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, get_args

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_thd.components.loss import cross_entropy_sum, loss_context
from titan_thd.config.choices import Schedule
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.parallel.tensor_parallel import reduce_replicated_grads

SCHEDULES: tuple[str, ...] = get_args(Schedule)


# ============================================================================ timetable
@dataclass(frozen=True, order=True)
class Action:
    backward: bool
    chunk: int
    """This rank's model chunk; global stage = chunk x pp + rank."""
    mb: int


def rank_actions(
    schedule: str, pp: int, virtual: int, rank: int, k: int, extra_warmup: int = 0
) -> list[Action]:
    """This rank's order of forwards and backwards for a step of `k` microbatches."""
    assert schedule in SCHEDULES and k >= 1 and (virtual == 1) == (schedule != "Interleaved1F1B")
    groups = [range(a, min(a + pp, k)) for a in range(0, k, pp)]
    fwd = [Action(False, c, m) for g in groups for c in range(virtual) for m in g]
    bwd = [Action(True, c, m) for g in groups for c in reversed(range(virtual)) for m in g]
    if schedule == "GPipe":
        warmup = len(fwd)
    elif schedule == "1F1B":
        warmup = min(pp - rank - 1, k)
    else:  # the last chunk of the first microbatch must be in before the first backward
        warmup = min((virtual - 1) * len(groups[0]) + 2 * (pp - rank - 1) + extra_warmup, len(fwd))
    order = fwd[:warmup]
    for f, b in zip(fwd[warmup:], bwd):
        order += [f, b]
    return order + bwd[len(fwd) - warmup :]


@dataclass
class Tick:
    action: Action | None = None
    sends: list[tuple[int, Action]] = field(default_factory=list)
    """(peer rank, the action that consumes the tensor) of what this rank sends in this tick."""
    recvs: list[tuple[int, Action]] = field(default_factory=list)


@functools.lru_cache(maxsize=64)
def timetable(schedule: str, pp: int, virtual: int, k: int) -> tuple[tuple[Tick, ...], ...]:
    """Every rank's ticks (the same length for all).

    Interleaved1F1B with K not a multiple of pp (the trainer's planner avoids it): the group orders
    above can deadlock on the last, smaller group; then every rank warms up by one more forward,
    until they do not (all forwards first, GPipe's order, never deadlocks)."""
    for extra in range(k * virtual + 1):
        orders = [rank_actions(schedule, pp, virtual, r, k, extra) for r in range(pp)]
        ticks = _play(orders, pp, virtual)
        if ticks is not None:
            return ticks
    raise AssertionError(f"{schedule} pp {pp} v {virtual} K {k}: no deadlock-free warm-up")


def _play(orders: list[list[Action]], pp: int, virtual: int) -> tuple[tuple[Tick, ...], ...] | None:
    """The ticks of `orders` on the global clock, or None if they deadlock."""
    n_stages = pp * virtual
    stage = lambda r, a: a.chunk * pp + r  # noqa: E731
    done: dict[tuple[bool, int, int], int] = {}  # (backward, global stage, mb) -> tick
    pos, ticks, t = [0] * pp, [[] for _ in range(pp)], 0

    def ready(r: int, a: Action) -> bool:
        s = stage(r, a)
        if not a.backward:
            return s == 0 or done.get((False, s - 1, a.mb), t) < t
        if s == n_stages - 1:
            return done.get((False, s, a.mb), t) < t
        return done.get((True, s + 1, a.mb), t) < t and done.get((False, s, a.mb), t) < t

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        now = [Tick() for _ in range(pp)]
        for r in range(pp):
            if pos[r] < len(orders[r]) and ready(r, a := orders[r][pos[r]]):
                now[r].action, pos[r] = a, pos[r] + 1
                done[(a.backward, stage(r, a), a.mb)] = t
        for r, tick in enumerate(now):
            a = tick.action
            if a is None:
                continue
            s = stage(r, a)
            target = s - 1 if a.backward else s + 1  # the stage that consumes the output
            if 0 <= target < n_stages:
                peer = target % pp
                consumer = Action(a.backward, target // pp, a.mb)
                tick.sends.append((peer, consumer))
                now[peer].recvs.append((r, consumer))
        if not any(tick.action for tick in now):
            return None
        for r in range(pp):
            ticks[r].append(now[r])
        t += 1
    return tuple(tuple(rank_ticks) for rank_ticks in ticks)


def max_in_flight(schedule: str, pp: int, virtual: int, rank: int, k: int) -> int:
    """Most (chunk, microbatch) forwards of `rank` whose backward has not run yet, at any time."""
    live = worst = 0
    for tick in timetable(schedule, pp, virtual, k)[rank]:
        if tick.action is not None:
            live += -1 if tick.action.backward else 1
            worst = max(worst, live)
    return worst


# ============================================================================ execution
@dataclass
class StageInput:
    """What one rank needs of one microbatch, built locally (no stage sends it to another)."""

    tokens: torch.Tensor
    """[T_local] token ids of this rank's rows (the first stage embeds them)."""
    meta: BatchMeta
    labels: torch.Tensor
    """[T_local] labels (the last stage's cross-entropy)."""
    loss_mask: torch.Tensor | None


class PipelineSchedule:
    """One pipeline rank's side of the pipeline: `step` runs forward and backward of a step's
    microbatches through this rank's chunks (one per stage it holds: chunk c is stage c x pp + rank)."""

    def __init__(
        self,
        chunks: list[nn.Module],
        rank: int,
        pp: int,
        group: dist.ProcessGroup,
        schedule: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        tied: list[nn.Parameter] | None = None,
        tied_group: dist.ProcessGroup | None = None,
        tensor_parallel: bool = False,
        loss_chunk: int = 0,
    ):
        assert schedule in SCHEDULES, schedule
        assert 0 <= rank < pp and dist.get_world_size(group) == pp
        self.chunks, self.rank, self.num_stages, self.group = chunks, rank, pp * len(chunks), group
        self.pp, self.virtual = pp, len(chunks)
        self.schedule, self.shape, self.dtype, self.device = schedule, shape, dtype, device
        self.is_first, self.is_last = rank == 0, rank == pp - 1
        self.tied = tied or []
        """Parameters held by the first and the last stage (their gradients are summed)."""
        self.tied_group = tied_group
        self.tensor_parallel = tensor_parallel
        """Vocabulary-parallel logits on the last stage: its loss runs under `loss_context`."""
        self.loss_kwargs = {"loss_chunk": loss_chunk} if loss_chunk else {}
        """loss.chunked: the loss's rows per chunk, passed to every stage's model (none: full logits)."""
        self._aux_keys: list[str] | None = None
        self._checked_k = False

    # ---------------------------------------------------------------- p2p
    def _communicate(
        self, sends: list[tuple[int, Action, torch.Tensor]], recvs: list[tuple[int, Action]]
    ) -> list[torch.Tensor]:
        """Post one tick's sends and receives ((pp rank, consuming action)) together and wait."""
        ops, received = [], []
        for peer, _, tensor in sends:
            to = dist.get_global_rank(self.group, peer)
            ops.append(dist.P2POp(dist.isend, tensor.contiguous(), to, self.group))
        for peer, _ in recvs:
            buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, dist.get_global_rank(self.group, peer), self.group))
            received.append(buf)
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return received

    # ---------------------------------------------------------------- one microbatch
    def _stage(self, chunk: int) -> int:
        return chunk * self.pp + self.rank

    def _forward(self, chunk: int, inp: StageInput, x: torch.Tensor | None, num_trained: int, sums: dict):
        first, last = self._stage(chunk) == 0, self._stage(chunk) == self.num_stages - 1
        x_in = inp.tokens if first else x.requires_grad_()
        with loss_context(self.tensor_parallel and last):  # vocabulary-parallel logits
            out = self.chunks[chunk](x_in, inp.meta, **self.loss_kwargs)
            ce = cross_entropy_sum(out.logits, inp.labels, inp.loss_mask) if last else None
        for k, v in out.aux_losses.items():
            sums[k] = sums.get(k, 0) + v.detach().double()
        aux = sum(out.aux_losses.values(), torch.zeros((), device=self.device))
        if last:
            sums["loss"] = sums.get("loss", 0) + ce.detach().double()
            return x_in, (ce + aux) / num_trained, None
        # The compute dtype (bf16 under mixed precision): what the receiving stage allocated.
        assert out.logits.shape == self.shape and out.logits.dtype == self.dtype, (
            out.logits.shape,
            out.logits.dtype,
            self.shape,
            self.dtype,
        )
        return x_in, out.logits, aux / num_trained

    def _backward(self, chunk: int, saved: tuple, grad_y: torch.Tensor | None) -> torch.Tensor | None:
        x_in, y, aux = saved
        if self._stage(chunk) == self.num_stages - 1:  # y is the loss
            with loss_context(self.tensor_parallel):
                torch.autograd.backward(y)
        else:
            tensors, grads = [y], [grad_y]
            if aux is not None and aux.requires_grad:
                tensors.append(aux)
                grads.append(None)
            torch.autograd.backward(tensors, grads)
        return None if self._stage(chunk) == 0 else x_in.grad

    # ---------------------------------------------------------------- one step
    def step(
        self, inputs: list[StageInput], num_trained: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of the step's microbatches on this rank's stages; returns the CE sum
        and the aux sums of this rank's rows, each summed over every stage (other dp/cp ranks not
        added)."""
        inputs = list(inputs)  # each microbatch's metadata is read by several ticks: build it once
        k = len(inputs)
        assert k >= 1
        if not self._checked_k:  # every stage must run the same K, or the P2P pattern deadlocks
            ks = torch.tensor([k, -k], dtype=torch.int64, device=self.device)
            dist.all_reduce(ks, op=dist.ReduceOp.MAX, group=self.group)
            assert int(ks[0]) == k == -int(ks[1]), f"pipeline stages disagree on the microbatch count: {k}"
            self._checked_k = True
        sums: dict[str, torch.Tensor] = {}
        inbox: dict[Action, torch.Tensor] = {}  # received activations / gradients, by consumer
        saved: dict[tuple[int, int], tuple] = {}  # (chunk, mb) -> what its backward needs
        backwards_left = [k] * self.virtual
        for tick in timetable(self.schedule, self.pp, self.virtual, k)[self.rank]:
            out: torch.Tensor | None = None
            if (a := tick.action) is not None:
                if not a.backward:
                    x_in, y, aux = self._forward(a.chunk, inputs[a.mb], inbox.pop(a, None), num_trained, sums)
                    saved[(a.chunk, a.mb)] = (x_in, y, aux)
                    out = y.detach()
                else:
                    backwards_left[a.chunk] -= 1
                    # FSDP reduce-scatters once per step and chunk, in its last backward
                    # (gradients accumulate unsharded until then), as torch's schedules do.
                    self._gradient_sync(a.chunk, backwards_left[a.chunk] == 0)
                    out = self._backward(a.chunk, saved.pop((a.chunk, a.mb)), inbox.pop(a, None))
            assert len(tick.sends) <= 1 and (not tick.sends or out is not None)
            got = self._communicate([(peer, consumer, out) for peer, consumer in tick.sends], tick.recvs)
            inbox.update({consumer: buf for (_, consumer), buf in zip(tick.recvs, got)})
        assert not saved and not inbox, (saved.keys(), inbox.keys())
        for chunk in self.chunks:  # TP: parameters used on each rank's rows / heads (dsv4)
            reduce_replicated_grads(chunk)
        self._sync_tied_grads()
        return self._sum_over_stages(sums)

    @torch.no_grad()
    def forward_only(self, inputs: list[StageInput]) -> torch.Tensor:
        """Forward of the microbatches through every stage, no backward (validation): the CE sum of
        this rank's rows, summed over the stages. Microbatch by microbatch and stage by stage, the
        same order on every rank: receive, forward, send; a chain, so nothing waits on itself."""
        ce = torch.zeros((), dtype=torch.float64, device=self.device)
        for inp in inputs:
            for chunk in range(self.virtual):
                s = self._stage(chunk)
                x = None
                if s > 0:
                    (x,) = self._communicate([], [((s - 1) % self.pp, Action(False, chunk, 0))])
                last = s == self.num_stages - 1
                with loss_context(self.tensor_parallel and last):
                    out = self.chunks[chunk](inp.tokens if s == 0 else x, inp.meta, **self.loss_kwargs)
                    if last:
                        ce += cross_entropy_sum(out.logits, inp.labels, inp.loss_mask).double()
                if not last:
                    self._communicate([((s + 1) % self.pp, Action(False, chunk, 0), out.logits)], [])
        dist.all_reduce(ce, group=self.group)
        return ce

    def _gradient_sync(self, chunk: int, enabled: bool) -> None:
        if isinstance(self.chunks[chunk], FSDPModule):
            self.chunks[chunk].set_requires_gradient_sync(enabled)

    def _sync_tied_grads(self) -> None:
        """The first and the last stage each hold a copy of the tied weights; each copy's gradient
        becomes the sum of both, so the two identical optimizer updates keep them equal."""
        if self.tied_group is None:
            return
        for p in self.tied:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            dist.all_reduce(g, group=self.tied_group)

    def _sum_over_stages(self, sums: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if self._aux_keys is None:  # each stage has some aux terms (dsv4: indexer on all, mtp on the last)
            keys: list[list[str]] = [[] for _ in range(self.pp)]
            dist.all_gather_object(keys, sorted(k for k in sums if k != "loss"), group=self.group)
            self._aux_keys = sorted({k for ks in keys for k in ks})
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        names = ["loss", *self._aux_keys]
        packed = torch.stack(
            [torch.as_tensor(sums.get(n, zero), dtype=torch.float64, device=self.device) for n in names]
        )
        dist.all_reduce(packed, group=self.group)
        return packed[0], {n: packed[i] for i, n in enumerate(names) if i}

    # ---------------------------------------------------------------- gradient norm
    @property
    def pp_group(self) -> dist.ProcessGroup:
        """The other stages, whose squared gradient norms add to this rank's."""
        return self.group

    @property
    def also_scale(self) -> list[nn.Parameter]:
        """The last stage's copies of tied weights: clipped like the first stage's, counted there."""
        return [] if self.is_first else list(self.tied)

    def norm_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients count in the global norm (each once): the last stage's tied
        copies are the first stage's, counted there."""
        skip = {id(p) for p in self.tied} if self.is_last and not self.is_first else set()
        seen, params = set(), []
        for chunk in self.chunks:
            for p in chunk.parameters():
                if id(p) not in skip and id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params


def tied_groups(parallel_dims: Any) -> dist.ProcessGroup | None:
    """The {first stage, last stage} group of this rank's (dp, cp, tp) coordinate, or None.

    Every rank must call this (new_group is collective over the world)."""
    pp_mesh = parallel_dims.get_mesh("pp")
    if parallel_dims.pp == 2:
        return pp_mesh.get_group()
    world = pp_mesh._get_root_mesh().mesh  # [pp, dp, cp, tp] global ranks
    mine = None
    for coord in world.reshape(parallel_dims.pp, -1).T.tolist():
        group = dist.new_group([coord[0], coord[-1]])
        if dist.get_rank() in (coord[0], coord[-1]):
            mine = group
    return mine
