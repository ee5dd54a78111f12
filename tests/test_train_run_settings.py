"""What a run is (components/run_settings.py, docs/design.md §3.11), through the trainer in this process:

- a resume with another schedule is refused (at load and in the preflight) with the changes and both
  ways on; with `checkpoint.allow_changes` it continues on the new schedule and the new weight decay
  (the checkpoint's hyperparameters no longer win silently); the checkpoint's values resume as they are;
- the settings that place the data position cannot change; bad allow_changes names are refused;
- a new run into a folder with another run's metrics is refused (naming the folder and the flags), a
  rerun of the same settings and `metrics.overwrite` replace them;
- every run ends with a summary line; a finished run's says how to train further, and that command,
  followed as printed, resumes and trains on; the header names the data file actually read.
"""

import json
import logging
import math
import re
import shlex
from pathlib import Path

import pytest
import torch

from tests.components.test_metrics import _record
from titan_thd.components.lr_scheduler import lr_factor
from titan_thd.components.metrics import MetricsLogger
from titan_thd.components.run_settings import check_resume, data_description, run_settings
from titan_thd.config import Metrics, load_config
from titan_thd.preflight import preflight
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer, main

pytestmark = pytest.mark.usefixtures("one_thread")

MOCK = (
    "--data.source", "mock",
    "--data.num_samples", "64",
    "--training.global_batch_size", "2",
    "--training.tokens_per_microbatch", "256",
    "--lr_scheduler.warmup_steps", "1",
    "--metrics.enable_tensorboard", "false",
    "--metrics.peak_tflops", "1",
)  # fmt: skip
"""Steps of two mock documents on the tiny llama: a fraction of a second each."""


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def args(tiny_llama, dump, steps, *extra):
    return [
        *MOCK,
        "--model.flavor",
        tiny_llama,
        "--training.steps",
        str(steps),
        "--job.dump_folder",
        str(dump),
        *extra,
    ]


def train(argv):
    trainer = Trainer(resolve_run(load_config(argv)))
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


def records(dump):
    return [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]


def test_resume_with_another_schedule_is_refused_or_continues_with_the_override(tmp_path, tiny_llama, caplog):
    ckpt = ["--checkpoint.enable", "true"]
    train(args(tiny_llama, tmp_path, 3, *ckpt))  # checkpoint step-3, a 3-step schedule
    step3 = tmp_path / "checkpoint" / "step-3"

    longer = args(tiny_llama, tmp_path, 5, *ckpt, "--optimizer.weight_decay", "0.3")
    said = (
        rf"checkpoint {step3} was saved by a run with other settings: lr_scheduler.total_steps \(the LR "
        r"schedule's length; 0 = training.steps\) 3 -> 5, optimizer.weight_decay 0.1 -> 0.3\. Resuming would "
        r"change the run: pass --checkpoint.allow_changes lr_scheduler.total_steps,optimizer.weight_decay to "
        r"continue with the new values, or run with the checkpoint's \(--lr_scheduler.total_steps 3 "
        r"--optimizer.weight_decay 0.1\)$"
    )
    with pytest.raises(ValueError, match=said):
        preflight(resolve_run(load_config(longer), 1))
    trainer = Trainer(resolve_run(load_config(longer)))
    try:
        with pytest.raises(ValueError, match=said):
            trainer.train()  # refused before anything is loaded or trained
        assert trainer.step == 0
    finally:
        trainer.close()
    assert [r["step"] for r in records(tmp_path)] == [1, 2, 3]

    # The checkpoint's values: the same run, trained further on its finished schedule.
    pinned = args(tiny_llama, tmp_path, 4, *ckpt, "--lr_scheduler.total_steps", "3")
    train(pinned)
    lr = 3e-4  # optimizer.lr default
    assert records(tmp_path)[3]["lr"] == pytest.approx(lr * 0.1, rel=1e-12)  # min_lr_factor, after the end

    # The override: the new schedule from step 5 on and the new weight decay take effect, logged.
    allow = ["--checkpoint.allow_changes", "lr_scheduler.total_steps,optimizer.weight_decay"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="titan_thd"):
        trainer = train([*longer, *allow])
    assert (
        f"checkpoint: resuming {tmp_path / 'checkpoint' / 'step-4'} with changed settings "
        "(checkpoint.allow_changes): lr_scheduler.total_steps (the LR schedule's length; 0 = training.steps) "
        "3 -> 5, optimizer.weight_decay 0.1 -> 0.3"
    ) in caplog.text
    got = records(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]  # appended, one record per step
    want = lr * lr_factor(4, warmup_steps=1, total_steps=5, decay="cosine", min_lr_factor=0.1)
    assert got[4]["lr"] == pytest.approx(want, rel=1e-12)
    decays = {g["weight_decay"] for opt in trainer.optimizers.optimizers for g in opt.param_groups}
    assert decays <= {0.3, 0.0} and 0.3 in decays  # not the checkpoint's 0.1
    # The run's record now holds the new settings: the same command again resumes without a word.
    assert json.loads((tmp_path / "run.json").read_text())["settings"]["optimizer.weight_decay"] == 0.3


