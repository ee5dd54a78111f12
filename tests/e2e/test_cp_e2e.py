"""Composition end to end: DP 2 x CP 2 (4 gloo processes through ./run_train.sh) trains on the same
tokens as one process and logs the same losses over 5 steps (rel 1e-5: float32, gradients summed
in another order), for both context-parallel modes:

- llama (dense), zigzag: steps hold one to three microbatches per replica, so microbatches of
  different DP ranks, CP shards of unequal trained-token counts (the tail padding lands on CP
  rank 0) and the global token-count normalisation are all exercised;
- dsv4, contiguous with halo exchange: the recipe shrunk to the micro flavor and 256-token
  microbatches; MTP and indexer losses compared too. AdamW instead of the recipe's Muon: the
  float32 rounding differences of another summation order (~1e-6 relative in the gradients of the
  mHC scales, which nearly cancel at initialisation) are amplified by Muon's orthogonalisation
  (it lifts a matrix's small singular directions to full size), and after a step or two one
  token's top-k expert choice flips (seen at step 2: loss rel 5e-6, then 1e-4 by step 5, with
  float32 Newton-Schulz). The DP and resume tests (test_train_layouts.py) cover Muon on the dense
  model, which has no such discontinuity.
"""

import pytest

from tests.e2e.test_train_cli import CONFIG, records, run_train

STEPS = 5
COMMON = ["--training.steps", str(STEPS), "--metrics.enable_tensorboard", "false"]
LLAMA = [
    "--config", CONFIG,
    "--training.global_batch_size", "4",
    "--training.tokens_per_microbatch", "512",
    "--data.pad_to_multiple", "4",
    "--optimizer.lr", "3e-3",
    "--lr_scheduler.warmup_steps", "2",
]  # fmt: skip
DSV4 = [
    "--config", "dsv4_flash_thd.toml",
    "--model.flavor", "micro",
    "--optimizer.name", "adamw",
    "--training.tokens_per_microbatch", "256",
    "--training.global_batch_size", "8",
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, header, keys",
    [
        (LLAMA, "dp 2, cp 2 (zigzag)", ("loss",)),
        (DSV4, "dp 2, cp 2 (contiguous)", ("loss", "aux/mtp", "aux/indexer")),
    ],
    ids=["llama-zigzag", "dsv4-contiguous"],
)
def test_dp2_cp2_matches_one_process(tmp_path, args, header, keys):
    cache = ["--data.cache_dir", str(tmp_path / "data_cache")]  # tokenise once for both runs
    one = run_train(*args, *COMMON, *cache, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    four = run_train(
        *args,
        *COMMON,
        *cache,
        "--parallelism.context_parallel_degree",
        "2",
        "--job.dump_folder",
        str(tmp_path / "dp2cp2"),
        env={"NGPU": "4"},
    )
    assert four.returncode == 0, four.stdout[-3000:] + four.stderr[-3000:]
    assert f"world 4 on cpu: {header}" in four.stdout + four.stderr
    ref, got = records(tmp_path / "one"), records(tmp_path / "dp2cp2")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    worst = 0.0
    for a, b in zip(ref, got):
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"])
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-5), (a["step"], key, a[key], b[key])
            worst = max(worst, abs(b[key] - a[key]) / abs(a[key]))
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)
    if args is LLAMA:
        assert max(r["num_microbatches"] for r in ref) >= 2
    print(f"dp2 x cp2 vs one process ({header}): max rel diff over {STEPS} steps {worst:.1e}")
