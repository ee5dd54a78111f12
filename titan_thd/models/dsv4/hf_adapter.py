"""dsv4's Hugging Face format (`HF`, the spec's `hf`): DeepSeek-V4 folders <-> our model (docs/dsv4.md §17).

The names live in hf_names.py (ours, DeepSeek's "reference" release spelling, transformers' module
names), the config keys in hf_config.py, the dequantisation of DeepSeek's published FP8 / FP4 weights
in hf_dequant.py; the load and the export themselves are every family's (models/hf/). A folder may
hold any mix of the spellings; the export writes the reference spelling with a transformers
config.json, which `DeepseekV4ForCausalLM.from_pretrained` loads.

From the headers alone `dsv4_sources` plans how each of our tensors is made of stored ones (names
mapped, per-expert tensors stacked, transformers' fused experts split, FP8 / FP4 weights paired with
their scales); each rank then reads only its boxes, dequantising only the scale blocks a box covers.
The result is bitwise what reading the whole folder and copying it in gives
(tests/models/dsv4/test_hf_sharded.py). Tensors of layers the model does not have (a second MTP
layer, layers past num_hidden_layers, a draft head such as DeepSeek-V4-Flash-0731's `dspark`) are
skipped with one logged line; a folder without MTP weights (transformers writes none) leaves the MTP
block at its initialisation.
"""

from __future__ import annotations

import torch

from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.hf_config import args_from_hf_config, hf_config_from_args
from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources
from titan_thd.models.dsv4.hf_names import hf_module, reference_items, stored_to_ours
from titan_thd.models.hf.adapter import HFAdapter
from titan_thd.models.hf.io import Narrowed, Plain, SafetensorsFolder, Source, Stacked
from titan_thd.models.hf.quant import Format


def dsv4_sources(folder: SafetensorsFolder, config: dict, where: str) -> dict[str, Source]:
    """Our name -> how to read it, for every tensor of the folder (headers only)."""
    block = check_quantization_config(config, f"{where}/config.json")
    quantized, scales = quantized_sources(folder.tensors, block)
    sources: dict[str, Source] = {}
    experts: dict[str, dict[int, Source]] = {}

    def put(key: str, source: Source, into: dict) -> None:
        if key in into:
            raise ValueError(f"{where}: {source.origin} and {into[key].origin} are both {key}")
        into[key] = source

    for name, stored in folder.tensors.items():
        if name in scales:
            continue
        source = quantized.get(name) or Plain(stored)
        key, expert, part = stored_to_ours(name)
        if expert is not None:
            put(str(expert), source, experts.setdefault(key, {}))
        elif part is not None:  # gate_up_proj [E, 2F, d]: w1 then w3 on dim 1 (torch.chunk's halves)
            rows = source.shape[1]
            half = -(-rows // 2)
            put(key, Narrowed(source, 1, 0, half), sources)
            put(key.removesuffix("w1") + "w3", Narrowed(source, 1, half, rows - half), sources)
        else:
            put(key, source, sources)
    for key, by_id in experts.items():
        ids = sorted(int(e) for e in by_id)
        if ids != list(range(len(ids))):
            absent = sorted(set(range(ids[-1] + 1)) - set(ids))
            raise ValueError(
                f"{where}: {key}: experts {absent} are missing (the checkpoint has experts "
                f"{ids[0]}..{ids[-1]}, e.g. {by_id[str(ids[0])].origin})"
            )
        put(key, Stacked([by_id[str(e)] for e in ids]), sources)
    return sources


def args_from_config(config: dict, where: str) -> DSv4Args:
    """DSv4Args of a folder's config.json, after refusing a quantisation this loader cannot read."""
    check_quantization_config(config, where)
    return args_from_hf_config(config, where)


def config_from_args(args: DSv4Args, dtype: torch.dtype, token_ids: dict | None, context: int) -> dict:
    """transformers' DeepseekV4Config of `args` (`context` unused: the RoPE has no length limit)."""
    return hf_config_from_args(args, dtype, token_ids)


def released(key: str, shape: tuple[int, ...]) -> Format | None:
    """How DeepSeek's V4 release stores our tensor `key` (docs/dsv4.md §17): routed experts packed FP4
    with 1 x 32 e8m0 scales, every other matrix FP8 e4m3 with 128 x 128 ue8m0 scales but the
    embedding, the head and the routers (float)."""
    if ".ffn.experts.w" in key and len(shape) == 3:
        return Format("fp4", (1, 32), 1)
    if len(shape) == 2 and key.endswith(".weight") and key not in ("embed.weight", "head.weight"):
        return None if key.endswith(".ffn.gate.weight") else Format("fp8", (128, 128), 1)
    return None


HF = HFAdapter(
    to_hf=reference_items,
    sources=dsv4_sources,
    config_from_args=config_from_args,
    args_from_config=args_from_config,
    architecture=DSv4Args.architecture,
    hf_module=hf_module,
    optional=("mtp",),
    skip_unplaced=True,
    released=released,
)
