"""The README as a front door: short (at most 250 lines), its map names every recipe, its benchmark pointer
leads to a list that names every benchmark, and its LoRA chain runs as written (train adapters on an HF
base, ask the LoRA checkpoint with generate.py, write the adapters for peft) on a micro base, in this
process; generate.py's and evaluate.py's --help show the same LoRA checkpoint command.

The heavier twin, tests/lora/test_lora_export.py::test_readme_lora_chain_runs_as_written (extended), runs
the chain on the recipes' own models and compares with transformers + peft."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest
import torch

from titan_thd.inference.loading import config_argv
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors
from titan_thd.train import main as train_main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def lora_chain() -> list[str]:
    (block,) = [b for b in blocks("bash") if "convert_hf.py to-peft" in b]
    return [line for line in block.splitlines() if line.strip()]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_is_at_most_250_lines():
    assert README.count("\n") <= 250


def test_the_map_names_every_recipe():
    section = README[README.index("## Repository map") :].split("\n## ")[0]
    tree = section.split("```")[1]
    recipes = sorted(p.name for p in (ROOT / "train_configs").glob("*.toml"))
    assert len(recipes) >= 3
    assert [r for r in recipes if r not in tree] == []


def test_every_benchmark_is_in_the_list_the_readme_points_to():
    assert "docs/results.md §18" in README
    results = (ROOT / "docs" / "results.md").read_text()
    listed = results[results.index("## 18. ") :].split("\n## ")[0]
    rows = re.findall(r"^\| `(benchmarks/bench_\w+\.py)` \|", listed, flags=re.M)
    on_disk = sorted(f"benchmarks/{p.name}" for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert len(on_disk) >= 18 and sorted(rows) == on_disk


def _help_commands(name: str) -> list[str]:
    """The example commands of a script's --help, continuation lines joined."""
    text = load_script(name).__doc__.replace("\\\n", " ")
    return [
        " ".join(line.split()) for line in text.splitlines() if line.strip().startswith(".venv/bin/python")
    ]


def test_generate_and_evaluate_help_show_the_readme_s_lora_checkpoint_command():
    (ask,) = [line for line in lora_chain() if "scripts/generate.py" in line]
    assert ask in _help_commands("generate.py")
    lora_args = ask.split(" --prompt ")[0].split("scripts/generate.py ")[1]
    assert "--checkpoint outputs/dsv4_flash_lora " in lora_args and "--model.hf_path " in lora_args
    assert any(lora_args in c for c in _help_commands("evaluate.py"))


def test_the_readme_s_lora_chain_runs_as_written(tmp_path, monkeypatch):
    """Each line of the README's LoRA block, run as written from a scratch folder whose
    outputs/dsv4_flash_thd/hf holds a micro dsv4 (the README's base is the recipe's export, minutes of
    training); the training line gets 2 steps of 4 conversations."""
    monkeypatch.chdir(tmp_path)
    micro = dataclasses.replace(flavors["micro"], vocab_size=320)  # the byte tokenizer's ids
    torch.manual_seed(7)
    export_hf(build_dsv4(micro), micro, tmp_path / "outputs" / "dsv4_flash_thd" / "hf")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train, ask, peft = lora_chain()
        args = shlex.split(train)
        assert args[:3] == ["./run_train.sh", "--config", "dsv4_flash_lora.toml"]
        short = ["--training.steps", "2", "--training.global_batch_size", "4", "--metrics.peak_tflops", "1"]
        assert train_main([*config_argv(args[2]), *args[3:], *short]) == 0
        assert (tmp_path / "outputs" / "dsv4_flash_lora" / "checkpoint" / "step-2").is_dir()

        for line, script in ((ask, "generate.py"), (peft, "convert_hf.py")):
            python, path, *rest = shlex.split(line)
            assert (python, path) == (".venv/bin/python", f"scripts/{script}")
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = load_script(script).main(rest)
            assert rc == 0, err.getvalue()[-2000:]
            if script == "generate.py":
                assert "(LoRA adapters on outputs/dsv4_flash_thd/hf)" in err.getvalue()
                assert out.getvalue().strip()
    finally:
        torch.set_num_threads(threads)
    peft_dir = tmp_path / "outputs" / "dsv4_flash_lora_peft"
    assert {p.name for p in peft_dir.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors"}


def test_the_readme_s_vllm_chain_runs_as_written_up_to_serving(tmp_path, monkeypatch):
    """The README's vLLM block, run as written from a scratch folder on a micro dsv4 export: to-release
    writes the base in the release's format, the LoRA recipe trains on it (2 steps), to-vllm writes the
    adapters and prints the `vllm serve` line (serving itself needs vLLM on a GPU: not run here)."""
    monkeypatch.chdir(tmp_path)
    micro = dataclasses.replace(flavors["micro"], vocab_size=320)
    torch.manual_seed(7)
    export_hf(build_dsv4(micro), micro, tmp_path / "outputs" / "dsv4_flash_thd" / "hf")
    (block,) = [b for b in blocks("bash") if "convert_hf.py to-vllm" in b]
    release, train, to_vllm = [line for line in block.splitlines() if line.strip()]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = io.StringIO()
        for line in (release, None, to_vllm):
            if line is None:
                args = shlex.split(train)
                short = [
                    "--training.steps",
                    "2",
                    "--training.global_batch_size",
                    "4",
                    "--metrics.peak_tflops",
                    "1",
                ]
                assert train_main([*config_argv(args[2]), *args[3:], *short]) == 0
                continue
            python, path, *rest = shlex.split(line)
            assert (python, path) == (".venv/bin/python", "scripts/convert_hf.py")
            err = io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                assert load_script("convert_hf.py").main(rest) == 0, err.getvalue()[-2000:]
    finally:
        torch.set_num_threads(threads)
    adapters = tmp_path / "outputs" / "lora_release_vllm"
    assert {p.name for p in adapters.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    serve = next(line for line in out.getvalue().splitlines() if "vllm serve" in line)
    assert "outputs/dsv4_flash_release" in serve and "--enable-lora" in serve and "--max-lora-rank" in serve
