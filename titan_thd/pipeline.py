"""Pipeline parallelism: a stage split by layer and a small GPipe / 1F1B schedule.

No metadata crosses a stage boundary. Every rank of every stage already holds the step's plan and
its data-parallel replica's K microbatches (the dataloader gives them to all pp ranks alike), runs
the CP partition and builds its own `BatchMeta` per microbatch. What is sent between neighbouring
stages is one fixed-shape tensor per microbatch and direction:

    forward   stage s -> s+1   the residual stream   llama [T_local, d], dsv4 mHC [T_local, hc, d]
    backward  stage s+1 -> s   its gradient          (same shape and dtype)

K (the planner's microbatch count) may change every step and may be smaller than pp: the schedule
is rebuilt from `len(inputs)` on each call, with Megatron's 1F1B order (warm-up of pp - stage - 1
forwards, steady one-forward-one-backward, cool-down) or GPipe (all forwards, then all backwards).

Loss (train.py docstring): the last stage backpropagates (CE sum + its aux sums) / N, every other
stage its own aux sums / N (dsv4's indexer KL) together with the received gradient, N being the
step's global trained-token count from the plan. So gradients are those of the one-process run.

    layers = stage_layers(n_layers, pp, per_stage, explicit)          # ValueError before any group
    model = split_model(spec.name, model, layers, stage, pp)           # deletes the other stages' parts
    pipe = PipelineSchedule(model, stage, pp, pp_group, "1F1B", shape, dtype, device)
    ce_sum, aux_sums = pipe.step(inputs, num_trained)                  # sums over all stages
"""

from __future__ import annotations

import collections
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import parse_stage_layers
from titan_thd.data.batch_meta import BatchMeta

# Top-level modules of each model family that live on the first / the last stage only.
_FIRST = {"llama": ("tok_embeddings",), "dsv4": ("embed",)}
_LAST = {"llama": ("norm", "output"), "dsv4": ("hc_head", "norm", "head", "mtp")}


