"""Rotary position embedding driven by per-token position ids.

Legend:
    T  rows    H  heads    D  rotated head dim    R  D // 2 rotation frequencies

In a packed microbatch the position of a row is its offset inside its document
(`PackedBatch.position_ids`, restarting at 0 per document), so every document is rotated exactly as
if it were alone. The rotation pairs dimension i with i + R (the "rotate half" layout of Hugging Face
Llama checkpoints): (x_i, x_{i+R}) turns by the angle position * theta^(-2i/D).
"""

from __future__ import annotations

import torch

from titan_thd.data.batch_meta import BatchMeta


def rope_cos_sin(
    position_ids_T: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos_TR, sin_TR of the rotation angles, computed in float64 and cast to `dtype`."""
    assert head_dim % 2 == 0, head_dim
    R = head_dim // 2
    inv_freq_R = theta ** (-torch.arange(R, dtype=torch.float64, device=position_ids_T.device) * 2 / head_dim)
    angle_TR = position_ids_T.to(torch.float64)[:, None] * inv_freq_R[None, :]
    return angle_TR.cos().to(dtype), angle_TR.sin().to(dtype)


def rope_tables(
    meta: BatchMeta, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_cos_sin` of the microbatch's positions, built once and shared by all layers."""
    return meta.cached(
        f"rope_{head_dim}_{theta}_{dtype}", lambda: rope_cos_sin(meta.position_ids, head_dim, theta, dtype)
    )


def apply_rope(x_THD: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x_THD (any number of heads) by the per-row angles."""
    x1_THR, x2_THR = x_THD.chunk(2, dim=-1)
    cos_T1R, sin_T1R = cos_TR[:, None, :], sin_TR[:, None, :]
    return torch.cat([x1_THR * cos_T1R - x2_THR * sin_T1R, x2_THR * cos_T1R + x1_THR * sin_T1R], dim=-1)
