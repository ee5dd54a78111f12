"""A trainer checkpoint written before the routed experts were stacked (one tensor per expert) -> the
same checkpoint with [E, out, in] stacks, model and optimizer state, resumable (scripts/convert_hf.py
stack-experts).

    line = stack_checkpoint(Path("outputs/x/checkpoint/step-60"), Path("NEW/step-60"))
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titan_thd.components.checkpoint_folder import META_FILE, PER_EXPERT_PARAM, write_meta
from titan_thd.models.hf.staging import refuse_overlap, staged

_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def _stack_per_expert(state: dict[str, Any]) -> dict[str, Any]:
    """`<layer>.ffn.experts.<e>.w1.weight` entries (the layout before stacking) -> `<layer>.ffn.experts.w1`
    [E, out, in] stacks (shapes too: meta tensors stack); other entries pass unchanged."""
    out: dict[str, Any] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    for key, value in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = value
    for key, by_id in per_expert.items():
        assert sorted(by_id) == list(range(len(by_id))), (key, sorted(by_id))
        out[key] = torch.stack([by_id[e] for e in sorted(by_id)])
    return out


_EXPERT_OPTIM = re.compile(r"^(state|param_groups)\.(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight\.(\w+)$")


def _stack_optimizer(flat: dict[str, Any]) -> dict[str, Any]:
    """Flattened optimizer state (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`) of per-expert
    parameters -> that of the stacks: tensors per expert stacked, the rest (step counts, group
    settings) the same for every expert of a layer and kept once."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[int, Any]] = {}
    for key, value in flat.items():
        m = _EXPERT_OPTIM.match(key)
        if m is None:
            out[key] = value
            continue
        kind, prefix, e, name, field = m.groups()
        groups.setdefault(f"{kind}.{prefix}.{name}.{field}", {})[int(e)] = value
    for key, by_id in groups.items():
        values = [by_id[e] for e in sorted(by_id)]
        assert sorted(by_id) == list(range(len(values))), (key, sorted(by_id))
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            out[key] = torch.stack(values)
            continue
        same = all(
            torch.equal(v, values[0]) if isinstance(v, torch.Tensor) else v == values[0] for v in values
        )
        if not same:
            raise ValueError(f"{key}: the experts differ ({values[:4]} ...); expected one value for a layer")
        out[key] = values[0]
    return out


def stack_checkpoint(src: Path, out: Path) -> str:
    """A trainer checkpoint folder (step-N) with one tensor per routed expert -> the same state with
    [E, out, in] stacks, written by one process with its meta.json (DCP reshards it on load); returns
    the summary line."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    refuse_overlap(out, {"checkpoint": src})
    if not (src / META_FILE).is_file() or not (src / ".metadata").is_file():
        raise ValueError(f"{src}: not a trainer checkpoint folder (expected {META_FILE} and .metadata)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    meta = json.loads((src / META_FILE).read_text())
    params = meta["fingerprint"]["params"]
    if not any(PER_EXPERT_PARAM.search(n) for n in params):
        raise ValueError(f"{src}: no per-expert parameters; it is already in the stacked layout")
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.simplefilter("ignore")
        state: dict[str, Any] = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(src))
    state["model"] = _stack_per_expert(state["model"])
    state["optimizer"] = _stack_optimizer(state["optimizer"])
    shapes = _stack_per_expert({k: torch.empty(v, device="meta") for k, v in params.items()})  # names, shapes
    fingerprint = meta["fingerprint"] | {"params": {k: list(v.shape) for k, v in shapes.items()}}
    with staged(out) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=True)
        write_meta(tmp, meta["step"], meta["world_size"], fingerprint)
    return f"wrote {out}: step {meta['step']}, {len(state['model'])} model tensors (experts stacked)"
