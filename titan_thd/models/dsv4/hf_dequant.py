"""Dequantise the block-quantised weights of DeepSeek's published checkpoints on load (docs/dsv4.md §17).

DeepSeek publishes V3 and V4 with low-precision weights. The layouts read here (the ones transformers'
fine-grained loader reads):

- FP8 (every V3 / V4 `-Base` linear, V4's attention and shared experts): a `float8_e4m3fn` weight
  `<m>.weight` and a scale grid `<m>.scale` (V4's release) or `<m>.weight_scale_inv` (V3, and what
  transformers saves), one multiplier per block of `quantization_config.weight_block_size` (128 x 128)
  rows x columns. The grid rounds up (`[ceil(out / 128), ceil(in / 128)]`); edge blocks are partial.
- Packed FP4 (V4-Flash / V4-Pro routed experts): an int8 (or uint8) weight `[out, in / 2]` holding two
  e2m1 values per byte, low nibble first, and a `float8_e8m0fnu` scale (or its biased exponent byte
  as uint8) `[out, in / 32]`: one power of two per 1 x 32 block.

`w = value * scale of its block`, computed in float32 (the codec: models/hf/quant.py). Other
quantisation schemes (NVFP4's second-level scales, static activation scales, a `quant_method` other
than DeepSeek's `fp8`) are refused.
"""

from __future__ import annotations

import torch

from titan_thd.models.hf.io import SafetensorsFolder, Source, Stored
from titan_thd.models.hf.quant import Format, decode, scaled

_PACKED = (torch.int8, torch.uint8)
# Scales of schemes that are not DeepSeek's (NVFP4, static activation quantisation): refused by name.
_FOREIGN_SUFFIXES = (".weight_scale_2", ".input_scale", ".activation_scale", ".weight_scale")


def check_quantization_config(cfg: dict, where: str) -> tuple[int, int] | None:
    """The `weight_block_size` of config.json's `quantization_config` (None without one); ValueError
    for a scheme this loader cannot dequantise."""
    q = cfg.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ValueError(f"{where}: quantization_config must be a JSON object, got {type(q).__name__}")
    method = q.get("quant_method", "fp8")
    if method != "fp8":
        raise ValueError(
            f"{where}: quantization_config.quant_method = {method!r} is not supported (only DeepSeek's "
            "block 'fp8' release format, with packed FP4 experts); dequantise the checkpoint first"
        )
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where}: quantization_config.fmt = {q['fmt']!r} is not supported (only 'e4m3')")
    block = q.get("weight_block_size", [128, 128])
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ValueError(f"{where}: quantization_config.weight_block_size = {block!r}, expected [rows, cols]")
    return block[0], block[1]


def _scale_key(state: dict[str, torch.Tensor], key: str) -> str | None:
    names = [key + "_scale_inv"]
    if key.endswith(".weight"):
        names = [key.removesuffix("weight") + "scale", key + "_scale_inv"]
    found = [n for n in names if n in state]
    if len(found) > 1:
        raise ValueError(f"{key} has two scales, {found}; expected one")
    return found[0] if found else None


