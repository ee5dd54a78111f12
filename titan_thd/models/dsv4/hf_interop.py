"""Hugging Face DeepSeek-V4 checkpoints <-> titan_thd dsv4 (docs/dsv4.md §17).

The names live in hf_names.py (ours, DeepSeek's "reference" release spelling, transformers' module
names), the config in hf_config.py, the sharded streaming load in hf_load.py, the dequantisation of
DeepSeek's published FP8 / FP4 weights in hf_dequant.py. `load_hf` accepts any mix of the spellings;
`export_hf` writes the reference spelling (config.json in the transformers format) in files of
bounded size, which `DeepseekV4ForCausalLM.from_pretrained` loads.

    model, args = load_hf("ckpt_dir")             # args from config.json
    model, args = load_hf("ckpt_dir", "tiny")     # ValueError unless config.json matches the flavor
    export_hf(model, args, "out_dir", tokenizer=tok)   # + tokenizer files, bos / eos / pad ids
    load_hf_into(sharded_model, "ckpt_dir")       # each rank reads only its slices
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from titan_thd.data.tokenizer import Tokenizer
from titan_thd.models.dsv4.args import DSv4Args
from titan_thd.models.dsv4.hf_config import (
    args_from_hf_config,
    check_hf,
    hf_args,
    hf_config_from_args,
    match_args,
    read_hf_config,
)
from titan_thd.models.dsv4.hf_load import load_hf_into
from titan_thd.models.dsv4.hf_names import (
    reference_items,
    split_experts,
    stack_experts,
    to_ours,
    to_reference,
)
from titan_thd.models.dsv4.model import DSv4Model, build_dsv4
from titan_thd.models.hf.tokenizer import special_token_ids, write_tokenizer
from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE, DcpSource, ModelSource, write_weights

logger = logging.getLogger(__name__)

__all__ = [
    "args_from_hf_config",
    "check_hf",
    "export_hf",
    "export_hf_from",
    "hf_args",
    "hf_config_from_args",
    "load_hf",
    "load_hf_into",
    "load_state_dict_hf",
    "read_hf_config",
    "split_experts",
    "stack_experts",
    "to_ours",
    "to_reference",
]


def load_state_dict_hf(
    model: DSv4Model, hf_state: dict[str, torch.Tensor], where: str = "checkpoint"
) -> None:
    """Copy an HF-named state dict into `model`; ValueError naming missing / unexpected / misshaped tensors.

    Checkpoints written by transformers carry no MTP weights (it never instantiates MTP): when every
    `mtp.*` tensor is absent the MTP block keeps its initialisation and a warning says so.
    """
    ours = to_ours(hf_state)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(ours))
    unexpected = sorted(set(ours) - set(expected))
    mtp_expected = [k for k in expected if k.startswith("mtp.")]
    if mtp_expected and set(mtp_expected) <= set(missing):
        logger.warning("%s has no MTP weights; the MTP block keeps its initialisation", where)
        missing = [k for k in missing if not k.startswith("mtp.")]
    if missing or unexpected:
        raise ValueError(
            f"{where} does not fit the dsv4 model: {len(missing)} missing tensors {missing[:20]}"
            f"{' ...' if len(missing) > 20 else ''}; {len(unexpected)} unexpected tensors {unexpected[:20]}"
        )
    shapes = [
        f"{k}: {tuple(ours[k].shape)} vs model {tuple(v.shape)}"
        for k, v in expected.items()
        if k in ours and ours[k].shape != v.shape
    ]
    if shapes:
        raise ValueError(f"{where}: tensors with the wrong shape: " + "; ".join(shapes[:20]))
    with torch.no_grad():
        for k, v in expected.items():
            if k in ours:
                v.copy_(ours[k].to(v.dtype))


def load_hf(path: str | Path, flavor_or_args: str | DSv4Args | None = None) -> tuple[DSv4Model, DSv4Args]:
    """(model, args) from an HF DeepseekV4 folder (config.json + *.safetensors), fp32 on CPU.

    `flavor_or_args`: a flavor name or DSv4Args the checkpoint must match (its training knobs such
    as loss weights are kept); None takes everything from config.json.
    """
    path = Path(path)
    model = build_dsv4(match_args(hf_args(path), flavor_or_args, str(path / "config.json")))
    load_hf_into(model, path)
    return model, model.args


def export_hf(
    model: DSv4Model,
    args: DSv4Args,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    **options,
) -> Path:
    """Write `model` as an HF folder (`export_hf_from` with the model's state dict as the source)."""
    return export_hf_from(ModelSource(model), args, out_dir, dtype, **options)


def export_hf_from(
    source: ModelSource | DcpSource,
    args: DSv4Args,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_source: str | Path | None = None,
    context: int = 0,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> Path:
    """Write config.json + safetensors files of at most `max_shard_size` bytes (reference names, with
    model.safetensors.index.json when there are several) that transformers can load, streaming
    `source` (models/hf/write.py: our names -> tensors, a model's or a DCP checkpoint's) a group of
    tensors at a time; the spec's `export_hf`.

    With `tokenizer` (the run's; `tokenizer_source` its tokenizer.json path, if any) the folder also
    gets the tokenizer files and generation_config.json, and config.json its bos / eos / pad ids, so
    that `generate` stops at the end of a turn (models/hf/tokenizer.py). `context`: the longest
    sequence trained (the tokenizer's model_max_length). With a process group only rank 0 writes
    (every rank gathers a model's DTensors)."""
    import torch.distributed as dist

    out = Path(out_dir)
    write = not dist.is_initialized() or dist.get_rank() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)
    write_weights(source, out, lambda k, v: reference_items(k, v, dtype), max_shard_size, write)
    if not write:
        return out
    params_dtype = dtype or next(iter(source.entries().values()))[1]
    token_ids = None
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, tokenizer_source, context)
        token_ids = special_token_ids(tokenizer)
    config = hf_config_from_args(args, params_dtype, token_ids)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
