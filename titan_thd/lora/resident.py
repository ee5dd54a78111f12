"""The frozen base of a LoRA run kept as released (`lora.base_dtype = "released"`, docs/lora.md): FP8
blocks and packed FP4 experts stay codes + scales in memory and are dequantised per use.

Legend:  O out-features   I in-features   E routed experts (this rank's)   N routed rows   r0 c0 offsets

What changes for one frozen base weight W of a release-format folder (models/dsv4/hf_dequant.py):

    FP8 e4m3 (attention, shared expert, ...)   codes uint8 [O, I]   + scale grid [O / bm, I / bn] (128 x 128)
    packed FP4 e2m1 (routed experts)           codes int8 [E, O, I / 2] + e8m0 scale [E, O, I / 32] (1 x 32)

    plan = resident_plan(sources)         # start-up: {our key: Format}, from the folder's headers
    mark(model, plan)                     # meta model: these parameters stay out of FSDP
    swap(model, plan)                     # after parallelize, still meta: each becomes a `Resident`
    load_resident(model, sources, folder) # this rank's codes and the scale blocks that cover them

A `Resident` takes the parameter's place as a plain attribute of its module (not a parameter, not a
buffer: never drawn by the seeded init, never cast, moved or gathered; nothing trains it) and holds
this rank's box of the global weight, the box its TP / EP placement gave it: a box must start and end
on scale blocks (`check_box`, the refusal names the tensor, the block and the degrees that serve it).
FSDP / HSDP / CP replicate it (the frozen base needs no gradient reduction; gathering it every step
would move the whole base per step), pipeline stages hold their layers' boxes.

Per use, `base_linear` / `base_grouped` dequantise into the activations' dtype (exact: an e4m3 or
e2m1 value times a power of two is a bfloat16) inside an autograd function that saves nothing of W
and dequantises again in the backward: the transient is one weight (FP8) or one expert (FP4).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from titan_thd.ops.grouped_linear import grouped_linear
from titan_thd.parallel.shards import UNSHARDED, canonical_name, local_box
from titan_thd.parallel.tensor_parallel import local

RESIDENT = UNSHARDED
"""Attribute of a module: the names of its parameters that `swap` turns into `Resident`s (FSDP leaves
them out: parallel/fsdp.py reads it, since the swap comes after the model is sharded)."""

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 e2m1 codes: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6."""


