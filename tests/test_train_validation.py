"""The validation loop through the Trainer (float64, tiny llama and the dsv4 micro flavor).

One process (the reference):
- val/loss, val/ppl (and with compare_padded val/loss_padded, val/padded_diff) in the records of
  steps 2 and 4 only (freq 2, 4 steps), in TensorBoard, on the console;
- val/loss after step 4 equals an independent recomputation from the trained model: the held-out
  documents of the raw token store (data/split.py's mask, not the loader), each run alone as the
  usual shifted next-token problem (rel <= 1e-12);
- val/padded_diff is float64 rounding (<= 1e-12 relative);
- resumable: a run resumed from the step-2 checkpoint logs the same val/loss at step 4 (==).
Four gloo processes (one spawn), up to their first validation: DP2 x CP2 zigzag (FSDP over dp x cp),
PP2 x DP2 (the eval forward through the schedule's forward-only pass), DP4 with compare_padded (FSDP,
filler rows), and dsv4 DP2 x CP2 contiguous: every val/* value equal to one process, rel <= 1e-12 (float64: another
summation order perturbs by ~1e-16 per operation, as in tests/test_train_layouts.py).
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import _tiny_llama
from tests._dist import spawn
from tests.conftest import TRAIN_ARGS
from tests.test_train_layouts import records
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import load_config
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.split import heldout_mask
from titan_thd.data.token_store import build_token_store
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
ROOT = Path(__file__).resolve().parents[1]
STEPS, FRACTION, MAX_BATCHES, G, T = 4, 0.25, 3, 8, 512
REL = 1e-12
VAL_KEYS = ("val/loss", "val/ppl", "val/loss_padded", "val/padded_diff")


def llama_args(dump: Path, steps: int, *extra: str) -> list[str]:
    return [
        *TRAIN_ARGS,
        "--model.flavor", _tiny_llama.NAME,
        "--data.cache_dir", str(dump.parent / "data_cache"),
        "--data.pad_to_multiple", "4",  # zigzag CP 2 cuts every document into 4 chunks
        "--training.steps", str(steps),
        "--training.dtype", "float64",
        "--optimizer.lr", "3e-3",
        "--lr_scheduler.total_steps", str(STEPS),
        "--checkpoint.interval", "2",
        "--metrics.peak_tflops", "1",
        "--metrics.log_freq", "100",
        "--job.dump_folder", str(dump),
        "--validation.enable", "true",
        "--validation.fraction", str(FRACTION),
        "--validation.freq", "2",
        "--validation.max_batches", str(MAX_BATCHES),
        *extra,
    ]  # fmt: skip


def dsv4_args(dump: Path, steps: int, *extra: str) -> list[str]:
    return [
        "--job.config_file", str(ROOT / "train_configs" / "dsv4_flash_thd.toml"),
        "--model.flavor", "micro",
        "--optimizer.name", "adamw",
        "--training.steps", str(steps),
        "--data.cache_dir", str(dump.parent / "data_cache"),
        "--training.global_batch_size", "8",
        "--training.tokens_per_microbatch", "256",
        "--training.dtype", "float64",
        "--metrics.enable_tensorboard", "false",
        "--metrics.peak_tflops", "1",
        "--metrics.log_freq", "100",
        "--job.dump_folder", str(dump),
        "--validation.enable", "true",
        "--validation.fraction", "0.1",
        "--validation.freq", "1",
        "--validation.max_batches", "1",
        *extra,
    ]  # fmt: skip


def run(args: list[str]) -> Trainer:
    trainer = Trainer(resolve_run(load_config(args)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


LAYOUTS = {
    "dp2_cp2": ["--parallelism.context_parallel_degree", "2"],
    "pp2_dp2": ["--parallelism.pipeline_parallel_degree", "2"],
    "dp4_padded": ["--validation.compare_padded", "true"],
}


def _layouts(rank: int, world_size: int, base: Path) -> None:
    _tiny_llama.register()
    os.environ |= {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": str(rank)}
    # Up to the first validation step only (the LR schedule is pinned, so that is the reference's).
    for name, extra in LAYOUTS.items():
        run(llama_args(base / name, 2, *extra))
    run(dsv4_args(base / "dsv4_dp2_cp2", 1, "--parallelism.context_parallel_degree", "2"))


@pytest.fixture(scope="module")
def one(tiny_llama, tmp_path_factory):
    """One-process runs: llama straight (TensorBoard on, compare_padded), resumed from its step 2, dsv4 1 step
    (its padded forward is compared in tests/components/test_validation.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("val1")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: lines.append(r.getMessage())
    log = logging.getLogger("titan_thd")
    log.addHandler(handler)
    old_level = log.level
    log.setLevel(logging.INFO)
    try:
        straight = ["--validation.compare_padded", "true", "--metrics.enable_tensorboard", "true"]
        ckpt = ["--checkpoint.enable", "true"]
        trainer = run(llama_args(base / "straight", STEPS, *straight, *ckpt))
        # Resumed from the straight run's step-2 checkpoint (and its metrics.jsonl up to step 2).
        (base / "resumed" / "checkpoint").mkdir(parents=True)
        shutil.copytree(base / "straight/checkpoint/step-2", base / "resumed/checkpoint/step-2")
        kept = (base / "straight/metrics.jsonl").read_text().splitlines()[:2]
        (base / "resumed/metrics.jsonl").write_text("".join(line + "\n" for line in kept))
        run(llama_args(base / "resumed", STEPS, *ckpt))
        run(dsv4_args(base / "dsv4", 1))
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)
        torch.set_num_threads(threads)
    return base, trainer, lines


