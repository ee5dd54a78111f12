"""training.compile = auto (titan_thd/models/compile.py `resolve_compile`): each reason it turns the
compile on or off, and the explicit choices taken as they are."""

from __future__ import annotations

import pytest

from titan_thd.models import compile as compile_mod
from titan_thd.models import get_model_spec
from titan_thd.models.compile import resolve_compile


@pytest.fixture
def with_compiler(monkeypatch):
    monkeypatch.setattr(compile_mod, "has_cpp_compiler", lambda: True)


def test_explicit_choices_are_taken_as_they_are(with_compiler):
    for choice in (True, False):
        d = resolve_compile(choice, "dsv4", 300, 1, "cpu")
        assert (d.on, d.reason) == (choice, "")
        assert d.describe().endswith(f"(training.compile = {str(choice).lower()})")


def test_auto_compiles_a_cpu_run_long_enough_to_repay_the_compile(with_compiler):
    short, long = (
        resolve_compile("auto", "dsv4", 300, 299, "cpu"),
        resolve_compile("auto", "dsv4", 300, 300, "cpu"),
    )
    assert not short.on and short.describe() == (
        "torch.compile: off (training.compile = auto: training.steps = 299 < 300, the steps dsv4 needs "
        "to repay the first step's compile)"
    )
    assert long.on and long.describe().startswith("torch.compile: regional, the element-wise chains (")
    assert long.reason.startswith("training.steps = 300 >= 300") and long.choice == "auto"


def test_auto_stays_off_where_nothing_was_measured_or_nothing_can_compile(monkeypatch, with_compiler):
    llama = resolve_compile("auto", "llama", 0, 10_000, "cpu")
    assert (
        llama.describe()
        == "torch.compile: off (training.compile = auto: llama's compiled regions were not measured faster)"
    )
    cuda = resolve_compile("auto", "dsv4", 300, 10_000, "cuda")
    assert not cuda.on and "not yet measured on cuda" in cuda.reason
    monkeypatch.setattr(compile_mod, "has_cpp_compiler", lambda: False)
    none = resolve_compile("auto", "dsv4", 300, 10_000, "cpu")
    assert not none.on and "no C++ compiler" in none.reason


def test_the_recipes_payback_steps():
    """dsv4's measured payback (docs/dsv4.md §18) turns its 40-step recipe's compile off; llama's
    one region was not measured faster, so `auto` never compiles it."""
    assert get_model_spec("dsv4").compile.payback_steps > 40
    assert get_model_spec("llama").compile.payback_steps == 0


def test_the_compile_clock_reports_the_first_step_and_recompiles(monkeypatch):
    seconds = iter([5.0, 32.0, 32.2, 35.2])  # at start-up (earlier compiles in the process), then per step
    monkeypatch.setattr(compile_mod, "compile_seconds", lambda: next(seconds))
    clock = compile_mod.CompileClock()
    assert clock.line(1, 40.0) == (
        "training.compile: step 1 took 40.0 s, 27.0 s of it compiling (torch.compile's own count)"
    )
    assert clock.line(2, 2.0) is None  # 0.2 s: guards, no new graph
    assert (
        clock.line(3, 6.5)
        == "training.compile: step 3 took 6.5 s, 3.0 s of it compiling (torch.compile's own count)"
    )
