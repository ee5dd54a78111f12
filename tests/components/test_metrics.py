import json
import os

import pytest
import torch

from titan_thd.components import metrics as M
from titan_thd.config import Metrics

# The metrics.jsonl contract (docs/design.md §3.6): every record has at least these keys.
REQUIRED_KEYS = {
    "step",
    "loss",
    "grad_norm",
    "lr",
    "tps",
    "tokens_real",
    "tokens_slots",
    "padding_frac",
    "tflops",
    "mfu",
    "num_microbatches",
    "imbalance",
    "wall_time",
    "time/data",
    "time/forward_backward",
    "time/comm",
    "time/optimizer",
}


def _record(step=3, **kw):
    args = {
        "step": step,
        "loss": 2.5,
        "grad_norm": 0.75,
        "lr": 1e-3,
        "step_time": 2.0,
        "wall_time": 10.0,
        "tokens_real": 3000,
        "tokens_trained": 1200,
        "tokens_slots": 4096,
        "flops": 8e12,
        "num_microbatches": 2,
        "imbalance": 1.05,
        "world_size": 2,
        "peak_tflops": 4.0,
        "aux_losses": {"mtp": 0.25},
        "phase_times": {"data": 0.25, "forward_backward": 1.5, "comm": 0.0625, "optimizer": 0.125},
    }
    args.update(kw)
    return M.step_metrics(**args)


def test_step_metrics_worked_values():
    r = _record()
    assert r["tps"] == 1500.0 and r["tps_per_rank"] == 750.0
    assert r["padding_frac"] == pytest.approx(1 - 3000 / 4096)
    assert r["tflops"] == pytest.approx(8e12 / 2.0 / 2 / 1e12)  # per rank: 2 TFLOP/s
    assert r["mfu"] == pytest.approx(50.0)  # percent of 4 TFLOP/s
    assert r["aux/mtp"] == 0.25
    assert REQUIRED_KEYS <= set(r)
    assert _record(peak_tflops=0.0)["mfu"] == 0.0
    line = M.console_line(r)
    for piece in (
        "step     3",
        "loss 2.5000",
        "aux/mtp 0.2500",
        "tps 1,500",
        "pad 26.8%",
        "mfu 50.0%",
        "mb 2",
        "2.00s (data 0.25 fwd+bwd 1.50 comm 0.06 opt 0.12)",
    ):
        assert piece in line


def test_step_timer_adds_up_each_phase_and_starts_afresh(monkeypatch):
    clock = iter([0.0, 1.0, 1.0, 3.5, 4.0, 4.25, 10.0, 10.5])
    monkeypatch.setattr(M.time, "perf_counter", lambda: next(clock))
    timer = M.StepTimer(torch.device("cpu"))
    with timer.phase("forward_backward"):
        pass
    with timer.phase("forward_backward"):
        pass
    with timer.phase("data"):
        pass
    assert timer.pop() == {"data": 0.25, "forward_backward": 3.5, "comm": 0.0, "optimizer": 0.0}
    with timer.phase("optimizer"):
        pass
    assert timer.pop() == {"data": 0.0, "forward_backward": 0.0, "comm": 0.0, "optimizer": 0.5}


def test_logger_writes_jsonl_and_tensorboard(tmp_path, caplog):
    cfg = Metrics(log_freq=2, enable_tensorboard=True)
    log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
    with caplog.at_level("INFO", logger="titan_thd"):
        for step in (1, 2, 3, 4, 5):
            log.log(_record(step=step), last_step=5)
    log.close()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    printed = [r.message.split()[1] for r in caplog.records]
    assert printed == ["1", "2", "4", "5"]  # first, every log_freq, last
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def _steps(path):
    return [json.loads(x)["step"] for x in path.read_text().splitlines()]


