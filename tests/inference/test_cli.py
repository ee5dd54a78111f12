"""scripts/generate.py and scripts/evaluate.py on a real trainer checkpoint (dsv4 micro, 2 steps): the
issue's command line prints the greedy completion that the library computes; every bad input is one
`error:` line with exit code 2 (a checkpoint of another flavor, a missing tokenizer, a prompt longer
than the context); evaluate.py prints the accuracies."""

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import TRAIN_ARGS
from titan_thd.config import load_config
from titan_thd.inference.loading import config_argv, load_model
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = "train_configs/dsv4_flash_thd.toml"
MICRO = ["--model.flavor", "micro"]
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    dump = tmp_path_factory.mktemp("run")
    argv = [
        *config_argv(CONFIG),
        *TRAIN_ARGS,
        *MICRO,
        "--training.steps",
        "2",
        "--training.global_batch_size",
        "4",
    ]
    trainer = Trainer(
        resolve_run(load_config([*argv, "--checkpoint.enable", "true", "--job.dump_folder", str(dump)]))
    )
    try:
        trainer.train()
    finally:
        trainer.close()
    return dump / "checkpoint" / "step-2"


def script(name, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        check=False,
    )


@pytest.mark.slow
def test_generate_command_line_prints_the_greedy_completion(checkpoint):
    proc = script(
        "generate.py",
        *("--checkpoint", str(checkpoint), "--config", CONFIG, *MICRO),
        *("--prompt", "What is 12 + 7?", "--temperature", "0", "--max_new_tokens", "24"),
    )
    assert proc.returncode == 0, proc.stderr
    loaded = load_model(
        [*config_argv(CONFIG), *MICRO], checkpoint.parent.parent
    )  # the run folder: newest step
    assert loaded.source.endswith(f"checkpoint {checkpoint}")
    prompt = loaded.chat_prompt([{"role": "user", "content": "What is 12 + 7?"}])
    (completion,) = loaded.generate([prompt], 24)
    assert proc.stdout == loaded.tokenizer.decode(completion.text_ids(loaded.stop_ids)) + "\n"
    assert "tokens/s" in proc.stderr


def load_script(name):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), ROOT / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            [],
            r"error: checkpoint .*step-2 was saved from another model: flavor: checkpoint 'micro', this run 'tiny'",
        ),
        (
            [*MICRO, "--data.tokenizer", "/nonexistent/tokenizer.json"],
            r"error: data.tokenizer: '/nonexistent/tokenizer.json' is not a file",
        ),
        (
            [*MICRO, "--training.tokens_per_microbatch", "16"],
            r"error: prompt 0 has 19 tokens; the model's context is 16 tokens",
        ),
    ],
    ids=["other_flavor", "missing_tokenizer", "prompt_too_long"],
)
def test_bad_input_is_one_error_line(checkpoint, extra, message, capsys):
    main = load_script("generate.py").main
    rc = main(["--checkpoint", str(checkpoint), "--config", CONFIG, *extra, "--prompt", "What is 12 + 7?"])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and out == "" and "Traceback" not in err
    assert len(errors) == 1 and re.match(message, errors[0]), err


def test_evaluate_prints_the_accuracies(checkpoint, capsys):
    main = load_script("evaluate.py").main
    assert main(["--checkpoint", str(checkpoint), "--config", CONFIG, *MICRO, "--limit", "3"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    all_line = next(line for line in out.splitlines() if line.startswith("all "))
    assert all_line.count("accuracy") == 2 and "3 held-out conversations" in out
    problems = int(out.split("held-out conversations, ")[1].split()[0])
    assert f"evaluate: {problems}/{problems} problems answered" in captured.err  # progress on stderr


def test_layout_free_loading_keeps_the_weights(checkpoint):
    """What the checkpoint holds is what the model gets (the trainer's weights after step 2)."""
    import torch.distributed.checkpoint as dcp

    loaded = load_model([*config_argv(CONFIG), *MICRO], checkpoint)
    state = {"model": {k: torch.empty_like(v) for k, v in loaded.model.state_dict().items()}}
    dcp.load(state, checkpoint_id=checkpoint)
    assert all(torch.equal(v, state["model"][k]) for k, v in loaded.model.state_dict().items())


def test_chat_and_interactive_continue_the_conversation(checkpoint, capsys, monkeypatch):
    main = load_script("generate.py").main
    base = ["--checkpoint", str(checkpoint), "--config", CONFIG, *MICRO, "--max_new_tokens", "8"]
    chat = '[{"role": "user", "content": "What is 12 + 7?"}]'
    assert main([*base, "--chat", chat]) == 0
    reply = capsys.readouterr().out
    assert main([*base, "--prompt", "What is 12 + 7?"]) == 0
    assert capsys.readouterr().out == reply  # one user turn either way
    lines = iter(["What is 12 + 7?", "Now add 5 to that.", ""])
    monkeypatch.setattr("builtins.input", lambda prompt="": next(lines))
    assert main([*base, "-i"]) == 0
    out = capsys.readouterr().out
    assert out.count("assistant> ") == 2 and out.startswith("assistant> " + reply)
    assert main([*base, "--chat", "[1, 2]"]) == 2
    assert "error: --chat: expected a JSON list of {role, content} messages" in capsys.readouterr().err