@pytest.fixture(scope="module")
def layouts(one, tmp_path_factory):
    base = tmp_path_factory.mktemp("val4")
    spawn(_layouts, 4, base, timeout=600)
    return base


def reference_val_loss(trainer: Trainer) -> float:
    """The held-out documents of the raw store, in order, each alone as a shifted next-token problem."""
    cfg = trainer.run.cfg
    store = build_token_store(cfg.data, trainer.run.tokenizer, cfg.training.seed, cfg.data.cache_dir)
    held = np.flatnonzero(heldout_mask(len(store), FRACTION, cfg.training.seed))[: MAX_BATCHES * G]
    assert len(held) == MAX_BATCHES * G
    ce, n = torch.zeros((), dtype=torch.float64), 0
    with torch.no_grad():
        for i in held:
            s = store[int(i)]
            ids, target = torch.from_numpy(s.input_ids[:T]).long(), torch.from_numpy(s.target_mask[:T])
            L = len(ids) - 1
            cu = torch.tensor([0, L], dtype=torch.int32)
            meta = BatchMeta(cu, cu, L, 1, torch.arange(L), None)
            logits = trainer.model(ids[:-1], meta).logits
            ce += cross_entropy_sum(logits, ids[1:], target[1:])
            n += int(target[1:].sum())
    return float(ce) / n


def val_records(dump: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("val/")} for r in records(dump)}


@pytest.mark.slow
def test_one_process_val_loss_records_reference_and_resume(one):
    base, trainer, lines = one
    got = val_records(base / "straight")
    assert [s for s, v in got.items() if v] == [2, 4]
    for step in (2, 4):
        v = got[step]
        assert sorted(v) == sorted(VAL_KEYS)
        assert v["val/ppl"] == pytest.approx(math.exp(v["val/loss"]), rel=1e-15)
        assert abs(v["val/padded_diff"]) <= REL * v["val/loss"]
        assert v["val/loss_padded"] - v["val/loss"] == v["val/padded_diff"]
    assert got[4]["val/loss"] < got[2]["val/loss"]  # it trains (lr 3e-3, 4 steps)
    ref = reference_val_loss(trainer)
    print(f"val/loss after step 4: {got[4]['val/loss']!r}, reference {ref!r}")
    assert got[4]["val/loss"] == pytest.approx(ref, rel=REL, abs=0)
    # Resumed from the step-2 checkpoint: the same val/loss at step 4, bitwise.
    resumed = val_records(base / "resumed")
    assert [s for s, v in resumed.items() if v] == [2, 4]  # step 2's record is the straight run's
    assert resumed[4]["val/loss"] == got[4]["val/loss"]
    # TensorBoard and the console.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tb = EventAccumulator(str(base / "straight" / "tb")).Reload()
    events = tb.Scalars("val/loss")
    assert [e.step for e in events] == [2, 4]  # float32 scalars
    assert [e.value for e in events] == pytest.approx([got[2]["val/loss"], got[4]["val/loss"]], rel=1e-6)
    said = [line for line in lines if line.startswith("validation after step")]
    assert len(said) == 2 + 1 + 1  # straight (2, 4), resumed (4), dsv4 (1)
    assert f"val/loss {got[4]['val/loss']:.4f}" in said[1] and "24 documents in 3 batches" in said[1]
    assert [s for s, v in val_records(base / "dsv4").items() if v] == [1]


@pytest.mark.slow
def test_every_layout_logs_the_one_process_val_loss(one, layouts):
    """The layouts run up to step 2 (llama) / 1 (dsv4), their first validation."""
    base = one[0]
    ref = val_records(base / "straight")[2]
    for name in LAYOUTS:
        got = val_records(layouts / name)
        assert [s for s, v in got.items() if v] == [2], name
        keys = VAL_KEYS if name == "dp4_padded" else VAL_KEYS[:2]
        assert sorted(got[2]) == sorted(keys), name
        for k in keys[:3]:  # padded_diff: float64 rounding of a difference, compared above
            assert got[2][k] == pytest.approx(ref[k], rel=REL, abs=0), (name, k)
        print(f"{name}: val/loss rel {abs(got[2]['val/loss'] / ref['val/loss'] - 1):.1e}")
    d_ref, d_got = val_records(base / "dsv4")[1], val_records(layouts / "dsv4_dp2_cp2")[1]
    print(f"dsv4 dp2 x cp2: val/loss rel {abs(d_got['val/loss'] / d_ref['val/loss'] - 1):.1e}")
    assert d_got["val/loss"] == pytest.approx(d_ref["val/loss"], rel=REL, abs=0)
