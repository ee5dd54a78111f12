"""DeepSeek's published low-precision checkpoint layouts load, dequantised (models/dsv4/hf_dequant.py).

The test writes them itself from a random `micro` model exported by export_hf, quantising block by
block with its own quantiser:
- V4 release: `<m>.weight` float8_e4m3fn + `<m>.scale` float32, 128 x 128 blocks, power-of-two (ue8m0)
  scales; routed experts packed FP4 (two e2m1 codes per int8, low nibble first) with one
  float8_e8m0fnu scale per 1 x 32 block (stored as its exponent byte in uint8 for layer 0's experts).
- V3 / transformers: `<m>.weight_scale_inv` float32 scales of amax / 448, 32 x 48 blocks, so that most
  grids have several blocks and partial ones at the right and bottom edges.

Checks: every loaded tensor equals the test's own decode of the stored codes (value x its block's
scale, both exact in float32), so no scale lands on the wrong block; and it is within the format's
rounding of the original weight:
- e4m3 keeps 3 mantissa bits: a normal scaled value v = w / s (|v| >= 2^-6) rounds to within
  2^-4 |v|; below, subnormal spacing 2^-9 gives |error| <= 2^-10. So |w' - w| <= 2^-4 |w| + 2^-10 s.
- e2m1 (values 0, 0.5, 1, 1.5, 2, 3, 4, 6 with s = 2^ceil(log2(amax / 6)), so |v| <= 6): spacing
  0.5 / 1 / 2 on [0, 2) / [2, 4) / [4, 6] rounds to within 2^-2 |v| for |v| >= 1 and 0.25 below, so
  |w' - w| <= 2^-2 |w| + 2^-2 s.
The float32 division and product add relative 2^-24 each, covered by a factor 1 + 1e-6.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors, load_hf
from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources
from titan_thd.models.dsv4.hf_names import to_reference
from titan_thd.models.hf.io import SafetensorsFolder

POSITIVE_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
FP8_MAX = 448.0


def _blocks(rows, cols, bm, bn):
    for i in range(math.ceil(rows / bm)):
        for j in range(math.ceil(cols / bn)):
            yield i, j, (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))


def quantize_fp8(w, bm, bn, pow2):
    """(e4m3 codes, float32 scale grid, test's decode, scale of every element)."""
    grid = torch.empty(math.ceil(w.shape[0] / bm), math.ceil(w.shape[1] / bn))
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    decoded, s_full = torch.empty_like(w), torch.empty_like(w)
    for i, j, blk in _blocks(*w.shape, bm, bn):
        amax = float(w[blk].abs().max())
        s = 2.0 ** math.ceil(math.log2(amax / FP8_MAX)) if pow2 else amax / FP8_MAX
        grid[i, j] = s
        codes[blk] = (w[blk] / grid[i, j]).to(torch.float8_e4m3fn)
        decoded[blk] = codes[blk].float() * grid[i, j]
        s_full[blk] = grid[i, j]
    return codes, grid, decoded, s_full


def quantize_fp4(w):
    """(packed int8 codes [out, in/2], e8m0 scales [out, in/32], test's decode, scale of every element)."""
    rows, cols = w.shape
    blocks = w.reshape(rows, cols // 32, 32)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1) / 6.0)))
    v = blocks / scale[..., None]
    mag = (v.abs()[..., None] - POSITIVE_E2M1).abs().argmin(-1)
    code = (mag + 8 * (v < 0)).to(torch.uint8).reshape(rows, cols)
    decoded = (POSITIVE_E2M1[mag] * torch.where(v < 0, -1.0, 1.0) * scale[..., None]).reshape(rows, cols)
    s_full = scale.repeat_interleave(32, dim=1)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).view(torch.int8)
    return packed, scale.to(torch.float8_e8m0fnu), decoded, s_full


def write_quantized(src, out, *, v4: bool):
    """Quantise every linear weight of the export in `src` (router, embedding, head and norms stay fp32)
    into `out`; returns {reference name: (original, test's decode, bound)}."""
    state = load_file(str(src / "model.safetensors"))
    bm, bn = (128, 128) if v4 else (32, 48)
    expected = {}
    for key in list(state):
        w = state[key]
        if not key.endswith(".weight") or w.dim() != 2 or key in ("embed.weight", "head.weight"):
            continue
        if key.endswith("ffn.gate.weight"):
            continue
        if v4 and ".experts." in key:
            packed, scale, decoded, s = quantize_fp4(w)
            if key.startswith("layers.0."):
                scale = scale.view(torch.uint8)  # the exponent byte, as some exports store it
            state[key], state[key.removesuffix("weight") + "scale"] = packed, scale
            bound = 2.0**-2 * w.abs() + 2.0**-2 * s
        else:
            codes, grid, decoded, s = quantize_fp8(w, bm, bn, pow2=v4)
            scale_key = key.removesuffix("weight") + "scale" if v4 else key + "_scale_inv"
            state[key], state[scale_key] = codes, grid
            bound = 2.0**-4 * w.abs() + 2.0**-10 * s
        expected[key] = (w, decoded, bound * (1 + 1e-6))
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bm, bn]}
    if v4:
        cfg["quantization_config"]["scale_fmt"] = "ue8m0"
    (out / "config.json").write_text(json.dumps(cfg))
    return expected


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(3)
    model = build_dsv4(flavors["micro"])
    return model, export_hf(model, flavors["micro"], tmp_path_factory.mktemp("hf") / "fp32")


