"""ParallelDims: the parallel degrees of a run and the named device meshes built from them.

One world mesh, axes outermost first: ``("pp", "dp", "cp", "tp")``. Code never indexes a mesh by
position; it asks for a *named* mesh, and every name has exactly one purpose:

| name    | spans   | purpose                                                                 |
|---------|---------|-------------------------------------------------------------------------|
| `batch` | dp      | data loading: which share of the global batch this rank reads          |
| `loss`  | dp x cp | loss and trained-token-count reduction (every rank that holds tokens)   |
| `fsdp`  | dp x cp | parameter sharding (FSDP2); CP ranks hold the same weights, so they shard too |
| `cp`    | cp      | context parallelism: ranks that split one microbatch's tokens           |
| `tp`    | tp      | tensor parallelism: ranks that split heads / columns of one microbatch   |
| `pp`    | pp      | pipeline stages: ranks with the same (dp, cp, tp) coordinate, one per stage |
| `ep`    | ep      | expert parallelism: consecutive dp x cp ranks that split the routed experts |
| `efsdp` | dp x cp / ep | FSDP of the routed experts: the ranks holding the same experts (one per ep group) |

`ep` and `efsdp` split the dp x cp ranks (flattened, cp fastest) into a (efsdp, ep) grid: ep
groups are runs of `ep` consecutive dp x cp ranks, efsdp groups take one rank of each run. Routed
experts are sharded over `efsdp` only (each expert lives on one rank of every ep group); every
other parameter over `fsdp`. Both exist only when ep > 1.

`loss` and `fsdp` span the same ranks and share one process group; they keep separate names
because they answer different questions (and would differ with replicated data parallelism).
Under pipeline parallelism every stage is a dp x cp x tp grid of its own: `loss`, `fsdp`, `cp`
and `batch` are the meshes of this rank's stage (pp is the outermost axis).

A world of one process without a process group builds no mesh: `get_optional_mesh` returns
None and `mesh_rank` / `mesh_size` answer 0 / 1, so single-process training starts instantly.
Mixed precision (FSDP2's casting) needs a mesh even there: the trainer then starts a process group
of one and every named mesh exists, each of one rank (`get_mesh`; `get_optional_mesh` stays None).

    dims = ParallelDims.from_config(cfg.parallelism, world_size)   # validates, no process group
    dims.check_implemented()
    dims.build_meshes("cpu")
    fsdp_mesh = dims.get_optional_mesh("fsdp")                     # None when nothing to shard
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

if TYPE_CHECKING:  # annotations only: config imports parallel.context_parallel
    from titan_thd.config import Parallelism

MESH_AXES = ("pp", "dp", "cp", "tp")
"""Axes of the world mesh, outermost (slowest-varying rank index) first."""

MESH_SPANS: dict[str, tuple[str, ...]] = {
    "batch": ("dp",),
    "loss": ("dp", "cp"),
    "fsdp": ("dp", "cp"),
    "cp": ("cp",),
    "tp": ("tp",),
    "pp": ("pp",),
    "ep": ("dp", "cp"),
    "efsdp": ("dp", "cp"),
}
"""Named mesh -> the world-mesh axes it spans (see the table in the module docstring)."""


@dataclass
class ParallelDims:
    pp: int
    dp_shard: int
    """Data-parallel (FSDP) degree; -1 = the processes left after pp, cp and tp."""
    cp: int
    tp: int
    world_size: int
    ep: int = 1
    """Expert-parallel degree: carved out of dp x cp (consecutive ranks), no extra processes."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        degrees = {"pp": self.pp, "cp": self.cp, "tp": self.tp}
        for name, value in degrees.items():
            if value < 1:
                raise ValueError(f"parallel degree {name} = {value}: expected >= 1")
        if self.world_size < 1:
            raise ValueError(f"world size = {self.world_size}: expected >= 1")
        others = self.pp * self.cp * self.tp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"pp {self.pp} × cp {self.cp} × tp {self.tp} = {others} does not divide world size "
                    f"{self.world_size} (data_parallel_shard_degree = -1 takes the processes left over)"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"parallel degree dp_shard = {self.dp_shard}: expected -1 or >= 1")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {product} (pp {self.pp} × dp_shard {self.dp_shard} × cp {self.cp} "
                f"× tp {self.tp}) but the world has {self.world_size} processes; set "
                f"parallelism.data_parallel_shard_degree = -1 to give data parallelism the rest"
            )
        if self.ep < 1:
            raise ValueError(f"parallel degree ep = {self.ep}: expected >= 1")
        if (self.dp * self.cp) % self.ep:
            raise ValueError(
                f"parallelism.expert_parallel_degree = {self.ep} does not divide dp {self.dp} × cp {self.cp} "
                f"= {self.dp * self.cp} (the experts are split over data- and context-parallel ranks)"
            )

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        return cls(
            pp=cfg.pipeline_parallel_degree,
            dp_shard=cfg.data_parallel_shard_degree,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            world_size=world_size,
            ep=cfg.expert_parallel_degree,
        )

    def check_implemented(self) -> None:
        """Layouts the trainer cannot run yet: tensor with pipeline parallelism (the stage boundary
        would carry sequence-parallel rows), tensor with expert parallelism."""
        if self.tp > 1 and self.pp > 1:
            raise ValueError(
                f"parallelism.tensor_parallel_degree = {self.tp} with pipeline_parallel_degree = {self.pp}: "
                "tensor and pipeline parallelism together are not implemented yet; set one of them to 1"
            )
        if self.ep > 1 and self.tp > 1:
            raise ValueError(
                f"parallelism.expert_parallel_degree = {self.ep} with tensor_parallel_degree = {self.tp}: "
                "tensor parallelism splits every expert's hidden columns, expert parallelism places whole "
                "experts; together they are not implemented yet (set one of them to 1)"
            )

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        return self.dp_shard

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def fsdp_degree(self) -> int:
        return self.dp * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.fsdp_degree > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp_degree(self) -> int:
        """Ranks that FSDP-shard one set of routed experts (dp × cp / ep)."""
        return self.dp * self.cp // self.ep

    @property
    def loss_degree(self) -> int:
        """Ranks whose token counts and loss sums add up to the global ones (dp × cp)."""
        return self.dp * self.cp

    def mesh_size(self, name: str) -> int:
        """Degree of a named mesh, known before (and without) building meshes."""
        if name in ("ep", "efsdp"):
            return self.ep if name == "ep" else self.efsdp_degree
        degrees = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "tp": self.tp}
        return math.prod(degrees[axis] for axis in _spans(name))

    # ------------------------------------------------------------------ meshes
    def build_meshes(self, device_type: str) -> None:
        """Build the world mesh and the named meshes (a no-op for a world of one process without a
        process group)."""
        if self.world_size == 1 and not dist.is_initialized():
            return
        if not dist.is_initialized() or dist.get_world_size() != self.world_size:
            got = dist.get_world_size() if dist.is_initialized() else "no process group"
            raise ValueError(
                f"build_meshes: ParallelDims has world size {self.world_size}, the process group {got}"
            )
        world = init_device_mesh(device_type, (self.pp, self.dp, self.cp, self.tp), mesh_dim_names=MESH_AXES)
        dp_cp = world["dp", "cp"]._flatten("dp_cp")
        self._meshes = {
            name: dp_cp if axes == ("dp", "cp") else world[axes[0]]
            for name, axes in MESH_SPANS.items()
            if name not in ("ep", "efsdp")
        }
        if self.ep > 1:
            # efsdp outer, ep inner: an ep group is a run of consecutive dp x cp ranks.
            grid = dp_cp._unflatten(0, (self.efsdp_degree, self.ep), ("efsdp", "ep"))
            self._meshes |= {"ep": grid["ep"], "efsdp": grid["efsdp"]}
        for name in self._meshes:
            assert self._meshes[name].size() == self.mesh_size(name), (name, self._meshes[name], self)

    def get_mesh(self, name: str) -> DeviceMesh:
        """The named mesh (any size); raises when meshes were not built (world of one process)."""
        _spans(name)
        if name not in self._meshes:
            raise RuntimeError(
                f"mesh {name!r} does not exist: world size {self.world_size}, build_meshes called: "
                f"{bool(self._meshes)}; use get_optional_mesh for code that also runs on one process"
            )
        return self._meshes[name]

    def get_optional_mesh(self, name: str) -> DeviceMesh | None:
        """The named mesh, or None when it has one rank (nothing to communicate over)."""
        _spans(name)
        if self.mesh_size(name) == 1:
            return None
        return self.get_mesh(name)

    def mesh_rank(self, name: str) -> int:
        """This rank's index inside the named mesh (0 when the mesh has one rank)."""
        mesh = self.get_optional_mesh(name)
        return 0 if mesh is None else mesh.get_local_rank()


def _spans(name: str) -> tuple[str, ...]:
    if name not in MESH_SPANS:
        raise ValueError(f"unknown mesh name {name!r}; known names: {', '.join(MESH_SPANS)}")
    return MESH_SPANS[name]
