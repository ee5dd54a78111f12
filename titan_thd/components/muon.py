"""Muon for 2-D weights: Nesterov momentum, then a Newton-Schulz orthogonalised update.

The update rule and hyperparameters are torch.optim.Muon's (torch 2.13): momentum buffer
`m <- m + (1 - mu)(g - m)`, Nesterov update `g + mu (m - g)`, five quintic Newton-Schulz
iterations with coefficients (3.4445, -4.7750, 2.0315) on the update scaled to unit Frobenius norm,
decoupled weight decay, and the `match_rms_adamw` learning-rate scale `0.2 * sqrt(max(rows, cols))`
so that one `optimizer.lr` suits the Muon and the AdamW halves. State: one `momentum_buffer` per
parameter, as in torch's Muon.

Why not torch.optim.Muon itself: on FSDP2 parameters (DTensors sharded over dp x cp) it runs the
Newton-Schulz matmuls as DTensor ops, which redistribute the shards at every iteration and sum in
a layout-dependent order, always in bfloat16, so two layouts of the same run drift apart by ~1e-5
per step. Here each sharded matrix has one owner rank (matrices spread over the ranks by size): its
shards are gathered to the owner, which orthogonalises the whole matrix (the same arithmetic as one
process) and scatters the result's shards back. Each rank thus does 1/n of the Newton-Schulz work
and receives only the matrices it owns, instead of every rank orthogonalising every matrix (for
V4-Flash, ~33k expert matrices of 2048 x 4096: ~1.4e16 FLOPs per rank per step). With
`ns_dtype = float32` every layout matches one process to float32 rounding. Tensor-parallel
shards (docs/design.md §5.1) are orthogonalised as whole matrices too: a colwise / rowwise shard on
the tp mesh goes to an owner over tp, and on the 2-D (fsdp, tp) mesh of FSDP2 over TP the tp shards
are all-gathered first, then the fsdp rows go to an owner over fsdp (the tp ranks of one fsdp
coordinate repeat the owner's work: 1/fsdp of the matrices per rank).

Stacked experts ([E, out, in], models/dsv4/moe.py) are E matrices: one batched Newton-Schulz per
stacked tensor, each expert's matrix scaled by its own norm and iterated alone (the batch only
shares the kernel calls). The experts are independent, so a shard over the expert dimension (ep,
or FSDP on dim 0) needs no communication: a rank orthogonalises the experts it holds. A shard of
the matrices themselves (FSDP over efsdp on dim 1, a TP split) goes to an owner rank of that one
mesh dimension as above, which orthogonalises its slice of experts whole.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def newton_schulz(g_AB: torch.Tensor, steps: int, dtype: torch.dtype, eps: float = 1e-7) -> torch.Tensor:
    """An approximately orthogonal matrix with the singular vectors of `g_AB` (in `dtype`).

    The quintic iteration X <- aX + (bXX^T + c(XX^T)^2)X pushes every singular value of the
    norm-scaled input towards ~1; it runs on the wide orientation so that XX^T is the small Gram.
    A stack [E, A, B] is E independent matrices (batched products, a norm per matrix).
    """
    a, b, c = NS_COEFFICIENTS
    x = g_AB.to(dtype)
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.mT
    if x.dim() == 2:
        x = x / x.norm().clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    else:
        assert x.dim() == 3, x.shape
        x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)
        for _ in range(steps):
            gram = x @ x.mT
            x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x


class Muon(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        lr: float,
        weight_decay: float,
        momentum: float = 0.95,
        ns_steps: int = 5,
        ns_dtype: str = "bfloat16",
        nesterov: bool = True,
    ):
        defaults = {
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "ns_steps": ns_steps,
            "nesterov": nesterov,
        }
        if ns_dtype not in ("bfloat16", "float32", "float64"):
            raise ValueError(f"Muon ns_dtype: got {ns_dtype!r}, expected 'bfloat16', 'float32' or 'float64'")
        # A numerics setting of this run, not a hyperparameter to checkpoint: kept out of the
        # param groups, so checkpoints resume whichever dtype the resuming run chooses.
        self.ns_dtype = getattr(torch, ns_dtype)
        super().__init__(params, defaults)
        for group in self.param_groups:
            bad = [tuple(p.shape) for p in group["params"] if p.ndim not in (2, 3)]
            if bad:
                raise ValueError(
                    f"Muon updates 2-D weights only (or [E, out, in] stacks of them), got parameters of shapes {bad}"
                )

    @torch.no_grad()
    def step(self, closure=None):
        assert closure is None, "Muon does not re-evaluate the loss"
        for group in self.param_groups:
            lr, mu = group["lr"], group["momentum"]
            params = [p for p in group["params"] if p.grad is not None]
            updates = []
            for p in params:
                state = self.state[p]
                if not state:
                    state["momentum_buffer"] = torch.zeros_like(p.grad)
                buf = state["momentum_buffer"]
                buf.lerp_(p.grad, 1 - mu)
                updates.append(p.grad.lerp(buf, mu) if group["nesterov"] else buf)
            orthogonal = orthogonalise(updates, group["ns_steps"], self.ns_dtype)
            for p, update in zip(params, orthogonal):
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(update, alpha=-lr * 0.2 * math.sqrt(max(p.shape[-2:])))


def orthogonalise(updates: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`newton_schulz` of every update, each in its own layout (plain tensor or DTensor)."""
    load: dict[tuple[int, int], int] = defaultdict(int)  # elements owned per (group, rank)

    def owner_of(group: dist.ProcessGroup, numel: int) -> int:
        n = dist.get_world_size(group)
        owner = min(range(n), key=lambda r: (load[id(group), r], r))
        load[id(group), owner] += numel
        return owner

    out = []
    for u in updates:
        if not isinstance(u, DTensor):
            out.append(newton_schulz(u, steps, dtype).to(u.dtype))
            continue
        if u.dim() == 3:
            out.append(_orthogonalise_stack(u, steps, dtype, owner_of))
            continue
        layout = _row_layout(u)
        if layout is None:  # any other layout: every rank orthogonalises the gathered matrix
            full = newton_schulz(u.full_tensor(), steps, dtype).to(u.dtype)
            out.append(distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None))
            continue
        group, rows_r, transposed, tp = layout
        local = u.to_local()
        if tp is not None:  # gather the tensor-parallel shards first: whole rows (or columns)
            local = tp.gather(local)
        piece = local.mT if transposed else local
        ortho = _newton_schulz_at_owner(piece, rows_r, group, owner_of(group, u.numel()), steps, dtype)
        ortho = ortho.mT if transposed else ortho
        if tp is not None:
            ortho = tp.split(ortho)
        out.append(DTensor.from_local(ortho, u.device_mesh, u.placements, shape=u.shape, stride=u.stride()))
    return out


