"""The one Hugging Face door of every model family.

A family writes only its `HFAdapter` (adapter.py: tensor names both ways, config.json both ways,
transformers' module names) and sets `ModelSpec.hf`; everything else is here, once:

    adapter.py    HFAdapter, `rename` (the one rename rule), helpers for one-to-one families; HFFamily
    folder.py     HFFolder: a folder opened once (config.json, headers, our key -> Source, fingerprint)
    load.py       the sharded load of a folder into a model
    base.py       the frozen base from a folder or a seed (init_base, FrozenBase)
    export.py     the export of a model or a DCP checkpoint (rank 0 writes), with the tokenizer files
    io.py         safetensors headers and slices; Source (how one of our tensors is read: HF -> ours)
    quant.py      the FP8 / FP4 block formats of DeepSeek's releases (Format, decode, scales)
    write.py      ModelExport / DcpExport (our tensors, a group at a time: ours -> HF), SafetensorsFile
    to_dcp.py     a folder -> a DCP checkpoint, one tensor at a time
    tokenizer.py  tokenizer.json, tokenizer_config.json, generation_config.json of the run's tokenizer

Exporting a run (the whole model, the merged model, the adapters) starts at titan_thd/export/.
"""

from titan_thd.models.hf.adapter import HFAdapter, HFFamily, module_name, plain_sources, rename
from titan_thd.models.hf.base import FrozenBase, init_base
from titan_thd.models.hf.export import export
from titan_thd.models.hf.folder import HFFolder, check, folder_args, match_args, read_config
from titan_thd.models.hf.load import load, load_into

__all__ = [
    "FrozenBase",
    "HFAdapter",
    "HFFamily",
    "HFFolder",
    "check",
    "export",
    "folder_args",
    "init_base",
    "load",
    "load_into",
    "match_args",
    "module_name",
    "plain_sources",
    "read_config",
    "rename",
]
