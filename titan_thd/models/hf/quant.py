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
run (models/packed_weight.py), and the encoder that writes them (`encode`, below: scripts/convert_hf.py
to-hf --dtype released and to-release, models/hf/released.py).
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
        # Built on the host (exact values: no rounding anywhere) and copied to `device` once.
        byte = torch.arange(256, device="cpu")
        if kind == "fp8":
            table = byte.to(torch.uint8).view(torch.float8_e4m3fn).to(dtype)
        else:
            lut = torch.tensor(E2M1, dtype=dtype, device="cpu")
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


# ============================================================================ encoding
# The inverse of the decoding above, as `convert_hf.py to-hf --dtype released` / `to-release` and the
# benchmarks' release folders write it:
#
#     codes_OI, exps_G = encode(w_OI, fmt)     # codes as bytes, scale exponents int32 [GO, GI]
#     w2_OI = decoded(codes_OI, exps_G, fmt)   # codes x 2^exp of their block, float32
#     weight, scale = stored(codes_OI, exps_G, weight_dtype, scale_dtype)   # as a folder stores them
#
# - FP8 e4m3, one scale per `bm x bn` block (the release's 128 x 128): the scale is the smallest power of
#   two with `amax / scale <= 448`; each value `w / scale` rounds to the nearest e4m3 value, ties to even,
#   saturated at +-448 (torch's float32 -> float8_e4m3fn cast rounds that way; tests/models/
#   test_hf_encode.py checks it against a per-element search of the 256 codes).
# - FP4 e2m1, one scale per `1 x 32` block: the smallest power of two with `amax / scale <= 6`; each value
#   rounds to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (the even code on a tie), sign bit 3 (set for
#   -0.0 too, as IEEE rounding keeps the sign); two codes per byte, the even column in the low nibble.
#
# A scale is kept as its exponent `e` (2^e, e in [-127, 127]: what an e8m0 byte `e + 127` holds). An
# all-zero block gets 2^-127, the smallest such scale. A partial edge block's amax is that of the values
# it has (zero padding changes no amax), as the loader reads it: one scale covers the whole block.
#
# Why the smallest scale: decoded(encode(x)) == x bitwise for every x a folder decodes to (any codes with
# any scale at least the smallest: doubling an e4m3 value <= 224 or an e2m1 value <= 3 is again one),
# so a re-encoded release gives back its values, and its codes wherever its scale was the smallest.

FP8_MAX = 448.0
"""The largest e4m3 (fn) value."""
FP4_MAX = 6.0
"""The largest e2m1 value."""
EXP_MIN, EXP_MAX = -127, 127
"""Exponents an e8m0 scale byte holds (byte = e + 127; 255 is NaN)."""


def smallest_exponents(amax: torch.Tensor, vmax: float) -> torch.Tensor:
    """Per block: the smallest e in [-127, 127] with `amax <= vmax * 2^e` (int32); amax finite, >= 0."""
    a = amax.double()  # exact for float32 / bfloat16 amax; vmax * 2^e is exact in float64 too
    with torch.no_grad():
        e = torch.ceil(torch.log2(a / vmax)).clamp(EXP_MIN, EXP_MAX)  # -inf (amax 0) clamps to -127
    # log2 may land one off next to a power of two: step down while the one below still fits, up
    # while this one does not (one step each way suffices; both compare exactly in float64).
    lower = (e - 1).clamp_min(EXP_MIN)
    e = torch.where(a <= torch.ldexp(torch.full_like(a, vmax), lower), lower, e)
    e = torch.where(a > torch.ldexp(torch.full_like(a, vmax), e), e + 1, e)
    return e.to(torch.int32)