def _orthogonalise_stack(u: DTensor, steps: int, dtype: torch.dtype, owner_of) -> DTensor:
    """`newton_schulz` of a sharded [E, A, B] stack. Mesh dimensions that split the experts (dim 0)
    need nothing; one that splits the matrices (dim 1 or 2) sends its shards to an owner rank; any
    other layout is gathered whole on every rank."""
    split = [(i, p.dim) for i, p in enumerate(u.placements) if isinstance(p, Shard) and p.dim != 0]
    local = u.to_local()
    if not split:  # whole matrices of this rank's experts
        ortho = newton_schulz(local, steps, dtype).to(u.dtype)
    elif len(split) == 1 and not isinstance(u.placements[split[0][0]], _StridedShard):
        (i, dim), mesh = split[0], u.device_mesh
        n, group = mesh.size(i), mesh.get_group(i)
        rows = torch.arange(u.shape[dim], device=local.device)  # indexes the gathered update
        transposed = dim == 2
        piece = local.mT if transposed else local
        rows_r = [_chunk(rows, n, r) for r in range(n)]
        # Ranks of `group` share every other coordinate, so they hold the same experts' rows.
        ortho = _newton_schulz_at_owner(piece, rows_r, group, owner_of(group, local.numel()), steps, dtype)
        ortho = ortho.mT if transposed else ortho
    else:
        full = newton_schulz(u.full_tensor(), steps, dtype).to(u.dtype)
        return distribute_tensor(full, u.device_mesh, u.placements, src_data_rank=None)
    return DTensor.from_local(
        ortho.contiguous(), u.device_mesh, u.placements, shape=u.shape, stride=u.stride()
    )


def _chunk(idx: torch.Tensor, n: int, r: int) -> torch.Tensor:
    """Rank r's part of `idx` as Shard / FSDP2 split it (torch.chunk: the last parts short or empty)."""
    parts = idx.chunk(n)
    return parts[r] if r < len(parts) else idx[:0]


class _TPGather:
    """All-gather of the tensor-parallel shards of an update (a `Shard(dim)` on the tp mesh dim)."""

    def __init__(self, group: dist.ProcessGroup, dim: int, sizes: list[int]):
        self.group, self.dim, self.sizes = group, dim, sizes
        self.me = dist.get_rank(group)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        assert local.shape[self.dim] == self.sizes[self.me], (local.shape, self.sizes, self.me)
        big = max(self.sizes)
        pad = [0, 0] * (local.ndim - 1 - self.dim) + [0, big - local.shape[self.dim]]
        padded = torch.nn.functional.pad(local, pad).contiguous()
        parts = [torch.empty_like(padded) for _ in self.sizes]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([p.narrow(self.dim, 0, n) for p, n in zip(parts, self.sizes)], dim=self.dim)

    def split(self, full: torch.Tensor) -> torch.Tensor:
        return full.split(self.sizes, dim=self.dim)[self.me].contiguous()