# ============================================================================ stage split
def stage_layers(n_layers: int, pp: int, layers_per_stage: int = 0, explicit: str = "") -> list[list[int]]:
    """Layer ids of every stage; ValueError (one line, with the numbers) for a split that cannot be."""
    key = "parallelism.pipeline_parallel"
    if explicit:
        stages = parse_stage_layers(explicit)
        flat = [i for s in stages for i in s]
        counts = collections.Counter(flat)
        if len(stages) != pp:
            raise ValueError(f"{key}_stage_layers = {explicit!r} has {len(stages)} stages, pp = {pp}")
        if empty := [i for i, s in enumerate(stages) if not s]:
            raise ValueError(f"{key}_stage_layers = {explicit!r}: stage {empty[0]} has no layers")
        if bad := sorted(i for i in counts if not 0 <= i < n_layers):
            raise ValueError(
                f"{key}_stage_layers = {explicit!r}: layer {bad[0]} does not exist (0..{n_layers - 1})"
            )
        if repeated := sorted(i for i, c in counts.items() if c > 1):
            raise ValueError(f"{key}_stage_layers = {explicit!r} repeats layer(s) {repeated}")
        if missing := sorted(set(range(n_layers)) - set(flat)):
            raise ValueError(f"{key}_stage_layers = {explicit!r} misses layer(s) {missing} of {n_layers}")
        if flat != sorted(flat):
            raise ValueError(f"{key}_stage_layers = {explicit!r}: layers must run in order across stages")
        return stages
    if pp > n_layers:
        raise ValueError(f"{key}_degree = {pp}: more stages than the model's {n_layers} layers")
    if layers_per_stage:
        if layers_per_stage * pp != n_layers:
            raise ValueError(
                f"{key}_layers_per_stage = {layers_per_stage} x pp {pp} = {layers_per_stage * pp}, "
                f"but the model has {n_layers} layers"
            )
        sizes = [layers_per_stage] * pp
    else:  # even, the remainder on the first stages
        sizes = [n_layers // pp + (s < n_layers % pp) for s in range(pp)]
    starts = [sum(sizes[:s]) for s in range(pp)]
    return [list(range(a, a + n)) for a, n in zip(starts, sizes)]


def tied_first_last(model_name: str, model: nn.Module) -> tuple[str, ...]:
    """Modules of the first stage that the last stage also needs: dsv4's MTP reads the embedding."""
    if model_name == "dsv4" and len(model.mtp) and model.args.mtp_loss_weight > 0:
        return ("embed",)
    return ()


def split_model(model_name: str, model: nn.Module, layers: list[list[int]], stage: int) -> nn.Module:
    """This stage's part of a full model, in place: the other stages' layers are deleted (FQNs such
    as `layers.7` stay, so checkpoints reshard across pipeline degrees) and the first / last
    stage's top-level modules are set to None where they do not belong."""
    if model_name not in _FIRST:
        raise ValueError(
            f"model {model_name}: no pipeline stage split is defined (known: {', '.join(_FIRST)})"
        )
    last = len(layers) - 1
    keep = {str(i) for i in layers[stage]}
    tied = tied_first_last(model_name, model)
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage != 0:
        for name in _FIRST[model_name]:
            if not (stage == last and name in tied):
                setattr(model, name, None)
    if stage != last:
        for name in _LAST[model_name]:
            setattr(model, name, None)
    return model


def boundary_shape(model_args: Any, local_tokens: int) -> tuple[int, ...]:
    """Shape of the tensor between two stages: the residual stream (dsv4: its hc_mult mHC copies)."""
    hc = getattr(model_args, "hc_mult", None)
    return (local_tokens, model_args.dim) if hc is None else (local_tokens, hc, model_args.dim)


# ============================================================================ schedule
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
    """One stage's side of the pipeline; `step` runs forward and backward of a step's microbatches."""

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        group: dist.ProcessGroup,
        schedule: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        device: torch.device,
        tied: list[nn.Parameter] | None = None,
        tied_group: dist.ProcessGroup | None = None,
    ):
        assert schedule in ("1F1B", "GPipe"), schedule
        assert 0 <= stage < num_stages and dist.get_world_size(group) == num_stages
        self.module, self.stage, self.num_stages, self.group = module, stage, num_stages, group
        self.schedule, self.shape, self.dtype, self.device = schedule, shape, dtype, device
        self.is_first, self.is_last = stage == 0, stage == num_stages - 1
        self.prev = None if self.is_first else dist.get_global_rank(group, stage - 1)
        self.next = None if self.is_last else dist.get_global_rank(group, stage + 1)
        self.tied = tied or []
        """Parameters held by the first and the last stage (their gradients are summed)."""
        self.tied_group = tied_group
        self._aux_keys: list[str] | None = None
        self._checked_k = False

    # ---------------------------------------------------------------- p2p
    def _p2p(
        self,
        send_next: torch.Tensor | None = None,
        send_prev: torch.Tensor | None = None,
        recv_next: bool = False,
        recv_prev: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Post the sends and receives with both neighbours together and wait (Megatron's pairing of
        send-forward-receive-backward keeps every stage's batch matched, so nothing deadlocks)."""
        ops, from_prev, from_next = [], None, None
        if send_prev is not None and not self.is_first:
            ops.append(dist.P2POp(dist.isend, send_prev.contiguous(), self.prev, self.group))
        if recv_prev and not self.is_first:
            from_prev = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev, self.group))
        if send_next is not None and not self.is_last:
            ops.append(dist.P2POp(dist.isend, send_next.contiguous(), self.next, self.group))
        if recv_next and not self.is_last:
            from_next = torch.empty(self.shape, dtype=self.dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, from_next, self.next, self.group))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if from_prev is not None:
            from_prev.requires_grad_()
        return from_prev, from_next

    # ---------------------------------------------------------------- one microbatch
    def _forward(self, inp: StageInput, x: torch.Tensor | None, num_trained: int, sums: dict) -> tuple:
        x_in = inp.tokens if self.is_first else x
        out = self.module(x_in, inp.meta)
        for k, v in out.aux_losses.items():
            sums[k] = sums.get(k, 0) + v.detach().double()
        aux = sum(out.aux_losses.values(), torch.zeros((), device=self.device))
        if self.is_last:
            ce = cross_entropy_sum(out.logits, inp.labels, inp.loss_mask)
            sums["loss"] = sums.get("loss", 0) + ce.detach().double()
            return x_in, (ce + aux) / num_trained, None
        assert out.logits.shape == self.shape, (out.logits.shape, self.shape)
        return x_in, out.logits, aux / num_trained

    def _backward(self, x_in: torch.Tensor, y: torch.Tensor, aux: torch.Tensor | None, grad_y) -> Any:
        if self.is_last:
            torch.autograd.backward(y)
        else:
            tensors, grads = [y], [grad_y]
            if aux is not None and aux.requires_grad:
                tensors.append(aux)
                grads.append(None)
            torch.autograd.backward(tensors, grads)
        return None if self.is_first else x_in.grad

    # ---------------------------------------------------------------- one step
    def step(
        self, inputs: list[StageInput], num_trained: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Forward and backward of the step's microbatches on this stage; returns the CE sum and the
        aux sums of this rank's rows, each summed over every stage (other dp/cp ranks not added)."""
        k = len(inputs)
        assert k >= 1
        if not self._checked_k:  # every stage must run the same K, or the P2P pattern deadlocks
            ks = torch.tensor([k, -k], dtype=torch.int64, device=self.device)
            dist.all_reduce(ks, op=dist.ReduceOp.MAX, group=self.group)
            assert int(ks[0]) == k == -int(ks[1]), f"pipeline stages disagree on the microbatch count: {k}"
            self._checked_k = True
        warmup = k if self.schedule == "GPipe" else min(self.num_stages - self.stage - 1, k)
        steady = k - warmup
        sums: dict[str, torch.Tensor] = {}
        in_flight: collections.deque = collections.deque()

        def forward(i: int, x: torch.Tensor | None) -> torch.Tensor:
            x_in, y, aux = self._forward(inputs[i], x, num_trained, sums)
            in_flight.append((x_in, y, aux))
            return y

        done = 0

        def backward(grad_y: torch.Tensor | None) -> torch.Tensor | None:
            nonlocal done
            done += 1
            # FSDP reduce-scatters once per step, in the last backward (gradients accumulate
            # unsharded until then), as torch's pipeline schedules do.
            self._gradient_sync(done == k)
            return self._backward(*in_flight.popleft(), grad_y)

        for i in range(warmup):
            x, _ = self._p2p(recv_prev=True)
            y = forward(i, x)
            self._p2p(send_next=None if self.is_last else y.detach())
        x = self._p2p(recv_prev=True)[0] if steady else None
        for j in range(steady):
            y = forward(warmup + j, x)
            _, grad_y = self._p2p(send_next=None if self.is_last else y.detach(), recv_next=True)
            grad_x = backward(grad_y)
            if j == steady - 1:
                self._p2p(send_prev=grad_x)
            else:
                x, _ = self._p2p(send_prev=grad_x, recv_prev=True)
        for _ in range(warmup):
            _, grad_y = self._p2p(recv_next=True)
            self._p2p(send_prev=backward(grad_y))
        assert not in_flight
        self._sync_tied_grads()
        return self._sum_over_stages(sums)

    @torch.no_grad()
    def forward_only(self, inputs: list[StageInput]) -> torch.Tensor:
        """Forward of the microbatches through every stage, no backward (validation): the CE sum of
        this rank's rows (the last stage's), summed over the stages. Microbatch by microbatch:
        receive, forward, send; there is no cycle, so nothing waits on itself."""
        ce = torch.zeros((), dtype=torch.float64, device=self.device)
        for inp in inputs:
            x, _ = self._p2p(recv_prev=True)
            out = self.module(inp.tokens if self.is_first else x, inp.meta)
            if self.is_last:
                ce += cross_entropy_sum(out.logits, inp.labels, inp.loss_mask).double()
            else:
                self._p2p(send_next=out.logits)
        dist.all_reduce(ce, group=self.group)
        return ce

    def _gradient_sync(self, enabled: bool) -> None:
        if isinstance(self.module, FSDPModule):
            self.module.set_requires_gradient_sync(enabled)

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
            keys: list[list[str]] = [[] for _ in range(self.num_stages)]
            dist.all_gather_object(keys, sorted(k for k in sums if k != "loss"), group=self.group)
            self._aux_keys = sorted({k for ks in keys for k in ks})
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        names = ["loss", *self._aux_keys]
        packed = torch.stack([torch.as_tensor(sums.get(n, zero), dtype=torch.float64) for n in names])
        dist.all_reduce(packed, group=self.group)
        return packed[0], {n: packed[i] for i, n in enumerate(names) if i}

    # ---------------------------------------------------------------- gradient norm
    def norm_params(self) -> list[nn.Parameter]:
        """Parameters whose gradients count in the global norm: the last stage's tied copies are
        the first stage's, counted there."""
        skip = {id(p) for p in self.tied} if self.is_last and not self.is_first else set()
        return [p for p in self.module.parameters() if id(p) not in skip]


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


def stage_summary(
    build_meta: Callable[[], nn.Module],
    model_name: str,
    layers: list[list[int]],
    parallel_dims: Any,
    schedule: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    optimizer: str = "adamw",
    matrix_params: Callable[[nn.Module], list[str]] | None = None,
) -> list[str]:
    """One line per stage for the log header: its layers, parameters, estimated memory per rank
    and the boundary tensors its schedule keeps in flight (1F1B: at most pp - stage microbatches,
    GPipe: all K of the step). Each stage is built on the meta device: no memory, any size."""
    from titan_thd.parallel.fsdp import estimate_memory_per_rank  # fsdp imports parallel_dims

    itemsize = torch.empty((), dtype=dtype).element_size()
    boundary = math.prod(shape) * itemsize
    full = build_meta()
    tied = tied_first_last(model_name, full)
    lines = []
    for s, ids in enumerate(layers):
        # A view that shares the full model's modules (same FQNs): one meta build for all stages.
        part = nn.Module()
        part.args = full.args
        part.layers = nn.ModuleDict({str(i): full.layers[str(i)] for i in ids})
        for name in _FIRST[model_name]:
            if s == 0 or (s == len(layers) - 1 and name in tied):
                setattr(part, name, getattr(full, name))
        for name in _LAST[model_name] if s == len(layers) - 1 else ():
            setattr(part, name, getattr(full, name))
        muon = matrix_params(part) if optimizer == "muon" and matrix_params else ()
        mem = estimate_memory_per_rank(part, parallel_dims, optimizer, dtype, muon)
        if schedule == "GPipe":
            flight = f"K x {boundary / 2**20:.2f} MiB"
        else:
            n = len(layers) - s
            flight = f"<= {n} x {boundary / 2**20:.2f} MiB = {n * boundary / 2**20:.2f} MiB"
        lines.append(
            f"pp stage {s}: layers {ids[0]}-{ids[-1]}, {sum(p.numel() for p in part.parameters()):,} parameters; "
            f"{mem}; in-flight microbatch inputs {flight} (boundary {list(shape)}, {schedule})"
        )
    return lines
