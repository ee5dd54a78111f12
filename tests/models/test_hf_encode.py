"""The release-format encoder (models/hf/quant.py `encode`) against an independent per-element reference.

The reference works in exact rationals (`fractions.Fraction`): per block the smallest 2^e (e in
[-127, 127]) with amax / 2^e <= 448 (FP8) or 6 (FP4), found by counting e up; per element the nearest
of every finite code's value (all 256 e4m3 bytes but NaN, or the 16 e2m1 codes), a tie going to the
even code, the sign bit that of the value (so -0.0 and negatives that round to zero keep it). Inputs
hold exact ties, exact powers of two, all-zero blocks, -0.0, values at the bottom of e4m3's
subnormals, magnitudes near float32's ends and partial edge blocks on both sides.

Properties: decoded(encode(x)) == x bitwise for every x a folder decodes to (random codes with a
random scale at or above the smallest); the codes too where the scale is the smallest.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from titan_thd.models.hf.quant import E2M1, Format, decoded, encode, exponents_of, scale_bytes, stored

FP8 = Format("fp8", (16, 32), 1)
FP4 = Format("fp4", (1, 32), 1)

E4M3 = [
    (b, Fraction(float(torch.tensor([b], dtype=torch.uint8).view(torch.float8_e4m3fn).float())))
    for b in range(256)
    if b & 0x7F != 0x7F  # NaN
]
E2M1_CODES = [(b, Fraction(v)) for b, v in enumerate(E2M1)]


def _ref_exponent(amax: Fraction, vmax: int) -> int:
    e = -127
    while amax > vmax * Fraction(2) ** e:
        e += 1
    assert e <= 127
    return e


def _ref_code(v: Fraction, negative: bool, table) -> int:
    """The nearest code's byte (ties: the even byte), sign bit as the value's; saturated."""
    same_sign = [(b, x) for b, x in table if bool(b & (0x80 if len(table) > 16 else 0x8)) == negative]
    best = min(same_sign, key=lambda bx: (abs(bx[1] - v), bx[0] & 1))
    return best[0]


def reference(w: torch.Tensor, fmt: Format) -> tuple[list[list[int]], list[list[int]]]:
    """(code bytes [O][I] unpacked, exponents [GO][GI]) of w, element by element."""
    rows, cols = w.shape
    (bm, bn), vmax = fmt.block, 448 if fmt.kind == "fp8" else 6
    table = E4M3 if fmt.kind == "fp8" else E2M1_CODES
    gr, gc = math.ceil(rows / bm), math.ceil(cols / bn)
    exps = [[0] * gc for _ in range(gr)]
    for i in range(gr):
        for j in range(gc):
            block = w[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn]
            exps[i][j] = _ref_exponent(max(abs(Fraction(float(x))) for x in block.flatten()), vmax)
    codes = [[0] * cols for _ in range(rows)]
    for r in range(rows):
        for c in range(cols):
            x = float(w[r, c])
            v = Fraction(x) / Fraction(2) ** exps[r // bm][c // bn]
            codes[r][c] = _ref_code(v, math.copysign(1.0, x) < 0, table)
    return codes, exps


def _unpacked(codes: torch.Tensor, fmt: Format) -> list[list[int]]:
    if fmt.kind == "fp8":
        return codes.tolist()
    return torch.stack([codes & 0xF, codes >> 4], dim=-1).flatten(-2).tolist()


def _hard_values(rows: int, cols: int, block: tuple[int, int], seed: int, kind: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * torch.exp2(
        torch.randint(-12, 12, (rows, 1), generator=g).float()
    )
    vmax = 448.0 if kind == "fp8" else 6.0
    table = [abs(x) for _, x in (E4M3 if kind == "fp8" else E2M1_CODES)]
    mids = sorted(
        {float((a + b) / 2) for a, b in zip(sorted(set(table)), sorted(set(table))[1:], strict=False)}
    )
    bm, bn = block
    # block (0, 0): amax exactly vmax * 2^3, and exact midpoints between codes at that scale
    w[:bm, :bn] = 0.0
    w[0, 0] = vmax * 8
    for k, m in enumerate(mids[: min(bn - 1, len(mids))]):
        w[min(1, bm - 1) if bm > 1 else 0, (k + 1) % bn] = -m * 8 if k % 2 else m * 8
    w[-1, -1] = -0.0  # in a partial edge block (shapes below are not multiples of the block)
    if rows > bm:
        w[bm : 2 * bm, :bn] = 0.0  # an all-zero block
        w[bm, 1] = -0.0
    w[-1, 0] = 3e38 if kind == "fp8" else 2e38  # near float32's top
    w[-2, 0] = 1e-40  # a float32 subnormal
    w[-2, 1] = -(2.0**-140)
    return w


@pytest.mark.parametrize("fmt, shape", [(FP8, (40, 70)), (FP4, (7, 100))])
def test_encode_equals_the_per_element_reference(fmt, shape):
    w = _hard_values(*shape, fmt.block, seed=3, kind=fmt.kind)
    codes, exps = encode(w, fmt)
    ref_codes, ref_exps = reference(w, fmt)
    assert exps.tolist() == ref_exps
    got = _unpacked(codes, fmt)
    bad = [(r, c) for r in range(shape[0]) for c in range(shape[1]) if got[r][c] != ref_codes[r][c]]
    assert not bad, [(rc, float(w[rc]), got[rc[0]][rc[1]], ref_codes[rc[0]][rc[1]]) for rc in bad[:5]]
    # the packed layout: low nibble = even column
    if fmt.kind == "fp4":
        assert codes.shape == (shape[0], shape[1] // 2)
        assert (codes[0, 0] & 0xF).item() == ref_codes[0][0] and (codes[0, 0] >> 4).item() == ref_codes[0][1]
    # bfloat16 input encodes as its float32 value
    wb = w.to(torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(encode(wb, fmt), encode(wb.float(), fmt), strict=True))


@pytest.mark.parametrize("fmt", [FP8, Format("fp8", (128, 128), 4), FP4])
def test_decode_encode_gives_back_every_decodable_value(fmt):
    g = torch.Generator().manual_seed(11)
    rows, cols = (300, 200) if fmt.kind == "fp8" else (64, 256)
    (bm, bn), vmax = fmt.block, 448 if fmt.kind == "fp8" else 6
    gr, gc = -(-rows // bm), -(-cols // bn)
    table = E4M3 if fmt.kind == "fp8" else E2M1_CODES
    # per block a random scale, and in about a third of the blocks codes of at most vmax / 2 or / 4:
    # there the scale is larger than the smallest that fits
    exps = torch.randint(-100, 100, (gr, gc), generator=g, dtype=torch.int32)
    lift = torch.randint(1, 3, (gr, gc), generator=g) * (torch.rand(gr, gc, generator=g) < 0.3)
    limit = (
        (vmax / torch.exp2(lift.float())).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    )
    allowed = torch.tensor([b for b, _ in table])
    values = torch.tensor([float(v) for _, v in table])
    pick = torch.randint(0, len(table), (rows, cols), generator=g)
    while bool((over := values[pick].abs() > limit).any()):
        pick[over] = torch.randint(0, len(table), (int(over.sum()),), generator=g)
    code = allowed[pick].to(torch.uint8)
    codes = code if fmt.kind == "fp8" else code[:, 0::2] | (code[:, 1::2] << 4)
    x = decoded(codes, exps, fmt)
    codes2, exps2 = encode(x, fmt)
    assert torch.equal(decoded(codes2, exps2, fmt).view(torch.int32), x.view(torch.int32))  # bitwise
    expected = [
        [_ref_exponent(max(abs(Fraction(float(v))) for v in x[i * bm : (i + 1) * bm, j * bn : (j + 1) * bn].flatten()), vmax)
         for j in range(gc)]
        for i in range(gr)
    ]  # fmt: skip
    assert exps2.tolist() == expected
    same = (exps2 == exps).repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
    assert bool(same.any()) and bool((~same).any())
    got = torch.tensor(_unpacked(codes2, fmt))
    assert torch.equal(got[same], code[same])  # the codes too where the scale was the smallest


def test_stored_dtypes_round_trip_the_exponents():
    exps = torch.tensor([[-127, -1, 0], [5, 100, 127]], dtype=torch.int32)
    for dtype in (torch.float8_e8m0fnu, torch.uint8, torch.float32, torch.bfloat16):
        s = scale_bytes(exps, dtype)
        assert s.dtype == dtype and torch.equal(exponents_of(s), exps), dtype
    assert scale_bytes(exps, torch.uint8)[0, 2].item() == 127
    codes = torch.tensor([[1, 2]], dtype=torch.uint8)
    w, s = stored(codes, exps[:1, :1], torch.int8, torch.float8_e8m0fnu)
    assert w.dtype == torch.int8 and s.view(torch.uint8).item() == 0
    with pytest.raises(ValueError, match="float16 is not one this writer encodes"):
        scale_bytes(exps, torch.float16)


def test_non_finite_values_are_refused():
    w = torch.ones(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="needs finite values"):
        encode(w, FP4)
