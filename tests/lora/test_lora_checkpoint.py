"""LoRA checkpoints and resume, on a dsv4 `micro` LoRA run from a Hugging Face folder
(`--model.hf_path`, float64, rank-2 adapters on the attention, the shared expert and every routed
expert, AdamW), through the trainer:

- a checkpoint (DCP) holds the adapters, their AdamW state, the data, schedule and train state, and no
  weight of the base (its `.metadata` lists them); it is a small fraction of the full run's checkpoint;
- the run records its base, the folder and its fingerprint (models/hf/io.py folder_fingerprint), in
  meta.json and run.json; a resume against another base, against the same folder with one tensor
  changed or without `model.hf_path` is refused in one `error:` line that names lora.base and both ways
  on (the real entry point: exit code 2, nothing trained); a copy of the base in another folder is the
  same base; changing any one tensor of the folder changes its fingerprint;
- resume is bitwise: 4 steps == 2 + resume + 2 (metrics.jsonl ==). The checkpoint lacks the base, so the
  resume reads it again from model.hf_path: the same adapters resumed on another base (allowed by
  `--checkpoint.allow_changes lora.base`) give other losses;
- Ctrl-C saves the adapters and the resume continues bitwise;
- slow: SIGKILL while training, then inside a save, then resume: the uninterrupted run, bitwise;
  a one-process checkpoint resumes on FSDP 2 (and, extended, on EP 2 x FSDP 2) with the one-process
  run's losses, rel <= 1e-12.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from tests.test_train_layouts import records
from titan_thd.config import load_config
from titan_thd.lora.targets import trained_keys
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors
from titan_thd.models.hf.io import folder_fingerprint
from titan_thd.preflight import preflight
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer, main

ROOT = Path(__file__).resolve().parents[2]
STEPS, SPLIT = 4, 2
MICRO = dataclasses.replace(flavors["micro"], vocab_size=320)  # the byte tokenizer's ids
TIMING = ("tps", "tps_per_rank", "tflops", "mfu", "step_time", "wall_time")
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def argv(dump: Path, steps: int, hf_path: Path | None, *extra: str, lora: bool = True) -> list[str]:
    """Four chat conversations a step; the LR schedule is pinned to STEPS so that a run stopped early
    continues on it; a checkpoint every SPLIT steps."""
    adapters = ("--lora.enable", "true", "--lora.rank", "2", "--lora.alpha", "4")
    return [
        *TRAIN_ARGS,
        *("--model.name", "dsv4", "--model.flavor", "micro", "--training.dtype", "float64"),
        *(("--model.hf_path", str(hf_path)) if hf_path else ()),
        *("--training.steps", str(steps), "--lr_scheduler.total_steps", str(STEPS)),
        *("--lr_scheduler.warmup_steps", "1", "--optimizer.lr", "1e-2"),
        *("--training.global_batch_size", "4", "--training.tokens_per_microbatch", "256"),
        *((*adapters, "--lora.targets", "attention,shared_expert,experts") if lora else ()),
        *("--checkpoint.enable", "true", "--checkpoint.interval", str(SPLIT)),
        *("--data.cache_dir", str(dump.parent / "data_cache"), "--metrics.peak_tflops", "1"),
        *("--job.dump_folder", str(dump), *extra),
    ]


def train(args: list[str]) -> None:
    trainer = Trainer(resolve_run(load_config(args)))
    try:
        trainer.train()
    finally:
        trainer.close()


def computed(recs: list[dict]) -> list[dict]:
    """The records without their clock readings: what a resumed run must reproduce exactly."""
    return [{k: v for k, v in r.items() if k not in TIMING and not k.startswith("time/")} for r in recs]


def step_dir(dump: Path, step: int) -> Path:
    return dump / "checkpoint" / f"step-{step}"


def base_of(path: Path) -> dict[str, str]:
    return {"folder": str(path.resolve()), "fingerprint": folder_fingerprint(path)}


@pytest.fixture(scope="module")
def one_thread():
    """One thread: comparable kernels in every run, and no oversubscription of a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def bases(tmp_path_factory) -> tuple[Path, Path]:
    """Two HF folders of the micro model (seeds 7 and 8: the trainer's seed 42 would draw neither)."""
    out = []
    for seed in (7, 8):
        torch.manual_seed(seed)
        out.append(export_hf(build_dsv4(MICRO), MICRO, tmp_path_factory.mktemp("hf") / f"micro-{seed}"))
    return out[0], out[1]


