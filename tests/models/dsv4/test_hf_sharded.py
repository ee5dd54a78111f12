"""The sharded streaming HF load (models/hf/load.py, models/hf/io.py, models/dsv4/hf_adapter.py) on a
folder in the release's format (tests/models/dsv4/_release.py: several files, FP8 / FP4 with `.scale`
names), against the whole-folder reference of tests/models/dsv4/_hf_helpers.py.

- 1 process: the loader gives bitwise today's full load (every file read, dequantised whole, copied in);
  a pipeline stage (a model with layers deleted) gets its subset.
- 4 gloo processes: FSDP2 (fully_shard on a meta model, then to_empty), HSDP, TP Shard(0|1), EP
  Shard(0) on the expert stacks, EP x TP (Shard(0), Shard(k)): every rank loads its shards, the
  gathered weights are bitwise the 1-process load, and under FSDP each rank reads about a quarter of
  the folder's bytes.
- Both release layouts (44- / 46-entry compress_ratios, dspark keys, extra MTP / draft tensors,
  skipped with one logged line).
- Bad input: a missing shard, a truncated file, a misshaped tensor, an unknown quantisation format:
  one ValueError line naming the file and the tensor, and nothing written.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors.torch import load_file

from tests._dist import spawn
from tests.models.dsv4._hf_helpers import dequantize_state, load_state_dict_hf
from tests.models.dsv4._release import write_release
from tests.models.dsv4._util import build, micro
from titan_thd.models.dsv4 import build_dsv4, load_hf_into
from titan_thd.models.dsv4.hf_config import args_from_hf_config
from titan_thd.models.dsv4.hf_dequant import check_quantization_config
from titan_thd.models.hf.io import SafetensorsFolder

ARGS = micro()


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    model = build(ARGS, seed=4, dtype=torch.float32)
    root = tmp_path_factory.mktemp("release")
    return write_release(model, ARGS, root / "r44"), root


def full_load(path) -> dict[str, torch.Tensor]:
    """Today's full load: every file read, dequantised whole, copied into a built model."""
    state = {}
    for f in sorted(path.glob("*.safetensors")):
        state |= load_file(f)
    cfg = json.loads((path / "config.json").read_text())
    model = build_dsv4(args_from_hf_config(cfg))
    load_state_dict_hf(model, dequantize_state(state, check_quantization_config(cfg, "c")))
    return model.state_dict()


def nan_model() -> torch.nn.Module:
    model = build_dsv4(ARGS)
    with torch.no_grad():
        for t in model.state_dict().values():
            t.fill_(float("nan") if t.is_floating_point() else -1)
    return model


def test_one_process_is_bitwise_the_full_load(release):
    path, _ = release
    assert (path / "model.safetensors.index.json").is_file()
    want = full_load(path)
    model = nan_model()
    stats = load_hf_into(model, path)
    assert stats.bytes_read == stats.folder_bytes  # one process reads everything, once
    got = model.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # a pipeline stage: the full model with other ranks' layers and end modules deleted
    stage = nan_model()
    del stage.layers["0"], stage.layers["3"]
    stats = load_hf_into(stage, path)
    assert 0 < stats.bytes_read < stats.folder_bytes
    for k, v in stage.state_dict().items():
        assert torch.equal(v, want[k]), k


def test_the_0731_layout_loads_and_skips_extras_in_one_line(release, caplog):
    path, root = release
    model = build(ARGS, seed=4, dtype=torch.float32)
    other = write_release(model, ARGS, root / "r46", layout46=True, extras=True)
    cfg = json.loads((other / "config.json").read_text())
    assert len(cfg["compress_ratios"]) == ARGS.n_layers + 3 and "dspark_block_size" in cfg
    assert args_from_hf_config(cfg).architecture() == ARGS.architecture()
    loaded = nan_model()
    with caplog.at_level(logging.WARNING, logger="titan_thd.models.hf.load"):
        load_hf_into(loaded, other)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and "skipped 2" not in lines[0] and "dspark.proj.weight" in lines[0], lines
    want = full_load(path)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, want[k]), k


# ---------------------------------------------------------------------------------------- 4 ranks
def _layouts(mesh1, mesh2):
    from torch.distributed.tensor import Replicate, Shard

    experts = ("experts.w1", "experts.w2", "experts.w3")

    def tp(i, name, p):
        return [Shard(i % 2 if p.dim() > 1 else 0)] if p.dim() else [Replicate()]

    def ep(i, name, p):
        return [Shard(0)] if name.endswith(experts) else [Replicate()]

    def ep_tp(i, name, p):
        if name.endswith(experts):
            return [Shard(0), Shard(2 if name.endswith("w2") else 1)]
        return [Replicate(), Shard(0) if p.dim() else Replicate()]

    def hsdp(i, name, p):
        return [Replicate(), Shard(0) if p.dim() else Replicate()]

    return {"tp": (mesh1, tp), "ep": (mesh1, ep), "ep_tp": (mesh2, ep_tp), "hsdp": (mesh2, hsdp)}


