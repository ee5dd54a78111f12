"""CheckpointManager: bitwise round trips, atomic saves, resume selection, errors, signals,
and resharding between 2 FSDP ranks and 1 process (references: the objects that were saved)."""

import contextlib
import errno
import io
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

from tests._dist import spawn
from tests.components._ckpt_worker import TrainState, build, manager, train_step
from titan_thd.components import checkpoint as C
from titan_thd.components.checkpoint import CheckpointError, CheckpointManager
from titan_thd.components.checkpoint_folder import model_fingerprint
from titan_thd.components.optimizer import OptimizersContainer
from titan_thd.config import Checkpoint

REPO = Path(__file__).resolve().parents[2]


class DataState:
    def __init__(self, **kw):
        self.state = kw

    def state_dict(self):
        return dict(self.state)

    def load_state_dict(self, sd):
        self.state = dict(sd)


def _flat_optim(model, opt, full=False):
    opts = StateDictOptions(flatten_optimizer_state_dict=True, full_state_dict=full)
    return get_optimizer_state_dict(model, opt, options=opts)


def _assert_same(a: dict, b: dict):
    assert a.keys() == b.keys()
    for k, v in a.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(v, b[k]), k
        else:
            assert v == b[k], k


def _trained(tmp_path, steps=3, seed=0, **cfg):
    model, opt, sched = build(seed)
    state = TrainState()
    for step in range(1, steps + 1):
        train_step(model, opt, sched, step)
    state.step = steps
    return model, opt, sched, state, manager(tmp_path, model, opt, sched, state, **cfg)


def test_round_trip_is_bitwise(tmp_path):
    model, opt, sched, _, mgr = _trained(tmp_path, interval=100)
    data = DataState(epoch=1, cursor=77, seed=5, step=3, nested={"a": [1, 2]})
    mgr.states["data"] = data
    rng = torch.get_rng_state()
    mgr.save(3, force=True)
    assert (tmp_path / "checkpoint" / "step-3" / ".metadata").is_file()

    torch.manual_seed(999)  # the RNG state must come back from the checkpoint
    model2, opt2, sched2 = build(seed=1)
    state2, data2 = TrainState(), DataState()
    mgr2 = manager(tmp_path, model2, opt2, sched2, state2)
    mgr2.states["data"] = data2
    assert mgr2.load() == 3
    _assert_same(model.state_dict(), model2.state_dict())
    _assert_same(_flat_optim(model, opt), _flat_optim(model2, opt2))
    assert (
        sched.state_dict() == sched2.state_dict() and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]
    )
    assert (state2.step, data2.state) == (3, data.state)
    assert torch.equal(torch.get_rng_state(), rng)
    for m, o, s in ((model, opt, sched), (model2, opt2, sched2)):  # and training continues identically
        train_step(m, o, s, 4)
    _assert_same(model.state_dict(), model2.state_dict())


def test_interval_and_force(tmp_path):
    *_, mgr = _trained(tmp_path, interval=2)
    for step in (1, 2, 3):
        mgr.save(step)
    assert mgr.complete_steps() == [2]
    mtime = (mgr.step_dir(2) / ".metadata").stat().st_mtime_ns
    mgr.save(2, force=True)  # the final step coinciding with an interval step is written once
    assert (mgr.step_dir(2) / ".metadata").stat().st_mtime_ns == mtime
    mgr.save(3, force=True)
    assert mgr.complete_steps() == [2, 3]


def test_newest_complete_ignores_tmp_and_load_step(tmp_path, caplog):
    model, opt, sched, _, mgr = _trained(tmp_path, interval=2)
    mgr.save(2)
    weights_at_2 = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, opt, sched, 4)
    mgr.save(4)
    partial = tmp_path / "checkpoint" / "step-6.tmp-20250101-000000-1"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half a shard")
    fresh = manager(tmp_path, *build(seed=3), TrainState())
    with caplog.at_level(logging.WARNING):
        assert fresh.load() == 4
    assert "ignoring incomplete" in caplog.text and partial.name in caplog.text

    model2, opt2, sched2 = build(seed=3)
    pinned = manager(tmp_path, model2, opt2, sched2, TrainState(), load_step=2)
    assert pinned.load() == 2
    _assert_same(weights_at_2, model2.state_dict())
    with pytest.raises(ValueError, match=r"load_step = 5: .*steps found in .*: 2, 4"):
        manager(tmp_path, *build(), TrainState(), load_step=5).load()


def test_nothing_to_resume_and_disabled(tmp_path):
    assert manager(tmp_path, *build(), TrainState()).load() == 0
    model, opt, sched = build()
    off = CheckpointManager(
        Checkpoint(enable=False),
        str(tmp_path),
        model=model,
        optimizer=OptimizersContainer(model, [opt]),
        lr_schedulers=[sched],
        states={},
        fingerprint={},
    )
    off.save(10, force=True)
    assert off.load() == 0 and not (tmp_path / "checkpoint").exists()


