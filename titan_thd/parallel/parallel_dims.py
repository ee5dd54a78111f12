"""ParallelDims: the parallel degrees of a run and the named device meshes built from them.

One world mesh, axes outermost first: ``("pp", "dp_replicate", "dp_shard", "cp", "tp")``; dp is
dp_replicate x dp_shard (the data-parallel ranks: each reads its own share of the batch). Code
never indexes a mesh by position; it asks for a *named* mesh, and every name has exactly one
purpose (under HSDP, dp_replicate > 1, `fsdp` is the 2-D (replicate, shard) mesh: parameters
sharded over dp_shard x cp, gradients all-reduced across the replicas; `efsdp` likewise):

| name    | spans   | purpose                                                                 |
|---------|---------|-------------------------------------------------------------------------|
| `batch` | dp      | data loading: which share of the global batch this rank reads          |
| `loss`  | dp x cp | loss and trained-token-count reduction (every rank that holds tokens)   |
| `fsdp`  | dp x cp | parameter sharding (FSDP2); CP ranks hold the same weights, so they shard too |
| `cp`    | cp      | context parallelism: ranks that split one microbatch's tokens           |
| `tp`    | tp      | tensor parallelism: ranks that split heads / columns of one microbatch   |
| `pp`    | pp      | pipeline stages: ranks with the same (dp, cp, tp) coordinate, one per stage |
| `ep`    | ep      | expert parallelism: consecutive dp_shard x cp ranks that split the routed experts |
| `efsdp` | dp x cp / ep | FSDP of the routed experts: the ranks holding the same experts (one per ep group) |
| `ep_tp` | ep x tp | TP x EP: the routed experts' mesh, whole experts over ep, hidden columns over tp |

`ep` and `efsdp` split the dp_shard x cp ranks of one replica (flattened, cp fastest) into a
(efsdp, ep) grid: ep groups are runs of `ep` consecutive dp_shard x cp ranks, efsdp groups take
one rank of each run. Routed experts are sharded over `efsdp` only (each expert lives on one rank
of every ep group); every other parameter over `fsdp`. Both exist only when ep > 1.

Tensor with expert parallelism (docs/design.md §5.4): the routed experts stay split on their
hidden columns over tp (expert tensor parallelism = tp) and whole experts over ep, a 2-D
`ep_tp` mesh (ep outer, tp inner); an ep group holds one tp coordinate, so every tp rank
dispatches the (identical) rows of its MoE region to the ep peers of its own tp coordinate.

`loss` and `fsdp` span the same ranks and share one process group; they keep separate names
because they answer different questions (the fsdp mesh is 2-D under HSDP, the loss mesh never).
Under pipeline parallelism every stage is a dp x cp x tp grid of its own: `loss`, `fsdp`, `cp`
and `batch` are the meshes of this rank's stage (pp is the outermost axis).

A world of one process without a process group builds no mesh: `get_optional_mesh` returns
None and `mesh_rank` / `mesh_size` answer 0 / 1, so single-process training starts instantly.
Mixed precision (FSDP2's casting) needs a mesh even there: the trainer then starts a process group
of one and every named mesh exists, each of one rank (`get_mesh`; `get_optional_mesh` stays None).

    dims = ParallelDims.from_config(cfg.parallelism, world_size)   # validates, no process group
    dims.build_meshes("cpu")
    fsdp_mesh = dims.get_optional_mesh("fsdp")                     # None when nothing to shard
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from titan_thd.config import Parallelism

MESH_AXES = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
"""Axes of the world mesh, outermost (slowest-varying rank index) first."""

MESH_SPANS: dict[str, tuple[str, ...]] = {
    "batch": ("dp_replicate", "dp_shard"),
    "loss": ("dp_replicate", "dp_shard", "cp"),
    "fsdp": ("dp_replicate", "dp_shard", "cp"),
    "cp": ("cp",),
    "tp": ("tp",),
    "pp": ("pp",),
    "ep": ("dp_shard", "cp"),
    "efsdp": ("dp_replicate", "dp_shard", "cp"),
    "ep_tp": ("dp_shard", "cp", "tp"),
}
"""Named mesh -> the world-mesh axes it spans (see the table in the module docstring)."""
EP_TP_DIMS = ("expert_ep", "expert_tp")
"""Dimension names of the `ep_tp` mesh (a mesh's names are unique in its root: not "ep" / "tp")."""


@dataclass
class ParallelDims:
    pp: int
    dp_shard: int
    """Data-parallel (FSDP) degree; -1 = the processes left after pp, cp and tp."""
    cp: int
    tp: int
    world_size: int
    ep: int = 1
    """Expert-parallel degree: carved out of dp_shard x cp (consecutive ranks), no extra processes."""
    dp_replicate: int = 1
    """HSDP replicas: data-parallel ranks that hold the same parameter shards (gradients all-reduced)."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        degrees = {"pp": self.pp, "cp": self.cp, "tp": self.tp, "dp_replicate": self.dp_replicate}
        for name, value in degrees.items():
            if value < 1:
                raise ValueError(f"parallel degree {name} = {value}: expected >= 1")
        if self.world_size < 1:
            raise ValueError(f"world size = {self.world_size}: expected >= 1")
        others = self.pp * self.dp_replicate * self.cp * self.tp
        rep = f" × dp_replicate {self.dp_replicate}" if self.dp_replicate > 1 else ""
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ValueError(
                    f"pp {self.pp}{rep} × cp {self.cp} × tp {self.tp} = {others} does not divide world size "
                    f"{self.world_size} (data_parallel_shard_degree = -1 takes the processes left over); "
                    f"{self._nearest_fits()}"
                )
            self.dp_shard = self.world_size // others
        elif self.dp_shard < 1:
            raise ValueError(f"parallel degree dp_shard = {self.dp_shard}: expected -1 or >= 1")
        product = others * self.dp_shard
        if product != self.world_size:
            raise ValueError(
                f"parallel degrees multiply to {product} (pp {self.pp}{rep} × dp_shard {self.dp_shard} × cp "
                f"{self.cp} × tp {self.tp}) but the world has {self.world_size} processes; set "
                f"parallelism.data_parallel_shard_degree = -1 to give data parallelism the rest"
            )
        if self.ep < 1:
            raise ValueError(f"parallel degree ep = {self.ep}: expected >= 1")
        if (self.dp_shard * self.cp) % self.ep:
            shard = self.dp_shard * self.cp
            ok = [d for d in range(1, shard + 1) if shard % d == 0]
            raise ValueError(
                f"parallelism.expert_parallel_degree = {self.ep} does not divide dp_shard {self.dp_shard} × cp "
                f"{self.cp} = {shard} (the experts are split over the data- and context-parallel ranks of one "
                f"replica); the nearest valid degrees are {_nearest(self.ep, ok)} "
                f"(valid: {', '.join(map(str, ok))})"
            )

    def _nearest_fits(self) -> str:
        """For each degree > 1 of pp, dp_replicate, cp, tp: the nearest values that make the product
        of the four divide the world (the others unchanged)."""
        degrees = {"pp": self.pp, "dp_replicate": self.dp_replicate, "cp": self.cp, "tp": self.tp}
        parts = []
        for name, value in degrees.items():
            if value == 1:
                continue
            rest = math.prod(degrees.values()) // value
            room = self.world_size // rest if self.world_size % rest == 0 else 0
            valid = [d for d in range(1, room + 1) if room % d == 0] if room else []
            if valid:
                parts.append(f"{name} {_nearest(value, valid)}")
        return "nearest valid degrees: " + (", ".join(parts) if parts else "none with the others unchanged")

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        return cls(
            pp=cfg.pipeline_parallel_degree,
            dp_shard=cfg.data_parallel_shard_degree,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            world_size=world_size,
            ep=cfg.expert_parallel_degree,
            dp_replicate=cfg.data_parallel_replicate_degree,
        )

    # ------------------------------------------------------------------ degrees
    @property
    def dp(self) -> int:
        """Data-parallel ranks (replicas x shards): the planner's dp, each reads its own share."""
        return self.dp_replicate * self.dp_shard

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

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
        """Ranks that shard one copy of the parameters (dp_shard x cp; replicas hold copies)."""
        return self.dp_shard * self.cp

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def efsdp_degree(self) -> int:
        """Ranks that FSDP-shard one set of routed experts (dp_shard × cp / ep, in one replica)."""
        return self.dp_shard * self.cp // self.ep

    @property
    def loss_degree(self) -> int:
        """Ranks whose token counts and loss sums add up to the global ones (dp × cp)."""
        return self.dp * self.cp

    def mesh_size(self, name: str) -> int:
        """Degree of a named mesh, known before (and without) building meshes."""
        if name in ("ep", "efsdp", "ep_tp"):
            return {
                "ep": self.ep,
                "efsdp": self.dp_replicate * self.efsdp_degree,
                "ep_tp": self.ep * self.tp,
            }[name]
        degrees = {"pp": self.pp, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard}
        degrees |= {"cp": self.cp, "tp": self.tp}
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
        shape = (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp)
        world = init_device_mesh(device_type, shape, mesh_dim_names=MESH_AXES)
        dp_cp = world["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
        batch = world["dp_replicate", "dp_shard"]._flatten("dp") if self.hsdp_enabled else world["dp_shard"]
        # HSDP: FSDP2 replicates over dim 0 and shards over dim 1 of a 2-D mesh.
        shape_r = (self.dp_replicate, self.fsdp_degree)
        fsdp = dp_cp._unflatten(0, shape_r, ("replicate", "shard")) if self.hsdp_enabled else dp_cp
        self._meshes = {"batch": batch, "loss": dp_cp, "fsdp": fsdp}
        self._meshes |= {name: world[name] for name in ("cp", "tp", "pp")}
        if self.ep > 1:
            # efsdp outer, ep inner: an ep group is a run of consecutive dp_shard x cp ranks.
            sizes = (self.dp_replicate, self.efsdp_degree, self.ep)
            grid = dp_cp._unflatten(0, sizes, ("e_replicate", "efsdp", "ep"))
            efsdp = grid["e_replicate", "efsdp"] if self.hsdp_enabled else grid["efsdp"]
            self._meshes |= {"ep": grid["ep"], "efsdp": efsdp}
        if self.ep > 1 and self.tp > 1:  # the same ep groups, each with its tp peers
            sizes = (self.dp_replicate, self.efsdp_degree, self.ep, self.tp)
            names = ("expert_replicate", "expert_efsdp", *EP_TP_DIMS)
            full = (
                world["dp_replicate", "dp_shard", "cp", "tp"]._flatten("dp_cp_tp")._unflatten(0, sizes, names)
            )
            self._meshes["ep_tp"] = full[EP_TP_DIMS]
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


def _nearest(degree: int, valid: list[int]) -> str:
    below = [d for d in valid if d < degree]
    above = [d for d in valid if d > degree]
    return " or ".join(str(d) for d in (below[-1:] + above[:1]))


def _spans(name: str) -> tuple[str, ...]:
    if name not in MESH_SPANS:
        raise ValueError(f"unknown mesh name {name!r}; known names: {', '.join(MESH_SPANS)}")
    return MESH_SPANS[name]
