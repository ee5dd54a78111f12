"""DeepSeek-V4 through ./run_train.sh on DP 2 x CP 2 (4 gloo processes, contiguous CP) reproduces
the single-process run of the same recipe, seed and data: 5 steps of metrics.jsonl.

The recipe dsv4_flash_thd.toml is shrunk to the micro flavor and 256-token microbatches so both
runs take seconds. AdamW instead of the recipe's Muon: Newton-Schulz amplifies float32 summation-
order noise in the gradients' small singular directions, so even DP 2 without CP drifts ~2e-5
from one process after one Muon step; this test is about the CP layout, not that optimizer.
"""

import pytest

from tests.e2e.test_train_cli import records, run_train

SMALL = [
    "--config",
    "dsv4_flash_thd.toml",
    "--model.flavor",
    "micro",
    "--optimizer.name",
    "adamw",
    "--training.tokens_per_microbatch",
    "256",
    "--training.global_batch_size",
    "8",
    "--training.steps",
    "5",
    "--metrics.enable_tensorboard",
    "false",
]


@pytest.mark.slow
def test_dp2_cp2_reproduces_one_process(tmp_path):
    cache = ["--data.cache_dir", str(tmp_path / "data_cache")]
    one = run_train(*SMALL, *cache, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    four = run_train(
        *SMALL,
        *cache,
        "--parallelism.context_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "dp2cp2"),
        env={"NGPU": "4"},
    )
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    assert "dp 2, cp 2 (contiguous)" in four.stdout + four.stderr
    ref, got = records(tmp_path / "one"), records(tmp_path / "dp2cp2")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == [1, 2, 3, 4, 5]
    for a, b in zip(ref, got):
        assert b["tokens_trained"] == a["tokens_trained"] and b["tokens_real"] == a["tokens_real"]
        for key in ("loss", "aux/mtp", "aux/indexer"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
