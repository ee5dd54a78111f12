"""scripts/bench_llama_vs_torchtitan.py without torchtitan: a message and exit code 0, nothing run
(torchtitan is not a dependency; the comparison itself is a measurement, never a test)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_llama_vs_torchtitan.py"


def test_without_torchtitan_it_says_so_and_exits_0(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("bench_llama_vs_torchtitan", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setitem(sys.modules, "torchtitan", None)  # `import torchtitan` raises ImportError
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    assert bench.main() == 0
    assert "torchtitan is not installed" in capsys.readouterr().out