@pytest.fixture(scope="module")
def straight(one_thread, bases, tmp_path_factory) -> Path:
    """The uninterrupted LoRA run: STEPS steps, checkpoints at SPLIT and STEPS."""
    dump = tmp_path_factory.mktemp("runs") / "straight"
    train(argv(dump, STEPS, bases[0]))
    return dump


def adapter_names(hf_path: Path) -> set[str]:
    """The trained state-dict keys of the LoRA run's model (built on the meta device)."""
    run = resolve_run(load_config(argv(Path("/unused"), STEPS, hf_path)), 1)
    with torch.device("meta"):
        return trained_keys(run.build_model())


def test_the_checkpoint_holds_the_adapters_their_state_and_the_data_not_the_base(
    straight, bases, tmp_path, one_thread
):
    base = bases[0]
    full = tmp_path / "full"
    train(argv(full, SPLIT, base, lora=False))  # the full fine-tuning run of the same model and data
    lora_dir, full_dir = step_dir(straight, SPLIT), step_dir(full, SPLIT)
    entries = FileSystemReader(str(lora_dir)).read_metadata().state_dict_metadata
    full_entries = FileSystemReader(str(full_dir)).read_metadata().state_dict_metadata

    adapters = adapter_names(base)
    assert len(adapters) == 4 * 19  # 4 blocks x (4 attention + 3 shared-expert pairs + 5 routed stacks)
    assert {k.removeprefix("model.") for k in entries if k.startswith("model.")} == adapters
    base_weights = {k for k in full_entries if k.startswith("model.")}
    assert len(base_weights) > 100 and not base_weights & set(entries)  # no weight of the base
    state = {k for k in entries if k.startswith("optimizer.state.")}
    assert state == {f"optimizer.state.{a}.{s}" for a in adapters for s in ("step", "exp_avg", "exp_avg_sq")}
    groups = {
        k.removeprefix("optimizer.param_groups.").rsplit(".", 1)[0] for k in entries if ".param_groups." in k
    }
    assert groups == adapters
    assert {"lr_scheduler", "train_state", "dataloader", "rng.rank_0.cpu"} <= set(entries)

    def size(folder: Path) -> int:
        return sum(f.stat().st_size for f in folder.iterdir())

    lora_bytes, full_bytes = size(lora_dir), size(full_dir)
    print(f"checkpoint of step {SPLIT}: LoRA {lora_bytes:,} bytes, full fine-tuning {full_bytes:,} bytes")
    assert lora_bytes < 0.12 * full_bytes

    # The base it was trained on: its folder and fingerprint, in meta.json and run.json.
    want = base_of(base)
    assert json.loads((lora_dir / "meta.json").read_text())["settings"]["lora.base"] == want
    assert json.loads((straight / "run.json").read_text())["settings"]["lora.base"] == want
    assert "lora.base" not in json.loads((full_dir / "meta.json").read_text())["settings"]


def test_resume_is_bitwise_and_reads_the_base_again(straight, bases, tmp_path, one_thread, caplog):
    split = tmp_path / "split"
    train(argv(split, SPLIT, bases[0]))
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        train(argv(split, STEPS, bases[0]))
    assert f"checkpoint: resumed from {step_dir(split, SPLIT)}" in caplog.text
    assert [r["step"] for r in records(split)] == list(range(1, STEPS + 1))
    assert computed(records(split)) == computed(records(straight))

    # The adapters of step 2 on another base (a run may allow it): the base comes from model.hf_path.
    rebased = tmp_path / "rebased"
    shutil.copytree(step_dir(straight, SPLIT), step_dir(rebased, SPLIT))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_thd"):
        train(argv(rebased, STEPS, bases[1], "--checkpoint.allow_changes", "lora.base"))
    assert "with changed settings (checkpoint.allow_changes): lora.base " in caplog.text
    other = records(rebased)
    assert [r["step"] for r in other] == [3, 4]
    assert other[0]["tokens_real"] == records(straight)[SPLIT]["tokens_real"]  # the same documents
    assert abs(other[0]["loss"] - records(straight)[SPLIT]["loss"]) > 1e-3  # on another base
    assert json.loads((rebased / "run.json").read_text())["settings"]["lora.base"] == base_of(bases[1])