def _hint(messages: list[str], step: int) -> tuple[str, list[str]]:
    """(why, the trainer's argv) of the summary's `to train to step N (why): ./run_train.sh --config X ...`."""
    (summary,) = [m for m in messages if m.startswith("summary: ")]
    why, command = re.search(
        rf"; to train to step {step} \((.+?)\): (\./run_train\.sh .*)$", summary
    ).groups()
    launcher, flag, name, *rest = shlex.split(command)
    assert (launcher, flag) == ("./run_train.sh", "--config")
    return why, [
        "--job.config_file",
        str(Path(__file__).resolve().parents[1] / "train_configs" / name),
        *rest,
    ]


@pytest.mark.parametrize("pinned", [False, True])
def test_the_summary_s_command_to_train_further_is_accepted_as_printed(tmp_path, tiny_llama, caplog, pinned):
    """A finished run's summary names a command that trains it further; run as printed it resumes (no
    refusal), and the learning rate of the new steps is the schedule the message announces."""
    recipe = Path(__file__).resolve().parents[1] / "train_configs" / "debug_dense_thd.toml"
    pin = ["--lr_scheduler.total_steps", "2"] if pinned else []
    first = [
        "--job.config_file",
        str(recipe),
        *args(tiny_llama, tmp_path, 2, "--checkpoint.enable", "true", *pin),
    ]
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        assert main(first) == 0
    why, further = _hint(caplog.messages, 4)
    assert ("--checkpoint.allow_changes" in further) != pinned
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        assert main(further) == 0, caplog.text
    got = records(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    lr = 2e-3  # debug_dense_thd.toml's optimizer.lr
    total = 2 if pinned else 4
    assert why == (
        "the LR schedule keeps its lr_scheduler.total_steps = 2"
        if pinned
        else "the LR schedule is 4 steps long from here on"
    )
    for r in got[2:]:
        want = lr * lr_factor(
            r["step"] - 1, warmup_steps=1, total_steps=total, decay="cosine", min_lr_factor=0.1
        )
        assert r["lr"] == pytest.approx(want, rel=1e-12)
    # The resumed run finished too: its own summary says how to go on, each flag once.
    again = _hint(caplog.messages, 8)[1]
    assert again.count("--training.steps") == 1 and again[again.index("--training.steps") + 1] == "8"
    assert again.count("--checkpoint.allow_changes") == (0 if pinned else 1)


def test_fixed_settings_and_bad_override_names(tmp_path, tiny_llama, caplog):
    saved = run_settings(load_config(args(tiny_llama, tmp_path, 3)))
    seed = run_settings(load_config(args(tiny_llama, tmp_path, 3, "--training.seed", "7")))
    with pytest.raises(
        ValueError, match=r"with training.seed 42 -> 7: these place the checkpoint's data position "
    ):
        check_resume(saved, seed, ("training.seed",), tmp_path)
    with pytest.raises(ValueError, match="checkpoint.allow_changes: training.seed cannot change on a resume"):
        load_config(args(tiny_llama, tmp_path, 3, "--checkpoint.allow_changes", "training.seed"))
    with pytest.raises(
        ValueError, match=r"checkpoint.allow_changes: got 'training.stepz', expected run settings"
    ):
        load_config(args(tiny_llama, tmp_path, 3, "--checkpoint.allow_changes", "training.stepz"))
    # Layout and training.steps are how the run is computed: logged, never refused.
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        check_resume(
            saved, saved, (), tmp_path, {"dp": 1, "training.steps": 3}, {"dp": 2, "training.steps": 9}
        )
    assert caplog.messages == [
        f"checkpoint: resuming {tmp_path} with another layout or length (how the run is computed, not what it "
        "trains; DCP reshards): dp 1 -> 2, training.steps 3 -> 9"
    ]


def test_new_run_does_not_replace_another_runs_metrics(tmp_path, tiny_llama, capsys, caplog):
    first = args(tiny_llama, tmp_path, 2)
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        assert main(first) == 0
    summary = [m for m in caplog.messages if m.startswith("summary: ")]
    assert len(summary) == 1 and re.fullmatch(
        rf"summary: steps 1-2 of 2, [\d,]+ tokens in all, 0m\d\ds, final loss \d\.\d{{4}}; metrics "
        rf"{tmp_path / 'metrics.jsonl'}; no checkpoint \(--checkpoint.enable true saves them and resumes\)",
        summary[0],
    ), summary
    assert math.isclose(
        float(summary[0].split("final loss ")[1].split(";")[0]), records(tmp_path)[-1]["loss"], abs_tol=1e-4
    )
    assert any(m.startswith("data mock mock lengths ") for m in caplog.messages)
    before = records(tmp_path)

    other = [*first, "--optimizer.lr", "1e-3"]
    assert main(other) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"error: job.dump_folder = {str(tmp_path)!r} holds metrics.jsonl of another run (2 records; settings: "
        "optimizer.lr 0.0003 -> 0.001): choose another --job.dump_folder for this run, or pass "
        "--metrics.overwrite true to replace it"
    ]
    assert records(tmp_path) == before  # untouched

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        assert main(first) == 0  # the same command again (the quick start twice): replaced, said
    assert (
        f"metrics: replacing {tmp_path / 'metrics.jsonl'} (2 records) of an earlier run of the same settings"
        in caplog.messages
    )
    assert [r["step"] for r in records(tmp_path)] == [1, 2]
    assert main([*other, "--metrics.overwrite", "true"]) == 0
    lrs = [r["lr"] for r in records(tmp_path)]
    assert lrs == pytest.approx([1e-3 / 2, 1e-4], rel=1e-12)  # this run's own schedule


def test_a_new_run_deletes_the_replaced_runs_tensorboard_events(tmp_path):
    tb = tmp_path / "tb"
    tb.mkdir()
    (tb / "events.out.tfevents.1.old").write_bytes(b"old run")
    logger = MetricsLogger(Metrics(enable_tensorboard=False), str(tmp_path), enabled=True, settings={"a": 1})
    logger.log(_record(step=1), last_step=1)
    logger.close()
    assert not list(tb.iterdir())
    assert json.loads((tmp_path / "run.json").read_text()) == {"settings": {"a": 1}}


def test_header_names_the_data_actually_read(tmp_path, monkeypatch):
    own = tmp_path / "mine.jsonl"
    own.write_text(json.dumps({"text": "hello"}) + "\n")
    monkeypatch.chdir(tmp_path)
    cfg = load_config(["--data.source", "jsonl", "--data.path", "mine.jsonl"])
    assert data_description(cfg) == str(own)
    cfg = load_config(["--data.source", "jsonl", "--data.path", "chat_sft.jsonl.gz"])
    assert data_description(cfg) == "titan_thd/assets/chat_sft.jsonl.gz (embedded)"