def block_shape(key: str, rows: int, cols: int, grid: tuple[int, ...], block: tuple[int, int] | None):
    """(rows, cols) of one scale block of a `rows x cols` weight with a `grid` of scales (ValueError
    naming `key` when the grid does not tile the weight)."""
    # The grid rounds up, so it alone does not give the block (DeepSeek-V3's [576, 7168] weights have a
    # [5, 56] grid): the configured block comes first; a grid that divides the weight gives the rest
    # (the 1 x 32 blocks of packed FP4 experts).
    if block is not None and (-(-rows // block[0]), -(-cols // block[1])) == tuple(grid):
        return block
    if rows % grid[0] == 0 and cols % grid[1] == 0:
        return rows // grid[0], cols // grid[1]
    raise ValueError(
        f"{key}: scale grid {tuple(grid)} does not tile the weight's {rows} x {cols} values "
        f"(weight_block_size {list(block) if block else None})"
    )


class Quantized(Source):
    """A block-quantised weight and its scale grid in a folder: a box reads the codes it covers and
    the grid's blocks that cover those: each element the stored code times the scale of its block,
    in float32."""

    def __init__(self, weight: Stored, scale: Stored, block: tuple[int, int] | None):
        packed = weight.dtype in _PACKED
        shape = (*weight.shape[:-1], 2 * weight.shape[-1]) if packed else weight.shape
        if len(shape) < 2 or len(scale.shape) != len(shape) or scale.shape[:-2] != shape[:-2]:
            raise ValueError(
                f"{weight}: scale grid {scale.shape} ({scale.name}) does not fit the weight {shape}"
            )
        self.weight, self.scale, self.packed, self.shape = weight, scale, packed, shape
        self.block = block_shape(str(weight), *shape[-2:], scale.shape[-2:], block)
        self.origin = str(weight)

    @property
    def format(self) -> Format:
        return Format("fp4" if self.packed else "fp8", self.block, self.scale.dtype.itemsize)

    def read(self, folder: SafetensorsFolder, box: tuple[slice, ...]) -> torch.Tensor:
        (*lead, rs, cs), fmt = box, self.format
        rows, cols = rs.stop - rs.start, cs.stop - cs.start
        if rows == 0 or cols == 0 or any(s.stop == s.start for s in lead):
            return torch.empty(*(s.stop - s.start for s in box))
        # The bytes holding columns cs (FP4: two codes per byte), then the exact columns.
        code_box = fmt.code_box(box)
        values = decode(folder.read(self.weight, code_box), fmt.kind, torch.float32)
        skip = cs.start - code_box[-1].start * fmt.per_byte
        values = values[..., skip : skip + cols]
        return scaled(values, folder.read(self.scale, fmt.grid_box(box)), self.block, (rs.start, cs.start))

    def read_codes(
        self, folder: SafetensorsFolder, box: tuple[slice, ...]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the stored codes of a box as bytes, the scale blocks covering it as stored: e8m0 as its
        exponent byte), for a box that starts and ends on blocks (models/packed_weight.py checks it):
        the packed frozen base of a LoRA run, never dequantised here."""
        fmt, cs = self.format, box[-1]
        if self.packed:
            assert cs.start % 2 == 0 and (cs.stop % 2 == 0 or cs.stop == self.shape[-1]), (self.origin, box)
        codes = folder.read(self.weight, fmt.code_box(box))
        scale = folder.read(self.scale, fmt.grid_box(box))
        if scale.dtype == torch.float8_e8m0fnu:
            scale = scale.view(torch.uint8)
        return codes.view(torch.uint8), scale


def quantized_sources(
    stored: dict[str, Stored], block: tuple[int, int] | None
) -> tuple[dict[str, Source], set[str]]:
    """({weight name: Quantized source} of every block-quantised weight of a folder, the scale names
    they consume), from the headers alone; ValueError naming the file and the tensor for a scheme
    that is not DeepSeek's or a low-precision tensor without its scale."""
    foreign = [s for k, s in stored.items() if k.endswith(_FOREIGN_SUFFIXES)]
    if foreign:
        raise ValueError(
            f"{foreign[0]}: a tensor of a quantisation scheme this loader does not read (NVFP4 / static "
            f"activation scales; {len(foreign)} such tensors); dequantise the checkpoint first"
        )
    out: dict[str, Source] = {}
    for key, s in stored.items():
        scale_key = _scale_key(stored, key)
        if scale_key is not None and (s.dtype == torch.float8_e4m3fn or s.dtype in _PACKED):
            out[key] = Quantized(s, stored[scale_key], block)
    scales = {q.scale.name for q in out.values()}
    # A scale whose weight is not low-precision: the weight's line says what is wrong.
    paired = {n for k in stored if (n := _scale_key(stored, k)) is not None}
    for key, s in stored.items():
        if key in out or key in paired or s.dtype.itemsize != 1 or s.dtype == torch.bool:
            continue
        if s.dtype == torch.float8_e4m3fn or s.dtype in _PACKED:
            raise ValueError(f"{s}: quantised but has no scale (.scale or .weight_scale_inv)")
        raise ValueError(
            f"{s}: {str(s.dtype).removeprefix('torch.')} is an unknown quantisation format; only "
            "float8_e4m3fn and packed FP4 (int8 / uint8 with a scale) weights are dequantised"
        )
    return out, scales