@pytest.mark.parametrize("v4", [True, False], ids=["v4_scale_fp4_experts", "v3_weight_scale_inv"])
def test_quantized_checkpoint_loads_dequantized(exported, tmp_path, v4):
    model, src = exported
    expected = write_quantized(src, tmp_path / "q", v4=v4)
    assert len(expected) > 40 and (not v4 or any(".experts." in k for k in expected))

    loaded, args = load_hf(tmp_path / "q")  # strict: an unconsumed scale would be an unexpected tensor
    assert args.architecture() == flavors["micro"].architecture()
    ours = to_reference(loaded.state_dict())  # linear weights: the reference names (experts one by one)
    for key, (original, decoded, bound) in expected.items():
        assert torch.equal(ours[key], decoded), key
        assert bool(((ours[key] - original).abs() <= bound).all()), key
        assert not torch.equal(ours[key], original), key  # really quantised
    for name, value in to_reference(model.state_dict()).items():  # the rest is bitwise the export
        if name not in expected:
            assert torch.equal(ours[name], value), name


def test_convert_hf_dequantizes_to_dcp(exported, tmp_path):
    import scripts.convert_hf as convert_hf

    model, src = exported
    write_quantized(src, tmp_path / "q", v4=True)
    assert convert_hf.main(["to-dcp", str(tmp_path / "q"), str(tmp_path / "dcp")]) == 0
    # to-dcp copies config.json with its quantization_config; the DCP shards hold float32 weights
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(tmp_path / "dcp").read_metadata().state_dict_metadata
    assert set(keys) == {f"model.{k}" for k in model.state_dict()}  # no scale tensors
    assert keys["model.layers.0.ffn.experts.w1"].properties.dtype == torch.float32


def _fp8(shape):
    return torch.randn(shape).to(torch.float8_e4m3fn)


def dequantized(state, block, folder):
    """What the loader reads of a folder holding `state`: every quantised weight, dequantised whole."""
    folder.mkdir(exist_ok=True)
    save_file(state, str(folder / "model.safetensors"))
    stored = SafetensorsFolder(folder)
    quantized, _ = quantized_sources(stored.tensors, block)
    return {k: q.read(stored, tuple(slice(0, n) for n in q.shape)) for k, q in quantized.items()}


@pytest.mark.parametrize(
    "state, message",
    [
        ({"a.weight": _fp8((4, 4))}, r"a.weight in \S+: quantised but has no scale"),
        (
            {"a.weight": torch.zeros(4, 4, dtype=torch.float8_e5m2)},
            r"a.weight in \S+: float8_e5m2 is an unknown",
        ),
        (
            {"a.weight": torch.zeros(4, 2, dtype=torch.uint8), "a.weight_scale_2": torch.ones(())},
            r"a.weight_scale_2 in \S+: .*NVFP4 / static activation scales",
        ),
        (
            {"a.weight": _fp8((200, 100)), "a.scale": torch.ones(3, 3)},
            r"a.weight in \S+: scale grid \(3, 3\) does not tile the weight's 200 x 100 values",
        ),
    ],
)
def test_unreadable_quantization_is_named(state, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        dequantized(state, (128, 128), tmp_path / "ckpt")


def test_partial_edge_blocks_follow_the_configured_block(tmp_path):
    # DeepSeek-V3's kv_a weight: [576, 7168] with a [5, 56] grid; 576 = 4.5 blocks of 128 rows.
    w = torch.ones(576, 256, dtype=torch.float8_e4m3fn)
    grid = torch.arange(1.0, 11.0).reshape(5, 2)
    out = dequantized({"kv.weight": w, "kv.weight_scale_inv": grid}, (128, 128), tmp_path / "ckpt")
    assert set(out) == {"kv.weight"}
    assert out["kv.weight"][575, 255] == 10.0 and out["kv.weight"][512, 127] == 9.0
    assert out["kv.weight"][511, 128] == 8.0 and out["kv.weight"][0, 0] == 1.0


@pytest.mark.parametrize(
    "q, message",
    [
        ({"quant_method": "gptq"}, r"quant_method = 'gptq' is not supported"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, r"fmt = 'e5m2'"),
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size = \[128\]"),
    ],
)
def test_unsupported_quantization_config_is_refused(q, message):
    with pytest.raises(ValueError, match=message):
        check_quantization_config({"quantization_config": q}, "config.json")
    assert check_quantization_config({}, "config.json") is None