@dataclass(frozen=True)
class Format:
    """How a folder stores one weight."""

    kind: str
    """"fp8" (e4m3 codes, one byte each) or "fp4" (e2m1, two codes per byte, low nibble first)."""
    block: tuple[int, int]
    """Rows x columns of values that share one scale (128 x 128 for FP8, 1 x 32 for FP4)."""
    scale_bytes: int
    """Bytes of one stored scale (1: e8m0, 4: float32)."""

    def code_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored codes of a box of `shape` values: a byte per FP8 value, one per two FP4 values."""
        *lead, rows, cols = shape
        return (*lead, rows, cols if self.kind == "fp8" else -(-cols // 2))

    def grid_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale grid of a box of `shape` values (edge blocks counted whole)."""
        *lead, rows, cols = shape
        return (*lead, -(-rows // self.block[0]), -(-cols // self.block[1]))

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of codes and scales of a box of `shape` values."""
        return math.prod(self.code_shape(shape)) + math.prod(self.grid_shape(shape)) * self.scale_bytes

    def dense_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """What `Resident.dense` holds at its peak for one use of a box of `shape` (its last two
        dimensions: one matrix, or one expert's): the larger of its two stages. The lookup: every code
        byte's int32 index and the values it gathers from the byte table. The scaling: those values,
        the scale grid and their product, the grid expanded to every row and whole column blocks where
        the box ends on a partial block (broadcast otherwise). The memory plan counts it
        (memory/plan.py); tests/memory/test_resident_plan.py measures it against live tensors. The
        forward's and the backward's uses never overlap (nothing of W is saved)."""
        rows, cols = shape[-2:]
        (bm, bn), code_bytes = self.block, math.prod(self.code_shape((rows, cols)))
        grid_rows, grid_cols = self.grid_shape((rows, cols))
        values = code_bytes if self.kind == "fp8" else 2 * code_bytes
        grid = grid_rows * grid_cols if rows % bm == 0 and cols % bn == 0 else rows * grid_cols * bn
        lookup = 4 * code_bytes + values * dtype.itemsize
        return max(lookup, (2 * values + grid) * dtype.itemsize)


def fmt_of(source) -> Format | None:
    """The stored format of a folder's source (models/dsv4/hf_dequant.Quantized, or a stack of them:
    one per expert), None for one that is not block-quantised."""
    parts = getattr(source, "parts", None)
    if parts is not None:
        fmts = {fmt_of(p) for p in parts}
        return fmts.pop() if len(fmts) == 1 else None
    if not hasattr(source, "packed") or not hasattr(source, "block"):
        return None
    kind = "fp4" if source.packed else "fp8"
    return Format(kind, tuple(source.block), source.scale.dtype.itemsize)


def resident_plan(sources: Mapping[str, object], frozen: set[str]) -> dict[str, Format]:
    """{key: Format} of the frozen weights a folder stores block-quantised (the rest load as today)."""
    return {k: f for k, s in sources.items() if k in frozen and (f := fmt_of(s)) is not None}


def mark(model: nn.Module, plan: Mapping[str, Format]) -> None:
    """Tag each planned parameter on its module (`RESIDENT`): FSDP leaves it out."""
    for mname, module in model.named_modules():
        names = [n for n, _ in module.named_parameters(recurse=False) if _key(mname, n) in plan]
        if names:
            setattr(module, RESIDENT, tuple(names))


def _key(mname: str, pname: str) -> str:
    return canonical_name(f"{mname}.{pname}" if mname else pname)


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


class Resident:
    """This rank's box of a frozen base weight as released: codes and the scale blocks covering them.

    `shape` is the local shape of the weight it stands for ([O, I] or [E, O, I]); `codes` / `scale`
    stay None on the meta device (a dry run) until `load_resident` reads them."""

    def __init__(self, key: str, fmt: Format, shape: tuple[int, ...], box: tuple[slice, ...]):
        self.key, self.fmt, self.shape, self.box = key, fmt, tuple(shape), box
        self.codes: torch.Tensor | None = None
        self.scale: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"Resident({self.key}, {self.fmt.kind}, local {list(self.shape)})"

    @property
    def stored_bytes(self) -> int:
        return self.fmt.stored_bytes(self.shape)

    def dense(self, dtype: torch.dtype, expert: int | None = None) -> torch.Tensor:
        """W (or expert `expert` of a stack) in `dtype`: codes times the scale of their block."""
        assert self.codes is not None, f"{self.key}: the resident base was not loaded"
        codes = self.codes if expert is None else self.codes[expert]
        scale = self.scale if expert is None else self.scale[expert]
        # Each byte looked up in a 256-row table of its value(s): 2x faster than casting e4m3 on a CPU.
        table = _table(self.fmt.kind, dtype, codes.device)
        values = table.index_select(0, codes.reshape(-1).view(torch.uint8).int())
        if self.fmt.kind == "fp4":  # two values per byte, low nibble first
            values = values.view(*codes.shape[:-1], 2 * codes.shape[-1])
        else:
            values = values.view(codes.shape)
        return _scaled(values, scale_values(scale).to(dtype), self.fmt.block)


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _table(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The value(s) of each byte: fp8 [256] (e4m3), fp4 [256, 2] (two e2m1 codes, low nibble first)."""
    key = (kind, dtype, device)
    if key not in _TABLES:
        byte = torch.arange(256)
        if kind == "fp8":
            table = byte.to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
        else:
            lut = torch.tensor(E2M1, dtype=dtype)
            table = torch.stack([lut[byte & 0xF], lut[byte >> 4]], dim=-1)
        _TABLES[key] = table.to(device)
    return _TABLES[key]


def _scaled(values: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """values [.., rows, cols] times the scale of each one's block (grid `s`, edge blocks partial)."""
    (*lead, rows, cols), (bm, bn), (gr, gc) = values.shape, block, s.shape[-2:]
    if rows == gr * bm and cols == gc * bn:  # whole blocks: broadcast, no expanded copy of the grid
        return (values.view(*lead, gr, bm, gc, bn) * s.view(*lead, gr, 1, gc, 1)).view(values.shape)
    s = s.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return values * s


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales as float32: an e8m0 byte is 2^(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


class _Linear(torch.autograd.Function):
    """x W^T with W dequantised per use, in the forward and again in the backward (never saved)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: Resident) -> torch.Tensor:
        ctx.w = w
        return F.linear(x, w.dense(x.dtype))

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        return dy @ ctx.w.dense(dy.dtype), None


class _Grouped(torch.autograd.Function):
    """Rows grouped by expert (`counts`) times each expert's W_e^T, one expert dequantised at a time."""

    @staticmethod
    def forward(ctx, x_NI: torch.Tensor, counts: list[int], w: Resident) -> torch.Tensor:
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
    def forward(ctx, x_TGI: torch.Tensor, w: Resident) -> torch.Tensor:
        ctx.w = w
        w_GOI = w.dense(x_TGI.dtype).view(x_TGI.shape[1], -1, x_TGI.shape[2])
        # einsum returns a view of its product; the caller adds the adapter's update in place
        return torch.einsum("tgi,goi->tgo", x_TGI, w_GOI).contiguous().clone()

    @staticmethod
    def backward(ctx, dy_TGO: torch.Tensor):
        w_GOI = ctx.w.dense(dy_TGO.dtype).view(dy_TGO.shape[1], dy_TGO.shape[2], -1)
        return torch.einsum("tgo,goi->tgi", dy_TGO, w_GOI), None


def base_groups(x_TGI: torch.Tensor, w: torch.Tensor | Resident) -> torch.Tensor:
    """Group g of x times W_g^T, W [G * O, I] viewed [G, O, I] (a parameter's local shard or a `Resident`)."""
    if isinstance(w, Resident):
        return _Groups.apply(x_TGI, w)
    return torch.einsum("tgi,goi->tgo", x_TGI, local(w).view(x_TGI.shape[1], -1, x_TGI.shape[2]))


def local_weight(w: torch.Tensor | Resident) -> torch.Tensor | Resident:
    """This rank's part of a base weight: a parameter's local shard (`local`), or its `Resident`."""
    return w if isinstance(w, Resident) else local(w)


def base_linear(x: torch.Tensor, w: torch.Tensor | Resident) -> torch.Tensor:
    """x W^T for a base weight: this rank's shard (`local`) of a parameter, or a `Resident`."""
    if isinstance(w, Resident):
        return _Linear.apply(x, w)
    return F.linear(x, local(w))


def base_grouped(x_NI: torch.Tensor, counts: list[int], w: torch.Tensor | Resident) -> torch.Tensor:
    """`grouped_linear` (ops/grouped_linear.py) for a stacked base weight or its `Resident`."""
    if isinstance(w, Resident):
        return _Grouped.apply(x_NI, counts, w)
    return grouped_linear(x_NI, counts, local(w))


def dense_local(w: torch.Tensor | Resident, dtype: torch.dtype) -> torch.Tensor:
    """This rank's W as a tensor; a `Resident` dequantised (use `base_linear` where autograd runs
    through it: this copy would be saved for the backward)."""
    return w.dense(dtype) if isinstance(w, Resident) else local(w)


def swap(model: nn.Module, plan: Mapping[str, Format]) -> list[Resident]:
    """Replace every parameter `mark` tagged by a `Resident` of this rank's box (checked against
    its format's blocks); on the meta device, after the model is sharded. Returns them."""
    out = []
    for mname, module in model.named_modules():
        for pname in getattr(module, RESIDENT, ()):
            p = module._parameters.pop(pname)
            key = _key(mname, pname)
            _, box = local_box(p)
            where = "one process"
            if isinstance(p, DTensor):
                where = ", ".join(
                    f"{n} {p.device_mesh.size(i)}" for i, n in enumerate(p.device_mesh.mesh_dim_names or ())
                )
                check_box(key, plan[key], tuple(p.shape), box, where)
            r = Resident(key, plan[key], tuple(s.stop - s.start for s in box), box)
            object.__setattr__(module, pname, r)
            out.append(r)
    return out


def residents(model: nn.Module) -> dict[str, Resident]:
    """{key: Resident} of a swapped model."""
    return {
        _key(mname, pname): getattr(module, pname)
        for mname, module in model.named_modules()
        for pname in getattr(module, RESIDENT, ())
        if isinstance(getattr(module, pname, None), Resident)
    }


@torch.no_grad()
def load_resident(model: nn.Module, sources: Mapping[str, object], folder) -> int:
    """Read every `Resident`'s codes and scale blocks from the folder onto the model's device (no
    dequantised copy at any time); returns the bytes requested."""
    start = folder.bytes_read
    found = residents(model)
    if not found:
        return 0
    device = next(model.parameters()).device
    for key, r in found.items():
        source = sources[key]
        parts = getattr(source, "parts", None)
        if parts is None:
            codes, scale = source.read_codes(folder, r.box)
        else:  # a stack of per-expert weights: this rank's experts
            lead, inner = r.box[0], r.box[1:]
            pairs = [parts[e].read_codes(folder, inner) for e in range(lead.start, lead.stop)]
            codes = torch.stack([c for c, _ in pairs]) if pairs else None
            scale = torch.stack([s for _, s in pairs]) if pairs else None
        if codes is None:
            continue
        r.codes, r.scale = codes.to(device), scale.to(device)
    return folder.bytes_read - start
