"""Write a Hugging Face folder for any family: weights in files of bounded size, config.json, and the
tokenizer files, from a model or a DCP checkpoint streamed a group of tensors at a time.

    export(spec, model, model.args, "out")                                   # a model's state dict
    export(spec, DcpExport(step_dir), args, "out", tokenizer=tok, context=T)  # a trainer checkpoint

The family says only how its tensors and args are spelt (its `ModelSpec.hf`, models/hf/adapter.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_thd.data.tokenizer import Tokenizer
from titan_thd.models.hf.adapter import HFFamily
from titan_thd.models.hf.folder import CONFIG_FILE, adapter_of
from titan_thd.models.hf.tokenizer import special_token_ids, write_tokenizer
from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE, ExportTensors, ModelExport, write_weights


def _owned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous, in storage of its own (safetensors refuses tensors that share storage, such as
    the experts of one stack)."""
    t = t.contiguous()
    return t.clone() if t.untyped_storage().nbytes() != t.nbytes else t


def export(
    spec: HFFamily,
    source: nn.Module | ExportTensors,
    args: Any,
    out_dir: str | Path,
    dtype: torch.dtype | None = None,
    *,
    tokenizer: Tokenizer | None = None,
    tokenizer_source: str | Path | None = None,
    context: int = 0,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    encode: Callable[[str, str, torch.Tensor], Iterable[tuple[str, torch.Tensor]]] | None = None,
    config_extra: dict | None = None,
) -> Path:
    """Write config.json and safetensors files of at most `max_shard_size` bytes (with
    model.safetensors.index.json when there are several) that transformers loads, streaming `source`
    (a model, or an export's tensors, models/hf/write.py: our names -> tensors) a group of
    tensors at a time; floating tensors in `dtype` (None = as stored).

    With `tokenizer` (the run's; `tokenizer_source` its tokenizer.json path, if any) the folder also
    gets the tokenizer files and generation_config.json, and config.json its bos / eos / pad ids, so
    that `generate` stops at the end of a turn (models/hf/tokenizer.py). `context`: the longest
    sequence trained (the tokenizer's model_max_length; 0 = not known). With a process group only
    rank 0 writes (every rank gathers a model's DTensors). scripts/convert_hf.py to-hf calls it.

    `encode(our key, stored name, tensor)` -> the stored (name, tensor) pairs instead of the tensor
    (models/hf/released.py: FP8 / FP4 codes and their scales); `config_extra` is merged into
    config.json (its `quantization_config`)."""
    import torch.distributed as dist

    adapter = adapter_of(spec)
    if isinstance(source, nn.Module):
        source = ModelExport(source)
    out = Path(out_dir)
    write = not dist.is_initialized() or dist.get_rank() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)

    def items(key: str, value: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        cast = dtype if dtype is not None and value.is_floating_point() else value.dtype
        for name, tensor in adapter.to_hf(key, value):
            if encode is None:
                yield name, _owned(tensor.to(cast))
                continue
            for stored_name, t in encode(key, name, tensor.to(cast)):
                yield stored_name, _owned(t)

    write_weights(source, out, items, max_shard_size, write)
    if not write:
        return out
    token_ids = None
    if tokenizer is not None:
        write_tokenizer(tokenizer, out, tokenizer_source, context)
        token_ids = special_token_ids(tokenizer)
    params_dtype = dtype or next(iter(source.entries().values()))[1]
    config = adapter.config_from_args(args, params_dtype, token_ids, context) | (config_extra or {})
    (out / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return out
