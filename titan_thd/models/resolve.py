"""The `[model]` section resolved for start-up (titan_thd/startup.py), by the models' package: the
family, the flavor, the args ([model.args] over the flavor's or the checkpoint's config.json), the
tokenizer's vocabulary fitted, and model.hf_path opened once (models/hf/folder.py `HFFolder`).

    spec, flavor, label, tokenizer, model_args, folder = resolve_model(cfg)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from titan_thd.config import Config
from titan_thd.data.tokenizer import Tokenizer, build_tokenizer
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.models.hf.folder import HFFolder
from titan_thd.models.spec import ModelSpec


def resolve_model(cfg: Config) -> tuple[ModelSpec, str, str, Tokenizer, Any, HFFolder | None]:
    """(spec, flavor, label, tokenizer, model args, the opened model.hf_path) of the configured model;
    a checkpoint's config.json and safetensors headers are read, once (never its weights)."""
    m = cfg.model
    spec = get_model_spec(m.name)
    if m.hf_path and (spec.hf is None or not spec.hf.initialises):
        raise ValueError(
            f"model.hf_path = {m.hf_path!r}: model {m.name} cannot be initialised from a "
            "Hugging Face checkpoint (its ModelSpec.hf does not offer model.hf_path); leave model.hf_path empty"
        )
    # An empty flavor with a checkpoint: the architecture is the checkpoint's config.json (read below,
    # once the folder is known to exist); its args dataclass is the default flavor's.
    from_hf = bool(m.hf_path) and not m.flavor
    # Named from here on (log header, checkpoint fingerprint): a run that leaves it empty resumes
    # one that named the default and the other way round.
    flavor = m.flavor or ("" if from_hf else spec.default_flavor or next(iter(spec.flavors)))
    label = model_label(m.name, flavor, m.hf_path)
    args = get_model_args(m.name, flavor, m.args)  # "": the default flavor's dataclass, replaced below
    tokenizer = build_tokenizer(cfg.data.tokenizer, cfg.data.chat_template)
    folder = None
    if m.hf_path:  # the checkpoint fixes the embedding size
        if not Path(m.hf_path).is_dir():
            raise ValueError(f"model.hf_path = {m.hf_path!r}: the folder does not exist (or is not a folder)")
        folder = HFFolder(spec, m.hf_path, prefix=f"model.hf_path = {m.hf_path!r}: ")
        vocab_size = folder.vocab_size(tokenizer.vocab_size)
    else:  # a multiple of 64 rows (matmul-friendly; the extra ids are never seen)
        vocab_size = -(-tokenizer.vocab_size // 64) * 64
    if folder is not None and from_hf:  # config.json's architecture, [model.args] (typed above) over it
        args = dataclasses.replace(folder.args, **{k: getattr(args, k) for k in m.args})
    model_args = dataclasses.replace(args, vocab_size=vocab_size)
    if folder is not None:  # config.json and the safetensors headers only
        folder.check(model_args, "its own config.json" if from_hf else f"model.flavor = {flavor!r}")
    return spec, flavor, label, tokenizer, model_args, folder


def model_label(name: str, flavor: str, hf_path: str) -> str:
    """How messages name the model: family and flavor, or the checkpoint whose config.json is read."""
    return f"{name} {flavor}" if flavor else f"{name} (config.json of {hf_path})"
