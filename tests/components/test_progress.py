"""Start-up phases that can run for minutes say what they do and how far they are
(components/progress.py, docs/results.md §14): a line at the start, then one every `every` seconds
with the count and an ETA."""

import logging
import time

from titan_thd.components.progress import Progress


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "titan_thd"]


def test_a_running_phase_says_how_far_it_is(caplog):
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        with Progress("measuring", 4, "forwards", weight=8, every=0.05) as p:
            p.advance(2)  # a quarter of the weight done in one part of four
            time.sleep(0.3)
            p.advance(6)
    lines = _lines(caplog)
    assert lines[0] == "measuring: 0/4 forwards after 0 s"  # announced at the start
    beats = lines[1:]
    assert len(beats) >= 2 and all(line.startswith("measuring: 1/4 forwards after ") for line in beats)
    assert all(line.endswith(" s left") for line in beats)  # 3 x the elapsed time: 6 of 8 to do
    n = len(lines)
    time.sleep(0.15)
    assert len(_lines(caplog)) == n  # the phase is over: no more lines


def test_a_short_phase_that_is_not_announced_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        with Progress("planning", 1, announce=False, every=5.0) as p:
            p.advance()
    assert _lines(caplog) == []
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        with Progress("waiting", 1, enabled=False, every=0.01):  # not a logging rank
            time.sleep(0.05)
    assert _lines(caplog) == []


def test_eta_scales_the_elapsed_time_by_the_weight_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("titan_thd.components.progress.time.monotonic", lambda: now[0])
    p = Progress("x", 3, "parts", weight=10.0)
    p.advance(2.0)
    now[0] += 20.0
    assert p.line() == "x: 1/3 parts after 20 s, about 80 s left"


def test_the_first_step_counts_its_microbatches_once():
    """The trainer's first step (pipeline/runner.py LazyInputs): reading microbatch i counts 0..i-1
    done; an interleaved schedule's later chunk reads a microbatch again without counting it twice."""
    from titan_thd.pipeline.runner import LazyInputs

    p = Progress("step 1", 4, "microbatches done", enabled=False)
    inputs = LazyInputs(["a", "b", "c", "d"], str.upper, p)
    assert [inputs[i] for i in (0, 1, 0, 1, 2, 3, 2, 3)] == list("ABABCDCD")
    assert p.count == 3  # the last one is done when the step is


def test_the_first_step_of_a_run_says_how_far_it_is(tmp_path, tiny_llama, monkeypatch, caplog):
    """A first step longer than the progress period (compile, emulated bf16) logs its microbatch
    count while it runs; the later steps do not (their step lines come at the usual pace)."""
    from tests.conftest import TRAIN_ARGS
    from titan_thd.train import Trainer, main

    monkeypatch.setattr("titan_thd.components.progress.EVERY", 0.02)
    prepare = Trainer.local_inputs

    def slow(self, microbatch):  # every microbatch takes longer than the period
        time.sleep(0.05)
        return prepare(self, microbatch)

    monkeypatch.setattr(Trainer, "local_inputs", slow)
    argv = [*TRAIN_ARGS, "--model.name", "llama", "--model.flavor", tiny_llama, "--training.steps", "2"]
    argv += ["--metrics.peak_tflops", "1", "--job.dump_folder", str(tmp_path)]
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        assert main(argv) == 0
    lines = [m for m in _lines(caplog) if m.startswith("step ") and "microbatches done" in m]
    assert lines and all(m.startswith("step 1: ") for m in lines), lines
    assert any(" 1/2 microbatches done after " in m for m in lines), lines
