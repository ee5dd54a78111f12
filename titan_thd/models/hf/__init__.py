"""The one Hugging Face door of every model family.

A family writes only its `HFAdapter` (adapter.py: tensor names both ways, config.json both ways,
transformers' module names) and sets `ModelSpec.hf`; everything else is here, once:

    adapter.py    HFAdapter, `rename` (the one rename rule), helpers for one-to-one families
    load.py       config.json (the one reader), folder args and checks, the sharded load
    export.py     the export of a model or a DCP checkpoint (rank 0 writes), with the tokenizer files
    io.py         safetensors headers and slices; Source (how one of our tensors is read)
    quant.py      the FP8 / FP4 block formats of DeepSeek's releases (Format, decode, scales)
    write.py      ModelSource / DcpSource (our tensors, a group at a time), files of bounded size
    tokenizer.py  tokenizer.json, tokenizer_config.json, generation_config.json of the run's tokenizer
"""

from titan_thd.models.hf.adapter import HFAdapter, module_name, plain_sources, rename
from titan_thd.models.hf.export import export
from titan_thd.models.hf.load import (
    check,
    folder_args,
    folder_sources,
    load,
    load_into,
    match_args,
    read_config,
    vocab_size,
)

__all__ = [
    "HFAdapter",
    "check",
    "export",
    "folder_args",
    "folder_sources",
    "load",
    "load_into",
    "match_args",
    "module_name",
    "plain_sources",
    "read_config",
    "rename",
    "vocab_size",
]
