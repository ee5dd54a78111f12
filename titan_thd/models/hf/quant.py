"""The FP8 / FP4 block formats of DeepSeek's releases: one codec for what their stored bytes mean.

Legend:  O rows   I columns   bm x bn one scale block   r0 c0 a box's first row and column

    FP8 e4m3 (V3 / V4 linears)       codes one byte per value [O, I]      scale grid [ceil(O / bm), ceil(I / bn)]
    packed FP4 e2m1 (V4 experts)     two values per byte [O, I / 2]       e8m0 scale [O, I / 32] (1 x 32 blocks)

A value is its code's number times the scale of its block (a power of two for e8m0; float32 for
FP8's grids): exact in bfloat16 as in float32. Edge blocks are partial (the grid rounds up).

    fmt = Format("fp8", (128, 128), 4)                   # kind, block, bytes of one stored scale
    codes = folder.read(weight, fmt.code_box(box))       # the stored bytes holding a box's values
    scale = folder.read(scale, fmt.grid_box(box))        # the scale blocks covering it
    w = scaled(decode(codes, fmt.kind, dtype)[..., :cols], scale, fmt.block, (r0, c0))
    w = fmt.dequantize(codes, scale, dtype)              # a box on whole blocks from block (0, 0)

Used by the load-time dequantiser (models/dsv4/hf_dequant.py) and the packed frozen weight of a LoRA
run (models/packed_weight.py). Encoding (values -> codes and scales) belongs here too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 FP4 e2m1 codes: bit 3 is the sign, bits 0-2 index 0, 0.5, 1, 1.5, 2, 3, 4, 6."""

VALUES_PER_BYTE = {"fp8": 1, "fp4": 2}
"""Values one stored byte holds, by kind."""


@dataclass(frozen=True)
class Format:
    """How a folder stores one weight."""

    kind: str
    """"fp8" (e4m3 codes, one byte each) or "fp4" (e2m1, two codes per byte, low nibble first)."""
    block: tuple[int, int]
    """Rows x columns of values that share one scale (128 x 128 for FP8, 1 x 32 for FP4)."""
    scale_bytes: int
    """Bytes of one stored scale (1: e8m0, 4: float32)."""

    def __post_init__(self):
        assert self.kind in VALUES_PER_BYTE, self.kind

    @property
    def per_byte(self) -> int:
        """Values one stored byte holds."""
        return VALUES_PER_BYTE[self.kind]

    def code_box(self, box: tuple[slice, ...]) -> tuple[slice, ...]:
        """The stored bytes that hold a box's values: FP4's columns [c0 // 2, ceil(c1 / 2))."""
        *lead, rows, cols = box
        return (*lead, rows, slice(cols.start // self.per_byte, -(-cols.stop // self.per_byte)))

    def grid_box(self, box: tuple[slice, ...]) -> tuple[slice, ...]:
        """The scale blocks covering a box: rows [r0 // bm, ceil(r1 / bm)), columns likewise."""
        *lead, rows, cols = box
        (bm, bn) = self.block
        return (
            *lead,
            slice(rows.start // bm, -(-rows.stop // bm)),
            slice(cols.start // bn, -(-cols.stop // bn)),
        )

    def code_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The stored codes of a box of `shape` values: a byte per FP8 value, one per two FP4 values."""
        return _extent(self.code_box(_whole(shape)))

    def grid_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale grid of a box of `shape` values (edge blocks counted whole)."""
        return _extent(self.grid_box(_whole(shape)))

    def stored_bytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of codes and scales of a box of `shape` values."""
        return math.prod(self.code_shape(shape)) + math.prod(self.grid_shape(shape)) * self.scale_bytes

    def dense_bytes(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """What `dequantize` holds at its peak for one box of `shape` (its last two dimensions: one
        matrix, or one expert's): the larger of its two stages. The lookup (`decode`): every code
        byte's int32 index and the values it gathers from the byte table. The scaling (`scaled`):
        those values, the scale grid and their product, the grid expanded to every row and whole
        column blocks where the box ends on a partial block (broadcast otherwise). The memory plan
        counts it (memory/plan.py); tests/memory/test_resident_plan.py measures it against live tensors."""
        rows, cols = shape[-2:]
        (bm, bn), code_bytes = self.block, math.prod(self.code_shape((rows, cols)))
        grid_rows, grid_cols = self.grid_shape((rows, cols))
        values = code_bytes * self.per_byte
        grid = grid_rows * grid_cols if rows % bm == 0 and cols % bn == 0 else rows * grid_cols * bn
        lookup = 4 * code_bytes + values * dtype.itemsize
        return max(lookup, (2 * values + grid) * dtype.itemsize)

    def dequantize(self, codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The values of a box that starts on block (0, 0) of its codes and scale grid (whole blocks,
        or the weight's partial edge blocks), in `dtype`."""
        return scaled(decode(codes, self.kind, dtype), scale, self.block)


def _whole(shape: tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


def _extent(box: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


_TABLES: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def byte_table(kind: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
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


def decode(codes: torch.Tensor, kind: str, dtype: torch.dtype) -> torch.Tensor:
    """The numbers stored codes stand for, unscaled, in `dtype`: [.., n] bytes (any one-byte dtype)
    -> [.., n] FP8 values or [.., 2 n] FP4 values."""
    # Each byte looked up in a 256-row table of its value(s): 2x faster than casting e4m3 on a CPU.
    table = byte_table(kind, dtype, codes.device)
    values = table.index_select(0, codes.reshape(-1).view(torch.uint8).int())
    return values.view(*codes.shape[:-1], VALUES_PER_BYTE[kind] * codes.shape[-1])


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Stored scales as float32: an e8m0 byte (uint8) is 2^(e - 127)."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def scaled(
    values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], start: tuple[int, int] = (0, 0)
) -> torch.Tensor:
    """values [.., rows, cols], the box of a weight whose first element is (r0, c0) = `start`, times
    the scale of each one's block; `scale` is the stored grid's part that covers the box (`grid_box`),
    taken in the values' dtype."""
    s = scale_values(scale).to(values.dtype)
    (*lead, rows, cols), (bm, bn), (gr, gc) = values.shape, block, s.shape[-2:]
    r0, c0 = start[0] % bm, start[1] % bn
    if r0 == 0 and c0 == 0 and rows == gr * bm and cols == gc * bn:
        # whole blocks: broadcast, no expanded copy of the grid
        return (values.reshape(*lead, gr, bm, gc, bn) * s.view(*lead, gr, 1, gc, 1)).view(values.shape)
    s = s.repeat_interleave(bm, dim=-2)[..., r0 : r0 + rows, :].repeat_interleave(bn, dim=-1)
    return values * s[..., c0 : c0 + cols]
