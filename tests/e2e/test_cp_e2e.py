"""Composition end to end: DP2 x CP2 (4 processes through ./run_train.sh, zigzag CP for the dense
llama) trains on the same tokens as one process and logs the same losses over 5 steps (rel 1e-5:
float32, gradients summed in another order). Steps hold one to three microbatches per replica,
so microbatches of different DP ranks, CP shards of unequal trained-token counts (the tail
padding lands on CP rank 0) and the global token-count normalisation are all exercised."""

import pytest

from tests.e2e.test_train_cli import CONFIG, records, run_train

STEPS = 5
COMMON = [
    "--config",
    CONFIG,
    "--training.global_batch_size",
    "4",
    "--training.tokens_per_microbatch",
    "512",
    "--data.pad_to_multiple",
    "4",
    "--training.steps",
    str(STEPS),
    "--lr_scheduler.warmup_steps",
    "2",
    "--optimizer.lr",
    "3e-3",
    "--metrics.log_freq",
    "1",
    "--metrics.enable_tensorboard",
    "false",
]


@pytest.mark.slow
def test_dp2_cp2_matches_one_process(tmp_path):
    cache = ["--data.cache_dir", str(tmp_path / "data_cache")]  # tokenise once for both runs
    one = run_train(*COMMON, *cache, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    four = run_train(
        *COMMON,
        *cache,
        "--parallelism.context_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "dp2cp2"),
        env={"NGPU": "4"},
    )
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    assert "world 4 on cpu: dp 2, cp 2 (zigzag)" in four.stdout + four.stderr
    ref, got = records(tmp_path / "one"), records(tmp_path / "dp2cp2")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    assert max(r["num_microbatches"] for r in ref) >= 2
    worst = 0.0
    for a, b in zip(ref, got):
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a["step"], a["loss"], b["loss"])
        worst = max(worst, abs(b["loss"] - a["loss"]) / abs(a["loss"]))
    print(f"dp2 x cp2 vs one process: max loss rel diff over {STEPS} steps {worst:.1e}")
