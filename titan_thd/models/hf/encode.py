"""Encode float weights into DeepSeek's release formats: the inverse of the load-time dequantisation
(models/dsv4/hf_dequant.py, lora/resident.py).

    codes_OI, exps_G = encode(w_OI, fmt)     # fmt: lora/resident.py Format ("fp8" or "fp4", its block)
    w2_OI = decode(codes_OI, exps_G, fmt)    # codes x 2^exp of their block, float32
    weight, scale = stored(codes_OI, exps_G, weight_dtype, scale_dtype)   # as a folder stores them

Legend:  O rows   I columns   G the scale grid [ceil(O / bm), ceil(I / bn)] (edge blocks partial)

- FP8 e4m3, one scale per `bm x bn` block (the release's 128 x 128): the scale is the smallest power of
  two with `amax / scale <= 448`; each value `w / scale` rounds to the nearest e4m3 value, ties to even,
  saturated at +-448 (torch's float32 -> float8_e4m3fn cast rounds that way; tests/models/
  test_hf_encode.py checks it against a per-element search of the 256 codes).
- FP4 e2m1, one scale per `1 x 32` block: the smallest power of two with `amax / scale <= 6`; each value
  rounds to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6 (the even code on a tie), sign bit 3 (set for
  -0.0 too, as IEEE rounding keeps the sign); two codes per byte, the even column in the low nibble.

A scale is kept as its exponent `e` (2^e, e in [-127, 127]: what an e8m0 byte `e + 127` holds). An
all-zero block gets 2^-127, the smallest such scale. A partial edge block's amax is that of the values
it has (zero padding changes no amax), as the loader reads it: one scale covers the whole block.

Why the smallest scale: decode(encode(x)) == x bitwise for every x a folder decodes to (any codes with
any scale at least the smallest: doubling an e4m3 value <= 224 or an e2m1 value <= 3 is again one),
so a re-encoded release gives back its values, and its codes wherever its scale was the smallest.
"""

from __future__ import annotations

import torch

from titan_thd.lora.resident import E2M1, Format

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


def decode(codes: torch.Tensor, exps: torch.Tensor, fmt: Format, cols: int | None = None) -> torch.Tensor:
    """float32 [O, I] values of `encode`'s output: each code's value times 2^e of its block (`cols`:
    the width, for packed FP4 with an odd one; default every code)."""
    u8 = codes.view(torch.uint8)
    if fmt.kind == "fp8":
        values = u8.view(torch.float8_e4m3fn).float()
    else:
        lut = torch.tensor(E2M1, dtype=torch.float32)
        values = torch.stack([lut[(u8 & 0xF).long()], lut[(u8 >> 4).long()]], dim=-1).flatten(-2)
    rows, width = values.shape[0], cols if cols is not None else values.shape[1]
    (bm, bn), scale = fmt.block, torch.ldexp(torch.ones(exps.shape), exps.float())
    s = scale.repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :width]
    return values[:, :width] * s


def scale_bytes(exps: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Scale exponents as a folder stores them: float8_e8m0fnu, its exponent byte as uint8, or the
    value 2^e in a float dtype (exact: float32 / bfloat16 hold 2^-127 .. 2^127)."""
    if dtype in (torch.float8_e8m0fnu, torch.uint8):
        return (exps + 127).to(torch.uint8).view(dtype)
    if dtype in (torch.float32, torch.bfloat16, torch.float64):
        return torch.ldexp(torch.ones(exps.shape, dtype=torch.float32), exps.float()).to(dtype)
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
