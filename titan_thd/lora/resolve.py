"""The `[lora]` section resolved for start-up, by its owner: the targets against the family and the
model's shapes, the frozen base kept as released (lora.base_dtype), and the base the adapters are
trained on (the run setting a resume must match).

    plan, packed = resolve(cfg, spec.lora, meta, label, folder, spec.hf.released)   # None, {}: no LoRA

`meta` is the model on the meta device, as start-up built it once (the folder's plan was checked
against it first); the adapters are attached to it here. `folder` is model.hf_path as start-up opened
it (models/hf/folder.py `HFFolder`), None without one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from torch import nn

from titan_thd.components import run_settings
from titan_thd.config import Config
from titan_thd.lora.targets import LoRAPlan, attach, resolve_lora
from titan_thd.models.hf.folder import HFFolder
from titan_thd.models.hf.quant import Format
from titan_thd.models.packed_weight import packed_plan
from titan_thd.models.projection import LoRATargets


def resolve(
    cfg: Config,
    family: LoRATargets | None,
    meta: nn.Module | None,
    label: str,
    folder: HFFolder | None,
    released: Callable[[str, tuple[int, ...]], Format | None] | None,
) -> tuple[LoRAPlan | None, dict[str, Format]]:
    """(lora.* against the family's targets and `meta`'s shapes, with the base setting; the packed-base
    plan: {key: how the folder stores it} of the frozen weights kept as released, lora.base_dtype =
    released); ValueError naming the field, the value and the choices. (None, {}) when lora.enable is
    false."""
    c = cfg.lora
    if not c.enable:
        return None, {}
    assert meta is not None  # start-up builds it for a LoRA run
    plan = resolve_lora(c.targets, c.rank, c.alpha, c.rslora, family, meta, label)
    path = cfg.model.hf_path
    # The folder's plan is checked against the model without adapters (start-up did so: cached).
    sources = folder.sources(meta.args, meta) if folder is not None else {}
    attach(meta, plan)
    resident = {}
    if c.base_dtype == "released":
        frozen = {k: tuple(p.shape) for k, p in meta.named_parameters() if not p.requires_grad}
        resident = _resident(cfg, sources, frozen, released)
    fingerprint = folder.fingerprint if folder is not None else None
    return dataclasses.replace(plan, base=run_settings.base_setting(path, fingerprint)), resident


def _resident(
    cfg: Config,
    sources: Mapping[str, object],
    frozen: dict[str, tuple[int, ...]],
    released: Callable[[str, tuple[int, ...]], Format | None] | None,
) -> dict[str, Format]:
    """lora.base_dtype = released: the frozen weights the folder stores block-quantised (headers only),
    or, on a fake-process-group dry run without a folder, those the family's release stores so."""
    path = cfg.model.hf_path
    if path:
        plan = packed_plan(sources, set(frozen))
        if not plan:
            raise ValueError(
                f"lora.base_dtype = 'released': model.hf_path = {path!r} stores no block-quantised weight "
                "(FP8 e4m3 or packed FP4 with a scale grid), so nothing stays as released; use "
                "lora.base_dtype = 'master'"
            )
        return plan
    if cfg.comm.mode == "fake" and released is not None:
        return {k: f for k, shape in frozen.items() if (f := released(k, shape)) is not None}
    raise ValueError(
        "lora.base_dtype = 'released' needs model.hf_path, the release-format folder the frozen base is "
        f"read from as stored (a COMM_MODE=fake dry run plans model {cfg.model.name}'s published format "
        "without one)"
    )