def _distributed(mesh, placements_of) -> torch.nn.Module:
    """The model with every parameter a DTensor of NaN (placements per name) and buffers of -1/NaN."""
    from torch.distributed.tensor import distribute_tensor

    model = nan_model()
    for i, (name, p) in enumerate(list(model.named_parameters())):
        owner, _, leaf = name.rpartition(".")
        d = distribute_tensor(p.detach(), mesh, placements_of(i, name, p), src_data_rank=None)
        model.get_submodule(owner).register_parameter(leaf, torch.nn.Parameter(d))
    return model


def _gathered(model) -> dict[str, torch.Tensor]:
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def _body(rank, world, path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    out = {}
    with torch.device("meta"):  # FSDP2 the trainer's way: shard on meta, allocate only the shards
        model = build_dsv4(ARGS)
    for layer in model.layers.values():
        fully_shard(layer, mesh=init_device_mesh("cpu", (world,)))
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    model.to_empty(device="cpu")
    stats = load_hf_into(model, path)
    out["fsdp"] = (stats.bytes_read, stats.folder_bytes, _gathered(model))
    mesh1, mesh2 = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
    for name, (mesh, placements_of) in _layouts(mesh1, mesh2).items():
        model = _distributed(mesh, placements_of)
        stats = load_hf_into(model, path)
        out[name] = (stats.bytes_read, stats.folder_bytes, _gathered(model))
    return {k: (b, total, state if rank == 0 else None) for k, (b, total, state) in out.items()}


def test_every_layout_loads_its_shards_bitwise(release):
    path, _ = release
    want = full_load(path)
    results = spawn(_body, 4, path)
    for layout, (_, _, got) in results[0].items():
        assert list(got) == list(want), layout
        for k, v in want.items():
            assert torch.equal(got[k], v), (layout, k)
    shares = [r["fsdp"][0] / r["fsdp"][1] for r in results]
    print("FSDP over 4: share of the folder's bytes read per rank", [round(s, 3) for s in shares])
    assert all(0.2 <= s <= 0.3 for s in shares), shares
    # EP over 4: a quarter of the routed experts (packed FP4 + scales), everything else whole
    folder = SafetensorsFolder(path)
    experts = sum(folder.read(s).nbytes for k, s in folder.tensors.items() if ".ffn.experts." in k)
    want_share = 1 - 0.75 * experts / folder.total_bytes
    assert all(r["ep"][0] / r["ep"][1] == pytest.approx(want_share) for r in results)


# ---------------------------------------------------------------------------------------- bad input
def _copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _second_file(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    return sorted(set(index.values()))[1], index


def _missing(path):
    name, _ = _second_file(path)
    (path / name).unlink()
    return rf"{name} for \S+ \(\d+ tensors\), but that file is missing"


def _truncated(path):
    name, _ = _second_file(path)
    data = (path / name).read_bytes()
    (path / name).write_bytes(data[: len(data) - 100])
    return rf"{name}: truncated: \S+ ends at byte \d+, the file has \d+ bytes"


def _misshaped(path):
    from safetensors.torch import save_file

    name, index = _second_file(path)
    state = load_file(path / name)
    key = next(k for k, v in state.items() if v.dtype == torch.float32 and v.dim() == 1)
    state[key] = torch.zeros(3)
    save_file(state, path / name)
    return rf"wrong shape: \S+: \(3,\) vs model \(\d+,\) \({key} in \S+{name}\)"


def _unknown_format(path):
    from safetensors.torch import save_file

    name, index = _second_file(path)
    state = load_file(path / name)
    key = next(k for k, v in state.items() if v.dtype == torch.float8_e4m3fn)
    state[key] = state[key].view(torch.float8_e5m2)
    save_file(state, path / name)
    return rf"{key} in \S+{name}: float8_e5m2 is an unknown quantisation format"


@pytest.mark.parametrize("spoil", [_missing, _truncated, _misshaped, _unknown_format])
def test_bad_input_is_one_line_and_writes_nothing(release, tmp_path, spoil):
    path = _copy(release[0], tmp_path / "bad")
    message = spoil(path)
    model = nan_model()
    with pytest.raises(ValueError, match=message) as e:
        load_hf_into(model, path)
    assert "\n" not in str(e.value)
    assert all(
        v.isnan().all() if v.is_floating_point() else (v == -1).all() for v in model.state_dict().values()
    )