def test_resumed_run_replaces_steps_after_its_checkpoint(tmp_path):
    cfg = Metrics(enable_tensorboard=False)
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(_record(step=s)) + "\n" for s in range(1, 8)))
    log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
    for step in (5, 6):  # resumed from the checkpoint of step 4
        log.log(_record(step=step, loss=9.0), last_step=6)
    log.close()
    assert _steps(path) == [1, 2, 3, 4, 5, 6]
    assert [json.loads(x)["loss"] for x in path.read_text().splitlines()][4:] == [9.0, 9.0]
    log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)  # a fresh run replaces the file
    log.log(_record(step=1), last_step=1)
    log.close()
    assert _steps(path) == [1]


def test_disabled_logger_writes_nothing(tmp_path):
    log = M.MetricsLogger(Metrics(), str(tmp_path / "x"), enabled=False)
    log.log(_record(), last_step=3)
    log.close()
    assert not (tmp_path / "x").exists()


def test_peak_measured_once_and_shared_on_cpu(monkeypatch):
    M._PEAK_CACHE.clear()
    peak = M.measure_matmul_tflops(torch.float32, torch.device("cpu"), seconds=0.05)
    assert 1e-3 < peak < 1e3
    monkeypatch.setattr(M.torch, "matmul", None)  # a second measurement would crash
    assert M.measure_matmul_tflops(torch.float32, torch.device("cpu")) == peak
    cpu = torch.device("cpu")
    assert M.peak_tflops_per_rank(Metrics(), torch.float32, cpu, local_world_size=4) == pytest.approx(
        peak / 4
    )
    assert M.peak_tflops_per_rank(Metrics(peak_tflops=7.0), torch.float32, cpu, local_world_size=4) == 7.0


def test_peak_measurement_is_short_on_a_cpu_that_emulates_bf16(monkeypatch):
    """A CPU without native bf16 (AVX2) emulated a 2048^2 bf16 product in about a minute: the six of
    the old fixed-size measurement kept rank 0 silent for 5 minutes and the other ranks' barrier
    timed out (docs/results.md §14). On a simulated clock at that speed the measurement now takes
    seconds, and the rate it finds is the machine's."""
    clock = [0.0]
    rate = 2 * 2048**3 / 60.0  # FLOP/s: one 2048^2 product a minute

    def matmul(a, b):
        clock[0] += 2 * a.shape[0] ** 3 / rate
        return a

    monkeypatch.setattr(M.torch, "matmul", matmul)
    monkeypatch.setattr(M.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(M.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    M._PEAK_CACHE.clear()
    try:
        peak = M.measure_matmul_tflops(torch.bfloat16, torch.device("cpu"))
    finally:
        M._PEAK_CACHE.clear()
    assert clock[0] < 5.0, clock[0]
    assert peak == pytest.approx(rate / 1e12)


@pytest.mark.parametrize(
    ("gpu", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.0),
        ("Mystery GPU", None),
    ],
)
def test_gpu_peak_is_the_vendor_table(monkeypatch, gpu, peak):
    """On CUDA the MFU divides by the GPU's dense bf16 peak (components/hardware.py's table, the
    machine check's too); a GPU the table does not hold falls back to the measured matmul."""
    monkeypatch.setattr(M.torch.cuda, "get_device_name", lambda device=None: gpu)
    monkeypatch.setattr(M, "measure_matmul_tflops", lambda dtype, device: 123.0)
    cuda = torch.device("cuda", 0)
    assert M.hardware.gpu_peak_tflops(cuda) == (gpu, peak)
    expected = peak if peak is not None else 123.0
    assert M.peak_tflops_per_rank(Metrics(), torch.float32, cuda, local_world_size=8) == expected
    assert M.peak_tflops_per_rank(Metrics(peak_tflops=7.0), torch.bfloat16, cuda, local_world_size=8) == 7.0
    source = M.peak_source(Metrics(), cuda)
    assert (gpu in source) == (peak is not None) and ("measured" in source) == (peak is None)


def _lines(path):
    return path.read_bytes().split(b"\n")


def test_resume_drops_a_torn_last_record_and_keeps_one_record_per_step(tmp_path, caplog):
    """What a SIGKILL can leave: a torn last line (dropped, with a warning), records of steps after
    the checkpoint (replaced); an older damage (a torn record with the next one glued on) and a
    step logged twice are reported or resolved to the later record."""
    cfg = Metrics(enable_tensorboard=False)
    path = tmp_path / "metrics.jsonl"
    whole = [json.dumps(_record(step=s, loss=float(s))) for s in (1, 2, 3, 2, 4, 5, 6)]
    whole[3] = json.dumps(_record(step=2, loss=22.0))  # step 2 again, from a later resumed run
    torn = json.dumps(_record(step=7))[:50]
    path.write_text("\n".join(whole) + "\n" + torn)
    with caplog.at_level("WARNING", logger="titan_thd"):
        log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
        log.log(_record(step=5, loss=55.0), last_step=6)
        assert _steps(path) == [1, 2, 3, 4, 5]  # on disk at once (a kill now loses nothing)
        log.log(_record(step=6, loss=66.0), last_step=6)
        log.close()
    assert "ends in a torn record (50 bytes" in caplog.text
    assert [(r["step"], r["loss"]) for r in map(json.loads, path.read_text().splitlines())] == [
        (1, 1.0),
        (2, 22.0),
        (3, 3.0),
        (4, 4.0),
        (5, 55.0),
        (6, 66.0),
    ]
    assert not (tmp_path / "metrics.jsonl.tmp").exists()

    glued = whole[2][:30] + whole[4]  # step 3 torn, step 4 glued onto it: both lost
    path.write_text("\n".join([whole[0], whole[1], glued, whole[5]]) + "\n")
    caplog.clear()
    with caplog.at_level("WARNING", logger="titan_thd"):
        log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
        log.log(_record(step=6), last_step=6)
        log.close()
    assert "line 3 is not a record: dropped" in caplog.text
    assert "has no record of 2 of the steps before 6 (first missing: 3)" in caplog.text
    assert _steps(path) == [1, 2, 5, 6]


def test_a_crash_while_rebuilding_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    old = "".join(json.dumps(_record(step=s)) + "\n" for s in range(1, 5))
    path.write_text(old)

    def killed(*args):
        raise KeyboardInterrupt  # the process dies between writing the new file and renaming it

    monkeypatch.setattr(M.os, "replace", killed)
    log = M.MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path), enabled=True)
    with pytest.raises(KeyboardInterrupt):
        log.log(_record(step=3), last_step=4)
    assert path.read_text() == old