def test_fingerprint_mismatch_names_differences(tmp_path):
    *_, mgr = _trained(tmp_path)
    mgr.save(3, force=True)
    other = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 4), nn.Linear(4, 4))
    opt = torch.optim.AdamW(other.parameters())
    bad = CheckpointManager(
        Checkpoint(enable=True),
        str(tmp_path),
        model=other,
        optimizer=OptimizersContainer(other, [opt]),
        lr_schedulers=[],
        states={},
        fingerprint=model_fingerprint([other], model="worker", flavor="big"),
    )
    with pytest.raises(ValueError, match="another model") as err:
        bad.load()
    msg = str(err.value)
    assert "flavor: checkpoint None, this run 'big'" in msg
    assert "parameters only in this run's model: 3.weight, 3.bias" in msg
    assert "0.weight [16, 8] -> [32, 8]" in msg


def test_missing_shards_and_keys(tmp_path):
    *_, mgr = _trained(tmp_path)
    mgr.save(3, force=True)
    needs_more = manager(tmp_path, *build(), TrainState())
    needs_more.states["data"] = DataState(epoch=0, cursor=0)
    with pytest.raises(ValueError, match=r"lacks entries this run needs: data$"):
        needs_more.load()
    os.remove(mgr.step_dir(3) / "__0_0.distcp")
    with pytest.raises(ValueError, match=r"step-3 is damaged: .*step-3/__0_0\.distcp is missing"):
        manager(tmp_path, *build(), TrainState()).load()
    meta = json.loads((mgr.step_dir(3) / "meta.json").read_text())
    del meta["files"]  # a checkpoint saved before meta.json listed its files
    (mgr.step_dir(3) / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"shard files missing: __0_0\.distcp"):
        manager(tmp_path, *build(), TrainState()).load()


def test_keep_latest_k_and_leftover_cleanup(tmp_path, caplog):
    *_, mgr = _trained(tmp_path, interval=1, keep_latest_k=2)
    leftover = tmp_path / "checkpoint" / "step-9.tmp-old"
    leftover.mkdir(parents=True)
    with caplog.at_level(logging.WARNING):
        for step in range(1, 6):
            mgr.save(step)
    assert mgr.complete_steps() == [4, 5]
    assert not leftover.exists() and "left by an interrupted save" in caplog.text
    mgr.save(2, force=True)  # re-saving an older step never deletes the one just written
    assert mgr.complete_steps() == [2, 5]


