"""Partial interleaved RoPE of DeepSeek-V4 (docs/dsv4.md §2, pitfall 9).

Legend:  N rows (tokens or compressed entries)   R = r / 2 rotation frequencies   D head dim

Only the trailing r = rope_dim channels of a head rotate, in interleaved pairs (x[2i], x[2i+1]) —
the "complex number" layout of the reference — not the rotate-half layout of Llama checkpoints
(titan_thd.ops.rope). Sliding-only layers use plain RoPE with `rope_theta`; CSA / HCA layers use
`compress_rope_theta` with YaRN frequency interpolation and a magnitude factor of exactly 1 (the
reference never scales cos / sin). Because V = K carries RoPE, attention outputs are rotated back
with the conjugate angle at the query position (`inverse=True`).
"""

from __future__ import annotations

import math

import torch

from titan_thd.models.dsv4.args import DSv4Args


def inv_freq(args: DSv4Args, compressed: bool, dtype: torch.dtype) -> torch.Tensor:
    """[R] rotation frequencies; `compressed` selects the CSA / HCA (compress θ + YaRN) variant."""
    r = args.rope_dim
    base = args.compress_rope_theta if compressed else args.rope_theta
    # float32 exponent like the reference, so float32 models rotate bit-compatibly.
    exp_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    # On the host, where the plans that use them are built: the same bits whatever the compute device.
    wavelength_R = base ** (torch.arange(0, r, 2, dtype=exp_dtype, device="cpu") / r)
    if not compressed or args.rope_factor == 1.0:
        return 1.0 / wavelength_R

    # YaRN: interpolate low frequencies by 1/factor, keep high ones, linear ramp in between.
    def correction_dim(rotations: float) -> float:
        return r * math.log(args.rope_original_max_pos / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(args.rope_beta_fast)), 0)
    high = min(math.ceil(correction_dim(args.rope_beta_slow)), r - 1)
    if low == high:
        high += 0.001
    ramp_R = ((torch.arange(r // 2, dtype=exp_dtype, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep_R = 1 - ramp_R
    return 1.0 / (args.rope_factor * wavelength_R) * (1 - keep_R) + 1.0 / wavelength_R * keep_R


def cos_sin(positions_N: torch.Tensor, freq_R: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_NR, sin_NR of the angles position * freq (in freq's dtype)."""
    angle_NR = positions_N.to(freq_R.device, freq_R.dtype)[:, None] * freq_R[None, :]
    return angle_NR.cos(), angle_NR.sin()


def apply_rope(
    x: torch.Tensor, cos_NR: torch.Tensor, sin_NR: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing 2R channels of x [N, ..., D] by the per-row angles (conjugate if inverse)."""
    R = cos_NR.shape[-1]
    view = (cos_NR.shape[0],) + (1,) * (x.ndim - 2) + (R,)
    cos, sin = cos_NR.view(view), sin_NR.view(view)
    return _Rope.apply(x, cos, -sin if inverse else sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    R = cos.shape[-1]
    nope, rope = x[..., : -2 * R], x[..., -2 * R :].to(cos.dtype)
    even, odd = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((nope, rotated.to(x.dtype)), dim=-1)


class _Rope(torch.autograd.Function):
    """A rotation's gradient is the gradient rotated back: one more `_rotate` (autograd through it
    runs the four products' backwards into strided halves and the stack / cat backwards)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        assert not (cos.requires_grad or sin.requires_grad), "RoPE angles carry no gradient"
        ctx.save_for_backward(cos, sin)
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, -sin), None, None
