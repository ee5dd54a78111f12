"""A synthetic HF folder in the format of DeepSeek's V4-Flash release, from a model of ours.

Reference names, several files with model.safetensors.index.json, FP8 e4m3 non-expert linears with
power-of-two (ue8m0, stored as float8_e8m0fnu) 128 x 128 block scales named `<m>.scale`, routed
experts one tensor per expert as packed FP4 (two e2m1 codes per int8, low nibble first) with 1 x 32
e8m0 scales; config.json with DeepSeek's keys (`compress_ratios` with the MTP entry, 44-style, or
the -0731 release's 46-style extra entries and `dspark_*` keys). Embedding, head, router, norms and
mHC stay float32, as in the release.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tests.models.dsv4 import test_hf_fp8
from titan_thd.models.dsv4.hf_config import hf_config_from_args
from titan_thd.models.dsv4.hf_names import to_reference
from titan_thd.models.hf.write import ShardedWriter

FP8_MAX = 448.0


def quantize_fp8(w: torch.Tensor, bm: int = 128, bn: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, power-of-two scale grid [ceil(out/bm), ceil(in/bn)] as float8_e8m0fnu)."""
    rows, cols = w.shape
    grid = torch.empty(math.ceil(rows / bm), math.ceil(cols / bn))
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(grid.shape[0]):
        for j in range(grid.shape[1]):
            blk = (slice(i * bm, (i + 1) * bm), slice(j * bn, (j + 1) * bn))
            grid[i, j] = 2.0 ** math.ceil(math.log2(float(w[blk].abs().max()) / FP8_MAX))
            codes[blk] = (w[blk] / grid[i, j]).to(torch.float8_e4m3fn)
    return codes, grid.to(torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed int8 codes [out, in/2], e8m0 scales [out, in/32]): test_hf_fp8's encoder."""
    packed, scale, _, _ = test_hf_fp8.quantize_fp4(w)
    return packed, scale


def release_config(args, *, layout46: bool = False, block: tuple[int, int] = (128, 128)) -> dict:
    """config.json in DeepSeek's spelling: compress_ratios (+ the MTP entry; -0731: two more and the
    dspark keys) instead of transformers' layer_types, and the release's quantization_config."""
    cfg = hf_config_from_args(args)
    del cfg["layer_types"], cfg["compress_rates"]
    ratio = {"sliding": 0, "csa": args.csa_ratio, "hca": args.hca_ratio}
    cfg["compress_ratios"] = [ratio[t] for t in args.layer_types] + [0] * (3 if layout46 else 1)
    cfg["compress_rate_csa"], cfg["compress_rate_hca"] = args.csa_ratio, args.hca_ratio
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "weight_block_size": list(block),
        "scale_fmt": "ue8m0",
    }
    if layout46:
        cfg |= {
            "dspark_block_size": 5,
            "dspark_noise_token_id": 7,
            "dspark_target_layer_ids": [1, 2, 3],
            "dspark_markov_rank": 16,
        }
    return cfg


def write_release(
    model: torch.nn.Module,
    args,
    out: Path,
    *,
    max_shard_size: int = 200_000,
    layout46: bool = False,
    extras: bool = False,
    block: tuple[int, int] = (128, 128),
) -> Path:
    """Write `model` (float32) to `out` in the release's format; `extras`: also a second MTP layer's
    and a draft head's tensors (what -0731 ships and the model has no place for); `block`: the FP8
    scale blocks (the release's 128 x 128; smaller ones let a tiny model's cuts fall on blocks)."""
    out.mkdir(parents=True)
    writer = ShardedWriter(out, max_shard_size)
    state = to_reference({k: v.float() for k, v in model.state_dict().items()})
    if extras:
        state |= {k.replace("mtp.0.", "mtp.1."): v for k, v in state.items() if k.startswith("mtp.0.")}
        state["dspark.proj.weight"] = torch.randn(16, args.dim)
    for key, w in state.items():
        linear = key.endswith(".weight") and w.dim() == 2 and not key.endswith("ffn.gate.weight")
        if not linear or key in ("embed.weight", "head.weight") or key.startswith("dspark"):
            writer.add(key, w.contiguous())
        elif ".experts." in key:
            packed, scale = quantize_fp4(w)
            writer.add(key, packed)
            writer.add(key.removesuffix("weight") + "scale", scale)
        else:
            codes, grid = quantize_fp8(w, *block)
            writer.add(key, codes)
            writer.add(key.removesuffix("weight") + "scale", grid)
    files = writer.close()
    assert len(files) > 2, files
    (out / "config.json").write_text(json.dumps(release_config(args, layout46=layout46, block=block)))
    return out


def write_micro_release(out: Path, block: tuple[int, int], seed: int = 7) -> Path:
    """The dsv4 `micro` flavor's weights drawn from `seed`, written to `out` in the release's format
    with FP8 blocks of `block` (16 x 16 lets the micro model's tensor-parallel cuts fall on blocks)."""
    from titan_thd.models import get_model_spec

    spec = get_model_spec("dsv4")
    args = spec.flavors["micro"]
    model = spec.build(args)
    model.init_weights(seed)
    return write_release(model, args, out, block=block)
