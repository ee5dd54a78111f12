"""The README's Hugging Face round trip, run as written: train (the quick start with a checkpoint), install
the hf extra, convert with the run's config, then the README's transformers snippet, whose greedy text must
be what our own generation gives, as must the README's generate.py line; and the
dense model's conversion to LlamaForCausalLM.

The commands run in a scratch folder that holds `.venv` and `scripts` (links to this checkout), so that
their relative paths (`outputs/...`) land there. One deviation: the training command gets
`--training.steps 2` and a smaller batch (40 steps take minutes), so the checkpoint is `step-2` and the
commands' `step-40` / `step-80` are read as the newest step. `./scripts/setup_env.sh hf` runs in the
checkout itself (it installs into its .venv; with the test extra installed it has nothing to do).
"""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

from titan_thd.inference.loading import config_argv, load_model

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()
SHORT = "--training.steps 2 --training.global_batch_size 4 --metrics.enable_tensorboard false --metrics.peak_tflops 1"
SHORT = SHORT.split()
pytest.importorskip("transformers")


def readme_blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def hf_round_trip() -> tuple[list[str], str]:
    """The README's bash block with `convert_hf.py to-hf outputs/dsv4_flash_thd` and the python block after it."""
    start = README.index("scripts/convert_hf.py to-hf outputs/dsv4_flash_thd")
    bash = next(b for b in readme_blocks("bash") if "scripts/convert_hf.py to-hf outputs/dsv4_flash_thd" in b)
    python = next(b for b in readme_blocks("python") if README.index(b) > start)
    return [line for line in bash.splitlines() if line.strip() and not line.startswith("#")], python


def run(line: str, cwd: Path, step: int):
    args = shlex.split(line.replace("step-40", f"step-{step}").replace("step-80", f"step-{step}"))
    if args[0] == "./run_train.sh":
        args = [str(ROOT / "run_train.sh"), *args[1:], *SHORT]
    elif args[0] == "./scripts/setup_env.sh":
        cwd = ROOT
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, f"{line}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture
def scratch(tmp_path):
    for name in (".venv", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    return tmp_path


@pytest.mark.slow
@pytest.mark.extended  # 45 s; the default run exports through the README's dense commands
def test_readme_hf_round_trip_runs_as_written(scratch):
    lines, snippet = hf_round_trip()
    assert lines == [
        "./run_train.sh --config dsv4_flash_thd.toml --checkpoint.enable true",
        "./scripts/setup_env.sh hf",
        ".venv/bin/python scripts/convert_hf.py to-hf outputs/dsv4_flash_thd/checkpoint/step-40 "
        "outputs/dsv4_flash_thd/hf --config dsv4_flash_thd.toml",
    ]
    for line in lines:
        run(line, scratch, step=2)
    proc = subprocess.run(
        [str(scratch / ".venv/bin/python"), "-c", snippet],
        cwd=scratch,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The README's generate.py line (the quick start's "Ask the trained model"): the same text.
    ask = next(b for b in readme_blocks("bash") if "scripts/generate.py --checkpoint" in b)
    ask = " ".join(ask.replace("\\\n", " ").split("\n")[1].split())
    assert ask.startswith(
        ".venv/bin/python scripts/generate.py --checkpoint outputs/dsv4_flash_thd/checkpoint/step-40"
    )
    ours = run(ask, scratch, step=2).stdout
    # Our own greedy generation of the same prompt and budget, special tokens dropped as the snippet does.
    loaded = load_model(
        config_argv("dsv4_flash_thd.toml"), scratch / "outputs/dsv4_flash_thd/checkpoint/step-2"
    )
    prompt = loaded.chat_prompt([{"role": "user", "content": "What is 12 + 7?"}])
    (completion,) = loaded.generate([prompt], 24)
    text = loaded.tokenizer.decode(t for t in completion.tokens if t not in loaded.tokenizer.special_ids)
    assert proc.stdout == text + "\n"
    assert ours == loaded.tokenizer.decode(completion.text_ids(loaded.stop_ids)) + "\n"


@pytest.mark.slow
def test_readme_dense_export_is_a_llama_for_causal_lm(scratch):
    line = re.search(
        r"`(\.venv/bin/python scripts/convert_hf\.py to-hf outputs/debug_dense_thd\S* [^`]*)`", README
    )[1]
    train = re.search(
        r"after `(\./run_train\.sh --config debug_dense_thd\.toml --checkpoint\.enable true)`", README
    )[1]
    run(train, scratch, step=2)
    run(line, scratch, step=2)
    check = "import transformers; print(type(transformers.AutoModelForCausalLM.from_pretrained('outputs/debug_dense_thd/hf')).__name__)"
    proc = subprocess.run(
        [sys.executable, "-c", check], cwd=scratch, capture_output=True, text=True, timeout=300
    )
    assert proc.stdout.strip() == "LlamaForCausalLM", proc.stderr[-2000:]


def test_the_test_extra_holds_the_hf_extra():
    """setup_env.sh treats an hf request as done when the test extra is installed: true while test lists hf's packages."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(extras["hf"]) <= set(extras["test"])


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_convert_names_the_hf_extra_when_safetensors_is_missing(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("convert_hf", ROOT / "scripts" / "convert_hf.py")
    convert = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(convert)
    monkeypatch.setitem(sys.modules, "safetensors", None)
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    import torch.distributed.checkpoint as dcp

    from titan_thd.models.dsv4 import build_dsv4, flavors

    dcp.save(
        {"model": build_dsv4(flavors["micro"]).state_dict()}, checkpoint_id=tmp_path / "dcp", no_dist=True
    )
    assert convert.main(["to-hf", str(tmp_path / "dcp"), str(tmp_path / "hf"), "--flavor", "micro"]) == 1
    assert (
        "needs the hf extra (safetensors, transformers): install it with ./scripts/setup_env.sh hf"
        in capsys.readouterr().err
    )