def _row_layout(u: DTensor):
    """(group, rows of each group rank, transposed, tp gather or None) of the layouts Muon
    orthogonalises at one owner rank, or None:
    - 1-D `Shard(0)` (FSDP2, or a colwise TP shard) and `Shard(1)` (a rowwise TP shard, transposed);
    - 2-D (fsdp, tp) of FSDP2 over TP: the tp shards are all-gathered, then the fsdp rows go to an
      owner: dim 0 on fsdp is FSDP2's `Shard(0)` / `_StridedShard(0)` of the tp-local rows.
    Row sets are numbered as torch.chunk splits them (the same arithmetic as FSDP2 and Shard)."""
    mesh, (A, B) = u.device_mesh, u.shape
    if mesh.ndim == 1 and u.placements in ((Shard(0),), (Shard(1),)):
        transposed = u.placements == (Shard(1),)
        n, rows = mesh.size(), torch.arange(B if transposed else A, device=u.device)  # indexes the update
        return mesh.get_group(), [_chunk(rows, n, r) for r in range(n)], transposed, None
    if mesh.ndim != 2 or not isinstance(u.placements[0], Shard | _StridedShard) or u.placements[0].dim != 0:
        return None
    tp_placement = u.placements[1]
    if tp_placement not in (Shard(0), Shard(1)):
        return None
    n_f, n_t = mesh.size(0), mesh.size(1)
    t = mesh.get_local_rank(1)
    fsdp_group, tp_group = mesh.get_group(0), mesh.get_group(1)
    rows = torch.arange(A, device=u.device)  # indexes the gathered update
    if tp_placement == Shard(1):  # FSDP rows of the full rows; the columns split over tp
        cols_t = [len(_chunk(torch.arange(B, device="cpu"), n_t, s)) for s in range(n_t)]  # lengths only
        f_rows = [_chunk(rows, n_f, f) for f in range(n_f)]
        return fsdp_group, f_rows, False, _TPGather(tp_group, 1, cols_t)
    # Colwise: tp rank s holds rows chunk_s(A); FSDP2 gives fsdp rank f chunk_f of those.
    f_rows = [torch.cat([_chunk(_chunk(rows, n_t, s), n_f, f) for s in range(n_t)]) for f in range(n_f)]
    me_f = mesh.get_local_rank(0)
    sizes = [len(_chunk(_chunk(rows, n_t, s), n_f, me_f)) for s in range(n_t)]
    assert sum(sizes) == len(f_rows[me_f]) and sizes[t] == u.to_local().shape[0], (sizes, u.to_local().shape)
    return fsdp_group, f_rows, False, _TPGather(tp_group, 0, sizes)


def _newton_schulz_at_owner(
    piece: torch.Tensor,
    rows_r: list[torch.Tensor],
    group: dist.ProcessGroup,
    owner: int,
    steps: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Rank r of `group` holds rows `rows_r[r]` of a matrix (`piece`): gather them to `owner`,
    orthogonalise the whole matrix there, scatter each rank's rows of the result back.

    Gather and scatter want equal pieces, so every piece travels padded to the longest. A stack
    [E, rows, B] is E matrices cut alike (the rows are dim -2)."""
    n, me = dist.get_world_size(group), dist.get_rank(group)
    assert piece.shape[-2] == len(rows_r[me]), (piece.shape, len(rows_r[me]), me)
    big = max(len(r) for r in rows_r)
    *batch, _, cols = piece.shape
    padded = piece.new_zeros(*batch, big, cols)
    padded[..., : piece.shape[-2], :] = piece
    root = dist.get_global_rank(group, owner)
    pieces = [torch.empty_like(padded) for _ in range(n)] if me == owner else None
    dist.gather(padded, pieces, dst=root, group=group)
    if me == owner:
        full = padded.new_empty(*batch, sum(len(r) for r in rows_r), cols)
        for p, rows in zip(pieces, rows_r):
            full[..., rows, :] = p[..., : len(rows), :]
        ortho = newton_schulz(full, steps, dtype).to(padded.dtype)
        pieces = [
            torch.cat([ortho[..., rows, :], ortho.new_zeros(*batch, big - len(rows), cols)], dim=-2)
            for rows in rows_r
        ]
    dist.scatter(padded, pieces, src=root, group=group)
    return padded[..., : piece.shape[-2], :]
