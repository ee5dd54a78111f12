"""RoPE from per-token positions: rotation properties, complex-number reference, per-document restart."""

from __future__ import annotations

import torch

from tests.ops.test_varlen_attention import doc_rows, packed_meta
from titan_thd.ops.rope import apply_rope, rope_cos_sin, rope_tables

TOL = 1e-10
D, THETA = 16, 10000.0


def rope_at(x_THD: torch.Tensor, positions: list[int] | torch.Tensor) -> torch.Tensor:
    cos, sin = rope_cos_sin(torch.as_tensor(positions), D, THETA, x_THD.dtype)
    return apply_rope(x_THD, cos, sin)


def test_matches_complex_rotation():
    x = torch.randn(7, 3, D, dtype=torch.float64)
    pos = torch.tensor([0, 1, 2, 5, 100, 4095, 70000])
    # Pair (x_i, x_{i+R}) as x_i + j x_{i+R}, rotated by pos * theta^(-2i/D).
    R = D // 2
    z = torch.complex(x[..., :R], x[..., R:])
    freq = THETA ** (-2.0 * torch.arange(R, dtype=torch.float64) / D)
    z = z * torch.polar(torch.ones(7, 1, R, dtype=torch.float64), pos[:, None, None] * freq)
    torch.testing.assert_close(rope_at(x, pos), torch.cat([z.real, z.imag], -1), rtol=0, atol=TOL)


def test_position_zero_is_identity_and_norm_is_kept():
    x = torch.randn(5, 2, D, dtype=torch.float64)
    assert torch.equal(rope_at(x, [0] * 5), x)
    rotated = rope_at(x, [3, 9, 27, 81, 243])
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=0, atol=TOL)


def test_scores_depend_only_on_relative_position():
    q, k = torch.randn(2, 1, 1, D, dtype=torch.float64)
    for m, n in [(0, 0), (7, 3), (3, 7), (50, 1)]:
        base = (rope_at(q, [m]) * rope_at(k, [n])).sum()
        for shift in (1, 13, 2000):
            shifted = (rope_at(q, [m + shift]) * rope_at(k, [n + shift])).sum()
            torch.testing.assert_close(shifted, base, rtol=0, atol=TOL)
    # ...and do depend on it (the property above is not vacuous).
    assert (
        (rope_at(q, [5]) * rope_at(k, [0])).sum() - (rope_at(q, [6]) * rope_at(k, [0])).sum()
    ).abs() > 1e-3


def test_positions_restart_per_document():
    meta = packed_meta([5, 9, 3], pad_to=4, T=32)
    x = torch.randn(meta.total_tokens, 2, D, dtype=torch.float64)
    cos, sin = rope_tables(meta, D, THETA, torch.float64)
    assert rope_tables(meta, D, THETA, torch.float64)[0] is cos  # built once per microbatch
    packed = apply_rope(x, cos, sin)
    for rows in doc_rows(meta):
        alone = rope_at(x[rows], list(range(rows.stop - rows.start)))
        torch.testing.assert_close(packed[rows], alone, rtol=0, atol=TOL)
