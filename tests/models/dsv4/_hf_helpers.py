"""The whole-folder reference of the sharded HF load (tests/models/dsv4/test_hf_sharded.py): every
tensor read whole, dequantised whole, mapped with the whole-dict `to_ours` and copied into a built
model. The package loads slice by slice (titan_thd/models/hf/load.py); these are written independently
of it, in the simplest form, so that the two can be compared bitwise."""

from __future__ import annotations

import torch

from titan_thd.models.dsv4.hf_dequant import block_shape
from titan_thd.models.dsv4.hf_names import to_ours

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
"""The 16 FP4 e2m1 codes: bit 3 the sign, bits 0-2 the magnitude."""
PACKED = (torch.int8, torch.uint8)


def _scale_of(state: dict[str, torch.Tensor], key: str) -> str | None:
    names = [key.removesuffix("weight") + "scale", key + "_scale_inv"] if key.endswith(".weight") else []
    found = [n for n in names if n in state]
    assert len(found) <= 1, found
    return found[0] if found else None


def dequantize_tensor(key: str, weight: torch.Tensor, scale: torch.Tensor, block) -> torch.Tensor:
    """float32 of a quantised weight: each code (FP8, or two FP4 per byte, low nibble first) times the
    scale of its block (a uint8 scale is an e8m0 exponent byte)."""
    if weight.dtype in PACKED:
        u8 = weight.view(torch.uint8).long()
        values = torch.stack([E2M1[u8 & 0xF], E2M1[u8 >> 4]], dim=-1).flatten(-2)
    else:
        values = weight.float()
    scale = torch.exp2(scale.float() - 127.0) if scale.dtype == torch.uint8 else scale.float()
    rows, cols = values.shape[-2:]
    bm, bn = block_shape(key, rows, cols, tuple(scale.shape[-2:]), block)
    full = scale.repeat_interleave(bm, dim=-2)[..., :rows, :].repeat_interleave(bn, dim=-1)[..., :cols]
    return values * full


def dequantize_state(state: dict[str, torch.Tensor], block) -> dict[str, torch.Tensor]:
    """`state` with every quantised weight (FP8 e4m3 or packed FP4, with its scale) in float32 and the
    scales removed."""
    pairs = {
        k: s
        for k, v in state.items()
        if (v.dtype == torch.float8_e4m3fn or v.dtype in PACKED) and (s := _scale_of(state, k)) is not None
    }
    out = {k: v for k, v in state.items() if k not in set(pairs.values())}
    for key, scale_key in pairs.items():
        out[key] = dequantize_tensor(key, state[key], state[scale_key], block)
    return out


def load_state_dict_hf(model: torch.nn.Module, hf_state: dict[str, torch.Tensor]) -> None:
    """Copy an HF-named state dict (any spelling) into `model`: every tensor of the model but the MTP
    block's must be there (transformers writes no MTP), with its shape."""
    ours = to_ours(hf_state)
    expected = model.state_dict()
    missing = [k for k in expected if k not in ours and not k.startswith("mtp.")]
    unexpected = [k for k in ours if k not in expected]
    assert not missing and not unexpected, (missing[:5], unexpected[:5])
    with torch.no_grad():
        for k, v in expected.items():
            if k in ours:
                assert ours[k].shape == v.shape, (k, ours[k].shape, v.shape)
                v.copy_(ours[k].to(v.dtype))