def _tb_scalars(tb_dir, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_tensorboard_after_a_resume_has_one_value_per_step(tmp_path):
    """A run killed after step 6 (its event file torn at the end) resumes from step 4: readers see
    steps 1-4 of the first run and 5-7 of the second, once each."""
    cfg = Metrics(enable_tensorboard=True)
    log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
    for step in range(1, 7):
        log.log(_record(step=step, loss=float(step)), last_step=7)
    assert len(_tb_scalars(tmp_path / "tb", "loss")) == 6  # flushed every step: a kill loses none
    log.close()
    first = next((tmp_path / "tb").iterdir())
    os.truncate(first, first.stat().st_size - 7)  # as a kill in the middle of the last event leaves it
    log = M.MetricsLogger(cfg, str(tmp_path), enabled=True)
    for step in (5, 6, 7):
        log.log(_record(step=step, loss=10.0 * step), last_step=7)
    log.close()
    assert len(list((tmp_path / "tb").iterdir())) == 2
    assert _tb_scalars(tmp_path / "tb", "loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 4.0),
        (5, 50.0),
        (6, 60.0),
        (7, 70.0),
    ]
    assert [s for s, _ in _tb_scalars(tmp_path / "tb", "grad_norm")] == list(range(1, 8))


def test_an_mfu_above_100_percent_is_warned_once(tmp_path, caplog):
    log = M.MetricsLogger(Metrics(log_freq=100, enable_tensorboard=False), str(tmp_path), enabled=True)
    with caplog.at_level("INFO", logger="titan_thd"):
        for step, mfu in ((1, 50.0), (2, 114.6), (3, 130.0)):
            log.log(_record(step=step) | {"mfu": mfu}, last_step=9)
    log.close()
    warnings = [r.message for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "mfu 114.6 % at step 2" in warnings[0], warnings