def _tensors(folder: Path) -> list[tuple[Path, str, int, int]]:
    """(file, name, first byte, end) of every tensor of a safetensors folder, offsets in the file."""
    out = []
    for f in sorted(folder.glob("*.safetensors")):
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        out += [
            (f, name, 8 + n + b, 8 + n + e)
            for name, (b, e) in ((k, v["data_offsets"]) for k, v in header.items())
        ]
    return out


def _change(f: Path, begin: int, end: int) -> bytes:
    """Replace bytes [begin, end) of `f` with others (every bit flipped); returns the old ones."""
    with f.open("r+b") as fh:
        fh.seek(begin)
        old = fh.read(end - begin)
        fh.seek(begin)
        fh.write(bytes(b ^ 0xFF for b in old))
    return old


def _put(f: Path, begin: int, data: bytes) -> None:
    with f.open("r+b") as fh:
        fh.seek(begin)
        fh.write(data)


def test_any_one_tensor_changed_changes_the_fingerprint(bases, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(bases[0], folder)
    before = folder_fingerprint(folder)
    tensors = _tensors(folder)
    assert len(tensors) > 100
    for f, name, begin, end in tensors:
        old = _change(f, begin, end)
        assert folder_fingerprint(folder) != before, name
        _put(f, begin, old)
    assert folder_fingerprint(folder) == before
    assert folder_fingerprint(bases[1]) != before  # another model of the same architecture


def test_a_resume_on_another_base_is_refused_in_one_line(bases, tmp_path, one_thread, caplog):
    base, other = bases
    mine = tmp_path / "hf"  # a base of this test's own, to change one of its tensors
    shutil.copytree(base, mine)
    dump = tmp_path / "run"
    train(argv(dump, SPLIT, mine))
    step, saved = step_dir(dump, SPLIT), base_of(mine)
    run_file = (dump / "run.json").read_text()

    def refusal(now: str) -> str:
        return (
            f"checkpoint {step} was saved by a run with other settings: lora.base {saved['folder']} (fingerprint "
            f"{saved['fingerprint']}) -> {now}. Resuming would change the run: pass --checkpoint.allow_changes "
            f"lora.base to continue with the new values, or run with the checkpoint's (--model.hf_path "
            f"{saved['folder']})"
        )

    def check(hf_path: Path | None) -> None:
        preflight(resolve_run(load_config(argv(dump, STEPS, hf_path)), 1))  # run_train.sh's check

    with pytest.raises(ValueError) as e:
        check(other)
    assert str(e.value) == refusal(f"{other.resolve()} (fingerprint {folder_fingerprint(other)})")
    with pytest.raises(ValueError) as e:
        check(None)
    assert str(e.value) == refusal("none (no model.hf_path: the seeded model)")

    # A copy of the base in another folder is the same base: resumed, the move logged.
    copy = tmp_path / "copy"
    shutil.copytree(mine, copy)
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        check(copy)
    moved = json.dumps(saved["folder"]), json.dumps(str(copy.resolve()))
    assert f"lora.base folder {moved[0]} -> {moved[1]}" in caplog.text

    # The same folder with one tensor changed, through the real entry point: one line, exit code 2.
    f, _, begin, end = next(t for t in _tensors(mine) if t[1] == "layers.1.attn.wq_b.weight")
    _change(f, begin, end)
    changed = f"{saved['folder']} (fingerprint {folder_fingerprint(mine)})"
    proc = subprocess.run(
        [sys.executable, "-m", "titan_thd.train", *argv(dump, STEPS, mine)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert errors == [f"error: {refusal(changed)}"]
    assert [r["step"] for r in records(dump)] == [1, 2] and (dump / "run.json").read_text() == run_file


def test_ctrl_c_saves_the_adapters_and_the_resume_continues(
    straight, bases, tmp_path, one_thread, monkeypatch
):
    dump = tmp_path / "stopped"
    train_step = Trainer.train_step

    def interrupted_step(self, step_batch, *rest):
        if self.step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return train_step(self, step_batch, *rest)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", interrupted_step)
        assert main(argv(dump, STEPS, bases[0])) == 0
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-3"]
    entries = FileSystemReader(str(step_dir(dump, 3))).read_metadata().state_dict_metadata
    assert {k.removeprefix("model.") for k in entries if k.startswith("model.")} == adapter_names(bases[0])
    assert main(argv(dump, STEPS, bases[0])) == 0
    assert computed(records(dump)) == computed(records(straight))


# ============================================================================ processes
def _start(module: list[str], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", *module],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},  # the kernels of the in-process runs
        stdout=stdout,
        stderr=stderr,
        text=True,
    )


def _steps(dump: Path) -> list[int]:
    path = dump / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.slow
def test_sigkill_while_training_and_inside_a_save_then_resume_is_the_uninterrupted_run(
    straight, bases, tmp_path, one_thread
):
    """Checkpoints every 2 steps. Run 1 is killed (SIGKILL) once step 3 is recorded, while it trains step
    4; run 2 resumes from step 2 and is killed inside the save of step 4 (its shards written, the folder
    not yet renamed); run 3 resumes from step 2 again. Every record equals the uninterrupted run's."""
    dump, base = tmp_path / "killed", bases[0]
    log = (tmp_path / "run1.log").open("w")
    proc = _start(["titan_thd.train", *argv(dump, STEPS, base)], stderr=log)
    try:
        deadline = time.monotonic() + 240
        while 3 not in _steps(dump):
            assert proc.poll() is None, (tmp_path / "run1.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "step 3 not recorded in 240 s"
            time.sleep(0.01)
    finally:
        proc.kill()
        proc.wait(timeout=60)
        log.close()
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]
    assert _steps(dump) == [1, 2, 3]

    log = (tmp_path / "run2.log").open("w")
    proc = _start(
        ["tests._slow_save_train", "4", *argv(dump, STEPS, base)], stdout=subprocess.PIPE, stderr=log
    )
    try:
        for line in proc.stdout:
            if line.startswith("inside save"):
                break
        else:
            raise AssertionError(f"no save of step 4: {(tmp_path / 'run2.log').read_text()[-3000:]}")
    finally:
        proc.kill()
        proc.wait(timeout=60)
        log.close()
    names = sorted(p.name for p in (dump / "checkpoint").iterdir())
    assert names[0] == "step-2" and len(names) == 2 and names[1].startswith("step-4.tmp-"), names
    assert any(f.suffix == ".distcp" for f in (dump / "checkpoint" / names[1]).iterdir())  # killed mid-save
    assert computed(records(dump)) == computed(records(straight))  # steps 3 and 4 of run 2, resumed

    train(argv(dump, STEPS, base))
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2", "step-4"]
    assert computed(records(dump)) == computed(records(straight))


def _resume_on_ranks(rank: int, world: int, args: list[str]) -> None:
    os.environ |= {"WORLD_SIZE": str(world), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    torch.set_num_threads(1)
    train(args)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ranks", "layout"),
    [(2, ()), pytest.param(4, ("--parallelism.expert_parallel_degree", "2"), marks=pytest.mark.extended)],
    ids=["fsdp2", "ep2xfsdp2"],
)
def test_a_one_process_checkpoint_resumes_on_another_layout(straight, bases, tmp_path, ranks, layout):
    dump = tmp_path / "resharded"
    shutil.copytree(step_dir(straight, SPLIT), step_dir(dump, SPLIT))
    spawn(_resume_on_ranks, ranks, argv(dump, STEPS, bases[0], *layout), timeout=400)
    one, got = records(straight)[SPLIT:], records(dump)
    assert [r["step"] for r in got] == list(range(SPLIT + 1, STEPS + 1))
    for a, b in zip(one, got, strict=True):
        print(f"step {a['step']}: loss {a['loss']!r} (one process) {b['loss']!r} ({ranks} ranks)")
        assert (b["tokens_real"], b["tokens_trained"], b["lr"]) == (
            a["tokens_real"],
            a["tokens_trained"],
            a["lr"],
        )
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-12, abs=0)
