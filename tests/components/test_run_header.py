"""The header names the model as configured: family/flavor, or the config.json the architecture is read
from when model.flavor is empty (components/run_header.py)."""

from __future__ import annotations

import dataclasses
import logging
import re

import pytest
import torch

from tests.conftest import TRAIN_ARGS
from titan_thd.components.run_header import model_name
from titan_thd.config import load_config
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

MICRO = dataclasses.replace(flavors["micro"], vocab_size=320)  # the byte tokenizer's ids


def test_model_name_with_and_without_a_flavor():
    cfg = load_config(["--model.name", "dsv4", "--model.hf_path", "/some/hf"])
    assert model_name(cfg, "micro") == "dsv4/micro"
    assert model_name(cfg, "") == "dsv4 (config.json of /some/hf)"


@pytest.mark.parametrize("flavor", ["", "micro"])
def test_the_header_of_a_run_on_a_folder_names_its_architecture(tmp_path, caplog, flavor):
    torch.manual_seed(7)
    hf = export_hf(build_dsv4(MICRO), MICRO, tmp_path / "hf")
    argv = [
        *TRAIN_ARGS,
        *("--model.name", "dsv4", "--model.flavor", flavor, "--model.hf_path", str(hf)),
        *("--training.steps", "1", "--training.global_batch_size", "2", "--metrics.peak_tflops", "1"),
        *("--data.cache_dir", str(tmp_path / "cache"), "--job.dump_folder", str(tmp_path / "run")),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with caplog.at_level(logging.INFO, logger="titan_thd"):
            trainer = Trainer(resolve_run(load_config(argv)))
            try:
                trainer.train()
            finally:
                trainer.close()
    finally:
        torch.set_num_threads(threads)
    (line,) = [m for m in caplog.messages if m.startswith("model dsv4")]
    named = "dsv4/micro" if flavor else f"dsv4 (config.json of {hf})"
    assert re.fullmatch(rf"model {re.escape(named)}: [\d,]+ parameters, vocab 320 .*", line), line
