"""A Hugging Face folder of one family, opened once: its config.json (the one reader of that file),
the args it describes, its safetensors headers, and our key -> `Source` (how each of our tensors is
read), checked against the model the args describe.

    folder = HFFolder(spec, path)                 # config.json read (ValueError naming the file)
    folder.args                                   # config.json -> the family's args
    folder.check(args, "model.flavor = 'tiny'")   # ValueError naming every difference; headers parsed
    folder.sources(args)                          # our key -> Source, checked (a meta build, once per args)
    folder.fingerprint                            # what a LoRA run records of its base (models/hf/io.py)

Start-up opens `model.hf_path` once and the `Run` carries it (`Run.hf`); the load (`load_into`, models/
hf/load.py), the frozen base (models/hf/base.py) and to-dcp read that one folder, so config.json and
the headers are read once per start-up. Reading a folder needs only what `HFFamily` names of a
`ModelSpec` (models/hf/adapter.py).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from titan_thd.config.jsonfile import read_json_object
from titan_thd.models.hf.adapter import HFAdapter, HFFamily
from titan_thd.models.hf.io import SafetensorsFolder, Source, check_fits, folder_fingerprint

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.json"


def adapter_of(family: HFFamily) -> HFAdapter:
    """The family's adapter; ValueError when the family has no Hugging Face format."""
    if family.hf is None:
        raise ValueError(f"model {family.name} has no Hugging Face format (its ModelSpec.hf is None)")
    return family.hf


def read_config(path: str | Path, prefix: str = "") -> dict:
    """config.json of a Hugging Face folder, the one reader of that file; ValueError `<prefix>...`
    naming the folder or the file (and line) when it is not a folder, missing or not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(
            f"{prefix}{path}: not a folder (a Hugging Face folder holds config.json + *.safetensors)"
        )
    return read_json_object(path / CONFIG_FILE, prefix, missing=" (a Hugging Face folder holds config.json)")


def match_args(
    family: HFFamily, ckpt: Any, flavor_or_args: str | Any | None, where: str, name: str = "the given args"
) -> Any:
    """The args to build: the checkpoint's (`flavor_or_args` None), or the flavor's / given ones after
    checking that their architecture is the checkpoint's (ValueError naming each differing field)."""
    if flavor_or_args is None:
        return ckpt
    if isinstance(flavor_or_args, str):
        if flavor_or_args not in family.flavors:
            raise ValueError(
                f"{family.name} flavor {flavor_or_args!r} is unknown; expected one of {list(family.flavors)}"
            )
        wanted, name = family.flavors[flavor_or_args], f"flavor {flavor_or_args!r}"
    else:
        wanted = flavor_or_args
    architecture = adapter_of(family).architecture
    have, want = architecture(ckpt), architecture(wanted)
    diffs = [f"{k}: checkpoint {have[k]!r} vs {want[k]!r}" for k in want if have[k] != want[k]]
    if diffs:
        raise ValueError(f"{where} does not match {name}: " + "; ".join(diffs))
    return replace(wanted)


