"""llama's HF load streams slices too (models/hf/load.py): a multi-file export (bounded files + index)
loads bitwise into a plain model, into a pipeline stage, and into TP-sharded DTensors on 2 gloo ranks;
a misshaped tensor is one line naming the file, and nothing is written."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests._dist import spawn
from titan_thd.models import get_model_spec
from titan_thd.models.hf import HFFolder, export, load_into
from titan_thd.models.llama import flavors
from titan_thd.models.llama.model import build_llama

ARGS = dataclasses.replace(flavors["debug"], vocab_size=512, n_layers=2)
SPEC = get_model_spec("llama")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    torch.manual_seed(0)
    model = build_llama(ARGS)
    out = export(SPEC, model, ARGS, tmp_path_factory.mktemp("llama") / "hf", max_shard_size=400_000)
    assert (out / "model.safetensors.index.json").is_file()
    return model.state_dict(), out


def _nan_model():
    model = build_llama(ARGS)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(float("nan"))
    return model


def test_plain_and_stage_load_bitwise(exported):
    want, path = exported
    model = _nan_model()
    assert load_into(model, HFFolder(SPEC, path)).bytes_read == sum(v.nbytes for v in want.values())
    for k, v in model.state_dict().items():
        assert torch.equal(v, want[k]), k
    stage = _nan_model()
    del stage.layers["0"]
    load_into(stage, HFFolder(SPEC, path))
    for k, v in stage.state_dict().items():
        assert torch.equal(v, want[k]), k


def _tp_body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = _nan_model()
    for i, (name, p) in enumerate(list(model.named_parameters())):
        owner, _, leaf = name.rpartition(".")
        placement = Shard(i % 2) if p.dim() == 2 else Replicate()
        d = distribute_tensor(p.detach(), mesh, [placement], src_data_rank=None)
        model.get_submodule(owner).register_parameter(leaf, torch.nn.Parameter(d))
    load_into(model, HFFolder(SPEC, path))
    return {k: v.full_tensor() for k, v in model.state_dict().items()}


def test_tp_shards_load_bitwise(exported):
    want, path = exported
    for got in spawn(_tp_body, 2, path):
        for k, v in want.items():
            assert torch.equal(got[k], v), k


def test_misshaped_tensor_is_one_line(exported, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in path.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    f = sorted(bad.glob("model-*.safetensors"))[-1]
    state = load_file(f)
    key = next(iter(state))
    state[key] = torch.zeros(3)
    save_file(state, f)
    model = _nan_model()
    with pytest.raises(
        ValueError, match=rf"wrong shape: \S+: \(3,\) vs model \(\d+.*\({key} in \S+{f.name}\)"
    ):
        load_into(model, HFFolder(SPEC, bad))
    assert all(v.isnan().all() for v in model.state_dict().values())
