"""Trainer checkpoints written before the routed experts were stacked: the trainer refuses them with
the conversion command, and `scripts/convert_hf.py stack-experts` turns one into exactly what the
trainer writes now (every model and optimizer entry, the rest of the state, meta.json's fingerprint).

The old layout is made here from a new checkpoint by the inverse mapping (one tensor per expert:
`layers.<i>.ffn.experts.<e>.w1.weight`, optimizer entries keyed by those names), the layout the
trainer wrote before stacking.
"""

from __future__ import annotations

import json
import re
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

import scripts.convert_hf as convert_hf
from tests.conftest import TRAIN_ARGS
from titan_thd.components.checkpoint_folder import write_meta
from titan_thd.config import load_config
from titan_thd.models.dsv4.hf_names import split_experts
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

_STACK_OPTIM = re.compile(r"^(state|param_groups)\.(.*\.ffn\.experts)\.(w[123])\.(\w+)$")


def _cfg(dump, *extra):
    return load_config(
        [
            *TRAIN_ARGS,
            *("--model.name", "dsv4", "--model.flavor", "micro", "--optimizer.name", "adamw"),
            *("--training.global_batch_size", "2", "--training.tokens_per_microbatch", "256"),
            *("--training.steps", "1", "--metrics.peak_tflops", "1", "--job.dump_folder", str(dump)),
            *("--checkpoint.enable", "true", *extra),
        ]
    )


def _read(path) -> dict:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(path))


def _unstack_optimizer(flat: dict, n_experts: int) -> dict:
    out = {}
    for key, value in flat.items():
        m = _STACK_OPTIM.match(key)
        if m is None:
            out[key] = value
            continue
        kind, prefix, name, field = m.groups()
        for e in range(n_experts):
            stacked = isinstance(value, torch.Tensor) and value.dim() > 0
            out[f"{kind}.{prefix}.{e}.{name}.weight.{field}"] = value[e].clone() if stacked else value
    return out


def _write_old_layout(new, old) -> None:
    state = _read(new)
    n_experts = state["model"]["layers.0.ffn.experts.w1"].shape[0]
    state["model"] = split_experts(state["model"])
    state["optimizer"] = _unstack_optimizer(state["optimizer"], n_experts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(old), no_dist=True)
    meta = json.loads((new / "meta.json").read_text())
    shapes = split_experts(
        {n: torch.empty(s, device="meta") for n, s in meta["fingerprint"]["params"].items()}
    )
    params = {k: list(v.shape) for k, v in shapes.items()}
    write_meta(old, meta["step"], meta["world_size"], meta["fingerprint"] | {"params": params})


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_old_checkpoint_is_refused_then_converted_exactly(tmp_path, one_thread):
    trainer = Trainer(resolve_run(_cfg(tmp_path / "run")))
    try:
        trainer.train()
    finally:
        trainer.close()
    new = tmp_path / "run" / "checkpoint" / "step-1"
    old = tmp_path / "old" / "step-1"
    _write_old_layout(new, old)
    assert (
        "layers.0.ffn.experts.3.w2.weight"
        in json.loads((old / "meta.json").read_text())["fingerprint"]["params"]
    )

    resume = Trainer(
        resolve_run(
            _cfg(tmp_path / "resume", "--checkpoint.folder", str(tmp_path / "old"), "--training.steps", "2")
        )
    )
    try:
        with pytest.raises(ValueError, match=r"before the experts were stacked.*convert_hf.py stack-experts"):
            resume.train()
    finally:
        resume.close()

    assert convert_hf.main(["stack-experts", str(old), str(tmp_path / "conv" / "step-1")]) == 0
    conv = tmp_path / "conv" / "step-1"
    got, want = _read(conv), _read(new)
    assert _same(got, want), sorted(set(got["optimizer"]) ^ set(want["optimizer"]))[:8]
    fingerprint = json.loads((conv / "meta.json").read_text())["fingerprint"]
    assert fingerprint == json.loads((new / "meta.json").read_text())["fingerprint"]
    assert convert_hf.main(["stack-experts", str(conv), str(tmp_path / "again")]) == 2  # already stacked