class HFFolder:
    """A Hugging Face folder of `family`, opened once (see the module docstring). `prefix` starts
    the messages about config.json (start-up's `model.hf_path = '...': `)."""

    def __init__(self, family: HFFamily, path: str | Path, prefix: str = ""):
        self.family, self.adapter, self.path = family, adapter_of(family), Path(path)
        self.config = read_config(self.path, prefix)
        self._args: Any = None
        self._headers: SafetensorsFolder | None = None
        self._planned: tuple[Any, dict[str, Source]] | None = None  # (args, their sources)
        self._fingerprint: str | None = None

    @property
    def config_file(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def args(self) -> Any:
        """The args config.json describes (training knobs at their defaults); ValueError naming the
        file when it describes what the family cannot compute."""
        if self._args is None:
            try:
                self._args = self.adapter.args_from_config(self.config, str(self.config_file))
            except (TypeError, AttributeError) as e:  # e.g. a string where a number or a table belongs
                raise ValueError(f"{self.config_file}: a value of the wrong type ({e})") from None
        return self._args

    @property
    def headers(self) -> SafetensorsFolder:
        """The safetensors files (index and every header checked, no tensor data read), parsed once."""
        if self._headers is None:
            self._headers = SafetensorsFolder(self.path)
        return self._headers

    @property
    def fingerprint(self) -> str:
        """models/hf/io.py `folder_fingerprint` of the folder, computed once (a LoRA run records it)
        from the headers as parsed: none is read twice."""
        if self._fingerprint is None:
            self._fingerprint = folder_fingerprint(self.path, self.headers)
        return self._fingerprint

    def vocab_size(self, tokenizer_vocab: int, key: str = "model.hf_path") -> int:
        """config.json's `vocab_size` (start-up: it fixes the embedding's rows, for every family);
        ValueError naming `key` and the file unless it covers the tokenizer's ids."""
        vocab, cfg_file = self.config.get("vocab_size"), self.config_file
        if vocab is None:
            raise ValueError(f"{key}: {cfg_file} has no vocab_size")
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ValueError(f"{key}: {cfg_file}: vocab_size = {vocab!r}, expected a positive integer")
        if vocab < tokenizer_vocab:
            raise ValueError(
                f"{key}: {cfg_file} has vocab_size = {vocab}, fewer rows than the tokenizer's "
                f"{tokenizer_vocab} ids (data.tokenizer must be the checkpoint's tokenizer)"
            )
        return vocab

    def check(self, args: Any, name: str = "the given args") -> None:
        """ValueError unless config.json describes `args`' architecture (`name` says where they come
        from) and the safetensors files are complete (index, headers, sizes). Cheap: start-up calls
        it before anything is built."""
        match_args(self.family, self.args, args, str(self.config_file), name)
        _ = self.headers  # parsed here: a bad file is refused before anything is built

    def sources(self, args: Any, full: nn.Module | None = None) -> dict[str, Source]:
        """Our key -> how it is read, of every tensor of the model `args` describe that the folder
        holds, checked against that model's names and shapes (ValueError naming the file and the
        tensor); headers only. `full`: that model already built on the meta device (else built here).
        A top-level module of `adapter.optional` may be absent (one warning). Planned once per args."""
        if self._planned is not None and self._planned[0] == args:
            return self._planned[1]
        self.check(args)
        adapter = self.adapter
        sources = adapter.sources(self.headers, self.config, str(self.path))
        if full is None:
            with torch.device("meta"):  # the full model's names and shapes, no memory
                full = self.family.build(args)
        expected = {k: tuple(v.shape) for k, v in full.state_dict().items()}
        if adapter.skip_unplaced:
            extras = sorted(k for k in sources if k not in expected and not _has_place(k, full))
            if extras:
                logger.warning(
                    "%s: skipped %d tensors of layers the model does not have (MTP / draft layers), e.g. %s",
                    self.path,
                    len(extras),
                    ", ".join(sources[k].origin for k in extras[:3]),
                )
                sources = {k: v for k, v in sources.items() if k not in extras}
        optional = []
        for top in adapter.optional:
            keys = [k for k in expected if k.startswith(top + ".")]
            if not any(k in sources for k in keys):
                optional += keys
        absent = check_fits(sources, expected, str(self.path), self.family.name, optional)
        if absent:
            tops = sorted({k.split(".")[0] for k in absent})
            logger.warning(
                "%s has no weights of %s; they keep their initialisation", self.path, ", ".join(tops)
            )
        self._planned = (args, sources)
        return sources


def _has_place(key: str, full: nn.Module) -> bool:
    """Whether the module a key belongs to exists in the model (its top-level module, and the entry
    of a layer list: `layers.50` or `mtp.1` do not in a 43-layer model with one MTP layer)."""
    parts = key.split(".")
    try:
        top = full.get_submodule(parts[0])
        if isinstance(top, (nn.ModuleDict, nn.ModuleList)) and len(parts) > 1:
            full.get_submodule(".".join(parts[:2]))
    except AttributeError:
        return False
    return True


def folder_args(family: HFFamily, path: str | Path) -> Any:
    """The args that a folder's config.json describes (`HFFolder(family, path).args`)."""
    return HFFolder(family, path).args


def check(family: HFFamily, args: Any, path: str | Path, name: str = "the given args") -> None:
    """`HFFolder(family, path).check(args, name)`: the folder against args before anything is built."""
    HFFolder(family, path).check(args, name)
