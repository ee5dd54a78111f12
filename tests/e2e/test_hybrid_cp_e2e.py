"""Hybrid context parallelism end to end: CP 2 in hybrid mode (2 gloo processes through
./run_train.sh; mock documents shorter than T / cp = 256 tokens stay whole on one rank, longer ones
are zigzagged) trains on the same tokens as one process and logs the same losses and gradient
norms, in float64 (rel <= 1e-12, the house bound of tests/e2e/test_cp_e2e.py). Two small steps:
the numerics are covered op by op and layer by layer in tests/parallel/test_hybrid_cp.py; this
checks the trainer's wiring (config, layout, partition, loss normalisation)."""

import pytest

from tests.e2e.test_cp_e2e import LLAMA, REL
from tests.e2e.test_train_cli import records, run_train

STEPS = 2
MOCK = ["--data.source", "mock", "--data.num_samples", "64", "--training.global_batch_size", "4"]


@pytest.mark.slow
@pytest.mark.extended  # hybrid CP vs one process also runs in test_train_adversarial (llama cp4 hybrid)
def test_hybrid_cp2_matches_one_process(tmp_path):
    common = [*LLAMA, *MOCK, "--training.steps", str(STEPS), "--metrics.enable_tensorboard", "false"]
    one = run_train(*common, "--job.dump_folder", str(tmp_path / "one"))
    assert one.returncode == 0, one.stdout[-3000:] + one.stderr[-3000:]
    two = run_train(
        *common,
        "--parallelism.context_parallel_degree", "2",
        "--parallelism.context_parallel_mode", "hybrid",
        "--job.dump_folder", str(tmp_path / "cp2"),
        env={"NGPU": "2"},
    )  # fmt: skip
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "world 2 on cpu: dp 1, cp 2 (hybrid)" in two.stdout + two.stderr
    ref, got = records(tmp_path / "one"), records(tmp_path / "cp2")
    assert [r["step"] for r in got] == [r["step"] for r in ref] == list(range(1, STEPS + 1))
    for a, b in zip(ref, got):
        assert (b["tokens_real"], b["tokens_trained"]) == (a["tokens_real"], a["tokens_trained"])
        assert b["num_microbatches"] == a["num_microbatches"]
        for key in ("loss", "grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=REL), (a["step"], key, a[key], b[key])