# ============================================================================ damage and full disks
def _flip_byte(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the middle of the file: sizes and structure intact
    f.write_bytes(bytes(data))


DAMAGE = {
    "bit flip in a shard": ("__0_0.distcp", _flip_byte, "has other contents than when saved"),
    "truncated shard": ("__0_0.distcp", lambda f: os.truncate(f, f.stat().st_size // 2), "bytes, "),
    "garbage DCP index": (".metadata", lambda f: f.write_bytes(b"\0" * f.stat().st_size), "other contents"),
    "deleted shard": ("__0_0.distcp", os.remove, "is missing"),
    "torn meta.json": ("meta.json", lambda f: f.write_text(f.read_text()[:40]), "not valid JSON"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_damaged_checkpoint_stops_the_resume_and_is_kept(tmp_path, kind):
    """One damaged file of the newest checkpoint: a ValueError naming the folder and the file;
    nothing is deleted or loaded; moved away, the checkpoint before it loads bitwise."""
    model, opt, sched, _, mgr = _trained(tmp_path, steps=1, interval=1)
    mgr.save(1)
    at_1 = {k: v.clone() for k, v in model.state_dict().items()}
    train_step(model, opt, sched, 2)
    mgr.save(2)
    name, damage, problem = DAMAGE[kind]
    damage(mgr.step_dir(2) / name)
    before = sorted((p.name, p.stat().st_size) for p in mgr.step_dir(2).iterdir())

    model2, opt2, sched2 = build(seed=3)
    weights = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(ValueError) as err:
        manager(tmp_path, model2, opt2, sched2, TrainState()).load()
    msg = str(err.value)
    assert f"checkpoint {mgr.step_dir(2)}" in msg and name in msg and problem in msg, msg
    assert f"move it away (e.g. to step-2.damaged) to resume from {mgr.step_dir(1)}" in msg, msg
    assert sorted((p.name, p.stat().st_size) for p in mgr.step_dir(2).iterdir()) == before
    _assert_same(weights, model2.state_dict())  # nothing was loaded

    os.rename(mgr.step_dir(2), tmp_path / "checkpoint" / "step-2.damaged")
    assert manager(tmp_path, model2, opt2, sched2, TrainState()).load() == 1
    _assert_same(at_1, model2.state_dict())


def _full_disk_after(limit: int, where: str):
    """FileSystem.create_stream whose files under `where` take `limit` bytes, then ENOSPC."""
    original = C.dcp.filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode):
        with original(self, path, mode) as stream:
            if where not in str(path):
                yield stream
                return
            written = 0

            class Full:  # the stream, except that it holds `limit` bytes
                def __getattr__(self, name):
                    return getattr(stream, name)

                def write(self, b):
                    nonlocal written
                    if written + len(b) > limit:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
                    written += len(b)
                    return stream.write(b)

            yield Full()

    return create_stream


def test_full_disk_during_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    model, opt, sched, _, mgr = _trained(tmp_path, steps=1, interval=1)
    mgr.save(1)
    train_step(model, opt, sched, 2)
    with monkeypatch.context() as m:
        m.setattr(C.dcp.filesystem.FileSystem, "create_stream", _full_disk_after(100, "step-2.tmp-"))
        with pytest.raises(CheckpointError) as err:
            mgr.save(2)
    msg = str(err.value)
    assert f"saving step 2 to {mgr.step_dir(2)} failed: rank 0: [Errno 28] No space left on device" in msg
    assert f"The complete checkpoints are kept (newest: {mgr.step_dir(1)})" in msg
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]  # no tmp left

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "meta.json")

    with monkeypatch.context() as m:  # our own meta.json, after DCP's files
        m.setattr(C.json, "dump", no_space)
        with pytest.raises(CheckpointError, match=r"step 2 .* failed: rank 0: \[Errno 28\] .*: 'meta.json'"):
            mgr.save(2)
    assert sorted(p.name for p in (tmp_path / "checkpoint").iterdir()) == ["step-1"]
    assert manager(tmp_path, *build(seed=4), TrainState()).load() == 1
    mgr.save(2)  # the disk has room again: the same manager saves
    assert mgr.complete_steps() == [1, 2]

    fresh = manager(tmp_path / "new", *build(), TrainState())
    with monkeypatch.context() as m:
        m.setattr(C.dcp.filesystem.FileSystem, "create_stream", _full_disk_after(0, "step-1.tmp-"))
        with pytest.raises(CheckpointError, match="There is no complete checkpoint yet"):
            fresh.save(1, force=True)


def _worker(mode, dump):
    return subprocess.Popen(
        [sys.executable, "-m", "tests.components._ckpt_worker", mode, str(dump)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(proc, marker):
    for line in proc.stdout:
        if line.startswith(marker):
            return line
    raise AssertionError(f"worker ended before printing {marker!r}: {proc.stderr.read()}")


@pytest.mark.slow
def test_sigkill_inside_save_keeps_previous_checkpoint(tmp_path):
    proc = _worker("kill_in_save", tmp_path)
    try:
        _wait_for(proc, "inside save")
    finally:
        proc.kill()
        proc.wait(timeout=30)
    folder = tmp_path / "checkpoint"
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == "step-1" and len(names) == 2 and names[1].startswith("step-2.tmp-"), names
    assert any(f.suffix == ".distcp" for f in (folder / names[1]).iterdir())  # killed mid-save
    model, opt, sched = build(seed=5)
    assert manager(tmp_path, model, opt, sched, TrainState()).load() == 1
    ref, ref_opt, ref_sched = build()
    train_step(ref, ref_opt, ref_sched, 1)
    _assert_same(ref.state_dict(), model.state_dict())


@pytest.mark.slow
def test_sigterm_saves_and_exits_zero(tmp_path):
    proc = _worker("sigterm", tmp_path)
    _wait_for(proc, "step 3")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    stopped = int(out.strip().splitlines()[-1].removeprefix("stopped at "))
    assert stopped >= 3 and "stop requested (SIGTERM): finishing this step" in err
    state = TrainState()
    model, opt, sched = build(seed=5)
    assert manager(tmp_path, model, opt, sched, state).load() == stopped and state.step == stopped
    ref, ref_opt, ref_sched = build()
    for step in range(1, stopped + 1):
        train_step(ref, ref_opt, ref_sched, step)
    _assert_same(ref.state_dict(), model.state_dict())


# ============================================================================ resharding
def _fsdp_setup(seed):
    from titan_thd.parallel.fsdp import apply_fsdp
    from titan_thd.parallel.parallel_dims import ParallelDims

    model, opt, sched = build(seed)  # the optimizer must see the sharded parameters
    dims = ParallelDims(pp=1, dp_shard=-1, cp=1, tp=1, world_size=2)
    dims.build_meshes("cpu")
    apply_fsdp(model, dims.get_mesh("fsdp"), blocks=[model[0], model[2]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _full(model, opt):
    """Gathered params and optimizer state, as bytes: tensors in a spawn result queue would be
    shared-memory handles that die with the worker."""
    params = {k: v.full_tensor() for k, v in model.state_dict().items()}
    buf = io.BytesIO()
    torch.save((params, _flat_optim(model, opt, full=True)), buf)
    return buf.getvalue()


def _unpack(blob):
    return torch.load(io.BytesIO(blob), weights_only=False)


def _batch_step(model, opt, sched, step, rows=slice(None)):
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)
    F.cross_entropy(model(x[rows]), y[rows], reduction="sum").backward()
    opt.step(), opt.zero_grad(), sched.step()


def _resume_on_two_ranks(rank, world_size, dump):
    """Load the 1-process step-2 checkpoint at dp=2, train step 3 on half batches, save it."""
    model, opt, sched = _fsdp_setup(seed=7)
    state = TrainState()
    mgr = manager(dump, model, opt, sched, state)
    loaded = mgr.load()
    at_2 = _full(model, opt)
    _batch_step(model, opt, sched, 3, rows=slice(rank * 3, rank * 3 + 3))  # gradients summed over ranks
    state.step = 3
    mgr.save(3, force=True)
    return loaded, state.step, sched.state_dict(), at_2, _full(model, opt)


@pytest.mark.slow
def test_reshard_between_one_process_and_two_fsdp_ranks(tmp_path):
    model, opt, sched = build(seed=0)
    state = TrainState()
    for step in (1, 2):
        _batch_step(model, opt, sched, step)
    state.step = 2
    manager(tmp_path, model, opt, sched, state).save(2, force=True)
    at_2 = (dict(model.state_dict()), _flat_optim(model, opt))

    results = spawn(_resume_on_two_ranks, 2, tmp_path)
    for loaded, train_step_loaded, sched_sd, blob_2, _ in results:  # 1 process -> 2 FSDP ranks
        assert (loaded, train_step_loaded) == (2, 3)
        params_2, optim_2 = _unpack(blob_2)
        _assert_same(at_2[0], params_2)
        _assert_same(at_2[1], optim_2)
    params_3, optim_3 = _unpack(results[0][4])
    _assert_same(params_3, _unpack(results[1][4])[0])

    model2, opt2, sched2 = build(seed=3)  # 2 FSDP ranks -> 1 process
    state2 = TrainState()
    assert manager(tmp_path, model2, opt2, sched2, state2).load() == 3 and state2.step == 3
    _assert_same(params_3, model2.state_dict())
    _assert_same(optim_3, _flat_optim(model2, opt2))
    assert sched2.state_dict() == results[0][2]
    assert optim_3["state.0.weight.exp_avg"].abs().sum() > 0  # real optimizer state, not a fresh one

    _batch_step(model, opt, sched, 3)  # and the 2-rank step 3 is the 1-process step 3
    for name, p in model.state_dict().items():
        assert ((p - params_3[name]).abs().max() / p.abs().max()).item() <= 1e-6, name


def _faults_on_rank_one(rank, world_size, dump):
    """Save step 1; the disk of rank 1 (only) fills up during step 2's save; then rank 1's shard
    of step 1 is damaged. Every rank must see each failure (none may hang in a collective)."""
    model, opt, sched = _fsdp_setup(seed=7)
    mgr = manager(dump, model, opt, sched, TrainState(), interval=1)
    _batch_step(model, opt, sched, 1)
    mgr.save(1)
    _batch_step(model, opt, sched, 2)
    original = C.dcp.filesystem.FileSystem.create_stream
    if rank == 1:
        C.dcp.filesystem.FileSystem.create_stream = _full_disk_after(1000, "step-2.tmp-")
    try:
        mgr.save(2)
        save_error = None
    except CheckpointError as e:
        save_error = str(e)
    finally:
        C.dcp.filesystem.FileSystem.create_stream = original
    torch.distributed.barrier()
    listing = sorted(p.name for p in (dump / "checkpoint").iterdir())
    if rank == 0:
        _flip_byte(mgr.step_dir(1) / "__1_0.distcp")
    torch.distributed.barrier()
    try:
        manager(dump, *_fsdp_setup(seed=8), TrainState()).load()
        load_error = None
    except ValueError as e:
        load_error = str(e)
    return save_error, listing, load_error


@pytest.mark.slow
def test_failures_on_one_rank_stop_every_rank(tmp_path):
    results = spawn(_faults_on_rank_one, 2, tmp_path)
    for save_error, listing, load_error in results:
        assert save_error is not None and "rank 1: [Errno 28] No space left on device" in save_error
        assert "rank 0:" not in save_error and f"newest: {tmp_path / 'checkpoint' / 'step-1'}" in save_error
        assert listing == ["step-1"]
        assert load_error is not None and "__1_0.distcp has other contents than when saved" in load_error
    assert results[0][0] == results[1][0] and results[0][2] == results[1][2]
