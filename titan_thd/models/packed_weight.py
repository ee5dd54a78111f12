"""A frozen base weight kept as released (`lora.base_dtype = "released"`, docs/lora.md): FP8 blocks and
packed FP4 experts stay codes + scales in memory and are dequantised per use (models/hf/quant.py).

Legend:  O out-features   I in-features   E routed experts (this rank's)   N routed rows   G groups

What changes for one frozen base weight W of a release-format folder (models/dsv4/hf_dequant.py):

    FP8 e4m3 (attention, shared expert, ...)   codes uint8 [O, I]   + scale grid [O / bm, I / bn] (128 x 128)
    packed FP4 e2m1 (routed experts)           codes int8 [E, O, I / 2] + e8m0 scale [E, O, I / 32] (1 x 32)

    plan = packed_plan(sources, frozen)   # start-up: {our key: Format}, from the folder's headers
    mark(model, plan)                     # meta model: these parameters stay out of FSDP
    swap(model, plan)                     # after parallelize, still meta: each becomes a `PackedWeight`
    load_packed(model, sources, folder)   # this rank's codes and the scale blocks that cover them

A `PackedWeight` takes the parameter's place as a plain attribute of its module (not a parameter, not
a buffer: never drawn by the seeded init, never cast, moved or gathered; nothing trains it) and holds
this rank's box of the global weight, the box its TP / EP placement gave it: a box must start and end
on scale blocks (`check_box`, the refusal names the tensor, the block and the degrees that serve it).
FSDP / HSDP / CP replicate it (the frozen base needs no gradient reduction; gathering it every step
would move the whole base per step), pipeline stages hold their layers' boxes.

Per use, `base_linear` / `base_grouped` / `base_groups` dequantise into the activations' dtype (exact:
an e4m3 or e2m1 value times a power of two is a bfloat16) inside an autograd function that saves
nothing of W and dequantises again in the backward: the transient is one weight (FP8) or one expert
(FP4). A family reaches them through its projections (models/projection.py), never directly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_thd.models.hf.io import SafetensorsFolder, Source
from titan_thd.models.hf.quant import Format
from titan_thd.ops.grouped_linear import grouped_linear
from titan_thd.parallel.shards import UNSHARDED, canonical_name, local_box
from titan_thd.parallel.tensor_parallel import local


class PackedWeight:
    """This rank's box of a frozen base weight as released: codes and the scale blocks covering them.

    `shape` is the local shape of the weight it stands for ([O, I] or [E, O, I]); `codes` / `scale`
    stay None on the meta device (a dry run) until `load_packed` reads them."""

    def __init__(self, key: str, fmt: Format, shape: tuple[int, ...], box: tuple[slice, ...]):
        self.key, self.fmt, self.shape, self.box = key, fmt, tuple(shape), box
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"PackedWeight({self.key}, {self.fmt.kind}, local {list(self.shape)})"

    @property
    def stored_bytes(self) -> int:
        return self.fmt.stored_bytes(self.shape)

    def dense(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """W (or expert `expert` of a stack) in `dtype`: codes times the scale of their block."""
        assert self.codes is not None, f"{self.key}: the packed base was not loaded"
        codes = self.codes if expert is None else self.codes[expert]
        scale = self.scale if expert is None else self.scale[expert]
        return self.fmt.dequantize(codes, scale, dtype)


def check_box(key: str, fmt: Format, shape: tuple[int, ...], box: tuple[slice, ...], where: str) -> None:
    """ValueError unless this rank's box starts and ends on `fmt`'s scale blocks (or the tensor's end)."""
    for dim, (n, s, b) in enumerate(zip(shape[-2:], box[-2:], fmt.block, strict=True)):
        if s.start % b == 0 and (s.stop % b == 0 or s.stop == n):
            continue
        cut = s.stop - s.start
        degrees = [d for d in range(1, n + 1) if n % d == 0 and (n // d) % b == 0] or [1]
        raise ValueError(
            f"lora.base_dtype = 'released': {key} {list(shape)} is cut at {'rows' if dim == 0 else 'columns'} "
            f"[{s.start}, {s.stop}) of {n} ({cut} per rank, {where}), not on its {fmt.kind} scale blocks of "
            f"{fmt.block[0]} x {fmt.block[1]}; degrees that cut this dimension on whole blocks: "
            f"{degrees[:8]} (or lora.base_dtype = 'master')"
        )


class _Linear(torch.autograd.Function):
    """x W^T with W dequantised per use, in the forward and again in the backward (never saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        ctx.w = w
        return F.linear(x, w.dense(x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy @ ctx.w.dense(dy.dtype), None


class _Grouped(torch.autograd.Function):
    """Rows grouped by expert (`counts`) times each expert's W_e^T, one expert dequantised at a time."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, counts: list[int], w: PackedWeight) -> torch.Tensor:
        ctx.w, ctx.counts = w, counts
        out = x_NI.new_empty(x_NI.shape[0], w.shape[-2])
        begin = 0
        for e, n in enumerate(counts):
            if n:
                torch.mm(x_NI[begin : begin + n], w.dense(x_NI.dtype, e).t(), out=out[begin : begin + n])
            begin += n
        return out

    @staticmethod
    def backward(ctx, dy_NO: torch.Tensor):
        w, dx = ctx.w, dy_NO.new_empty(dy_NO.shape[0], ctx.w.shape[-1])
        begin = 0
        for e, n in enumerate(ctx.counts):
            if n:
                torch.mm(dy_NO[begin : begin + n], w.dense(dy_NO.dtype, e), out=dx[begin : begin + n])
            begin += n
        return dx, None, None


class _Groups(torch.autograd.Function):
    """Block-diagonal x_TGI -> [T, G, O]: group g times W_g^T, W viewed [G, O, I] (dsv4's wo_a)."""

    @staticmethod
    def forward(ctx, x_TGI: torch.Tensor, w: PackedWeight) -> torch.Tensor:
        ctx.w = w
        w_GOI = w.dense(x_TGI.dtype).view(x_TGI.shape[1], -1, x_TGI.shape[2])
        # einsum returns a view of its product; the caller adds the adapter's update in place
        return torch.einsum("tgi,goi->tgo", x_TGI, w_GOI).contiguous().clone()

    @staticmethod
    def backward(ctx, dy_TGO: torch.Tensor):
        w_GOI = ctx.w.dense(dy_TGO.dtype).view(dy_TGO.shape[1], dy_TGO.shape[2], -1)
        return torch.einsum("tgo,goi->tgi", dy_TGO, w_GOI), None


def base_groups(x_TGI: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """Group g of x times W_g^T, W [G * O, I] viewed [G, O, I] (a parameter's local shard or a `PackedWeight`)."""
    if isinstance(w, PackedWeight):
        return _Groups.apply(x_TGI, w)
    return torch.einsum("tgi,goi->tgo", x_TGI, local(w).view(x_TGI.shape[1], -1, x_TGI.shape[2]))


def local_weight(w: torch.Tensor | PackedWeight) -> torch.Tensor | PackedWeight:
    """This rank's part of a base weight: a parameter's local shard (`local`), or its `PackedWeight`."""
    return w if isinstance(w, PackedWeight) else local(w)


def base_linear(x: torch.Tensor, w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """x W^T for a base weight: this rank's shard (`local`) of a parameter, or a `PackedWeight`."""
    if isinstance(w, PackedWeight):
        return _Linear.apply(x, w)
    return F.linear(x, local(w))


def base_grouped(x_NI: torch.Tensor, counts: list[int], w: torch.Tensor | PackedWeight) -> torch.Tensor:
    """`grouped_linear` (ops/grouped_linear.py) for a stacked base weight or its `PackedWeight`."""
    if isinstance(w, PackedWeight):
        return _Grouped.apply(x_NI, counts, w)
    return grouped_linear(x_NI, counts, local(w))


# The start-up steps of a packed base, in order.


def packed_plan(sources: Mapping[str, Source], frozen: set[str]) -> dict[str, Format]:
    """{key: Format} of the frozen weights a folder stores block-quantised (the rest load as today)."""
    return {k: f for k, s in sources.items() if k in frozen and (f := s.format) is not None}


def mark(model: nn.Module, plan: Mapping[str, Format]) -> None:
    """Tag each planned parameter on its module (`UNSHARDED`): FSDP leaves it out, `swap` packs it."""
    for mname, module in model.named_modules():
        names = [n for n, _ in module.named_parameters(recurse=False) if _key(mname, n) in plan]
        if names:
            setattr(module, UNSHARDED, tuple(names))


def _key(mname: str, pname: str) -> str:
    return canonical_name(f"{mname}.{pname}" if mname else pname)


def swap(model: nn.Module, plan: Mapping[str, Format]) -> list[PackedWeight]:
    """Replace every parameter `mark` tagged by a `PackedWeight` of this rank's box (checked against
    its format's blocks); on the meta device, after the model is sharded. Returns them."""
    out = []
    for mname, module in model.named_modules():
        for pname in getattr(module, UNSHARDED, ()):
            p = module._parameters.pop(pname)
            key = _key(mname, pname)
            _, box = local_box(p)
            where = "one process"
            if isinstance(p, DTensor):
                where = ", ".join(
                    f"{n} {p.device_mesh.size(i)}" for i, n in enumerate(p.device_mesh.mesh_dim_names or ())
                )
                check_box(key, plan[key], tuple(p.shape), box, where)
            w = PackedWeight(key, plan[key], tuple(s.stop - s.start for s in box), box)
            object.__setattr__(module, pname, w)
            out.append(w)
    return out


def packed_weights(model: nn.Module) -> dict[str, PackedWeight]:
    """{key: PackedWeight} of a swapped model."""
    return {
        _key(mname, pname): getattr(module, pname)
        for mname, module in model.named_modules()
        for pname in getattr(module, UNSHARDED, ())
        if isinstance(getattr(module, pname, None), PackedWeight)
    }


@torch.no_grad()
def load_packed(model: nn.Module, sources: Mapping[str, Source], folder: SafetensorsFolder) -> int:
    """Read every `PackedWeight`'s codes and scale blocks from the folder onto the model's device (no
    dequantised copy at any time); returns the bytes requested."""
    start = folder.bytes_read
    found = packed_weights(model)
    if not found:
        return 0
    device = next(model.parameters()).device
    for key, w in found.items():
        codes, scale = sources[key].read_codes(folder, w.box)
        w.codes, w.scale = codes.to(device), scale.to(device)
    return folder.bytes_read - start