def _blocks(w_OI: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [O, I] zero-padded to whole blocks, viewed [GO, bm, GI, bn]."""
    (rows, cols), (bm, bn) = w_OI.shape, block
    gr, gc = -(-rows // bm), -(-cols // bn)
    padded = torch.nn.functional.pad(w_OI, (0, gc * bn - cols, 0, gr * bm - rows))
    return padded.view(gr, bm, gc, bn)


def encode(w_OI: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8: [O, I] e4m3 bytes, or [O, I / 2] packed e2m1; scale exponents int32 [GO, GI]) of a
    finite float matrix (float32, or a narrower float: exact in float32). ValueError for NaN / inf."""
    assert w_OI.dim() == 2 and fmt.kind in ("fp8", "fp4"), (tuple(w_OI.shape), fmt)
    assert w_OI.dtype in (torch.float32, torch.bfloat16, torch.float16), w_OI.dtype
    if not bool(torch.isfinite(w_OI).all()):
        raise ValueError(
            f"{fmt.kind} encoding needs finite values; this {list(w_OI.shape)} tensor has NaN / inf"
        )
    rows, cols = w_OI.shape
    blocks = _blocks(w_OI.float(), fmt.block)  # (a copy: the caller's tensor is never written)
    vmax = FP8_MAX if fmt.kind == "fp8" else FP4_MAX
    exps = smallest_exponents(blocks.abs().amax(dim=(1, 3)), vmax)
    # Scaling by 2^-e is exact (a result below float32's normals is far below half the smallest
    # code either way, so it rounds to zero as the exact quotient would).
    v = torch.ldexp(blocks, -exps[:, None, :, None].float()).view(blocks.shape[0] * blocks.shape[1], -1)
    v = v[:rows, :cols]
    if fmt.kind == "fp8":
        return v.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8).contiguous(), exps
    assert cols % 2 == 0, f"packed FP4 needs an even number of columns, got {cols}"
    return _pack(_e2m1_codes(v)), exps


def _e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """e2m1 codes (uint8, 0-15) of float32 values with |v| <= 6: nearest, ties to the even code."""
    a = v.abs().clamp_max(FP4_MAX)
    # Below 1 the codes are 0, 0.5, 1 (0, 1, 2): round(2 a), half to even (0.25 -> 0, 0.75 -> 2).
    small = torch.round(a * 2).to(torch.int32)
    # From 1 on, e2m1 is float32 with one mantissa bit: round the float's bits to it, half to even,
    # then the code is 2 + 2 (exponent) + that bit (1 -> 2, 1.5 -> 3, 2 -> 4, ..., 6 -> 7).
    bits = a.view(torch.int32)
    bits = (bits + 0x1FFFFF + ((bits >> 22) & 1)) & ~0x3FFFFF
    big = ((bits >> 23) - 127) * 2 + 2 + ((bits >> 22) & 1)
    code = torch.where(a < 1, small, big).to(torch.uint8)
    return code | (torch.signbit(v).to(torch.uint8) << 3)


def _pack(code: torch.Tensor) -> torch.Tensor:
    """Two codes per byte, the even column in the low nibble."""
    return (code[:, 0::2] | (code[:, 1::2] << 4)).contiguous()


def decoded(codes: torch.Tensor, exps: torch.Tensor, fmt: Format) -> torch.Tensor:
    """float32 [O, I] values of `encode`'s output: its exponents as e8m0 bytes through `Format.dequantize`."""
    return fmt.dequantize(codes, scale_bytes(exps, torch.uint8), torch.float32)


def scale_bytes(exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale exponents as a folder stores them: float8_e8m0fnu, its exponent byte as uint8, or the
    value 2^e in a float dtype (exact: float32 / bfloat16 hold 2^-127 .. 2^127)."""
    if dtype in (torch.float8_e8m0fnu, torch.uint8):
        return (exps + 127).to(torch.uint8).view(dtype)
    if dtype in (torch.float32, torch.bfloat16, torch.float64):
        return torch.ldexp(torch.ones(exps.shape, dtype=torch.float32, device=exps.device), exps.float()).to(
            dtype
        )
    raise ValueError(f"a scale stored as {dtype} is not one this writer encodes (e8m0, uint8, float32, bf16)")


def exponents_of(scale: torch.Tensor) -> torch.Tensor:
    """The exponents of stored power-of-two scales (e8m0, its byte, or float values); int32."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.view(torch.uint8).to(torch.int32) - 127
    mantissa, e = torch.frexp(scale.float())
    assert bool((mantissa == 0.5).all()), "scales that are not powers of two"
    return e - 1


def stored(
    codes: torch.Tensor, exps: torch.Tensor, weight_dtype: torch.dtype, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight, scale) in a folder's dtypes: codes viewed as float8_e4m3fn (FP8) or int8 / uint8
    (packed FP4), the scales by `scale_bytes`."""
    assert weight_dtype.itemsize == 1, weight_dtype
    return codes.view(weight_dtype), scale_bytes(exps, scale_dtype)
