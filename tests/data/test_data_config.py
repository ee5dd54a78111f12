"""Derived and file-given data settings: data.pad_to_multiple = 0 (the default) becomes what the CP mode
needs (in the start-up checks); data.mock_config may name a JSON file holding the table."""

from __future__ import annotations

import json

import pytest

from titan_thd.config import load_config
from titan_thd.data.mock import mock_lengths
from titan_thd.startup import resolve_run

CP2 = ("--parallelism.context_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "1")


@pytest.mark.parametrize(
    "args, pad",
    [
        ((), 1),  # no CP
        (CP2, 4),  # llama: zigzag (auto), 2 x cp
        ((*CP2, "--parallelism.context_parallel_mode", "hybrid"), 4),  # long documents are zigzagged
        (("--parallelism.context_parallel_degree", "4", "--parallelism.context_parallel_mode", "zigzag"), 8),
        ((*CP2, "--model.name", "dsv4", "--model.flavor", "micro"), 1),  # contiguous (auto): rows, not docs
        ((*CP2, "--data.pad_to_multiple", "8"), 8),  # an explicit multiple of 2 x cp stays
    ],
)
def test_pad_to_multiple_defaults_to_what_the_cp_mode_needs(args, pad, tmp_path):
    cfg = load_config([*args, "--job.dump_folder", str(tmp_path)])
    before = repr(cfg)
    run = resolve_run(cfg, cfg.parallelism.context_parallel_degree)  # dp 1; the CP rules accept the value
    assert run.pad_to_multiple == run.layout(0).pad_to_multiple == pad
    assert repr(cfg) == before  # resolved in the Run, the config as loaded


def test_pad_to_multiple_refusals_name_the_numbers(tmp_path):
    cfg = load_config(
        ["--parallelism.context_parallel_degree", "3", "--training.tokens_per_microbatch", "1000"]
    )
    with pytest.raises(
        ValueError,
        match=r"tokens_per_microbatch = 1000 is not a multiple of data.pad_to_multiple = 6 \(the default for "
        r"context_parallel_degree 3\)",
    ):
        resolve_run(cfg, 3)
    cfg = load_config(["--training.tokens_per_microbatch", "100", "--data.pad_to_multiple", "8"])
    with pytest.raises(
        ValueError,
        match=r"training.tokens_per_microbatch = 100 is not a multiple of data.pad_to_multiple = 8$",
    ):
        resolve_run(cfg, 1)  # an explicit value: no default to explain
    cfg = load_config([*CP2, "--data.pad_to_multiple", "2", "--job.dump_folder", str(tmp_path)])
    with pytest.raises(ValueError, match=r"data.pad_to_multiple = 2 must be a multiple of 4"):
        resolve_run(cfg, 2)  # an explicit wrong value is still refused


def test_mock_config_from_a_json_file(tmp_path, monkeypatch):
    table = {
        "mode": "distribution",
        "type": "lognormal",
        "min_seq_len": 8,
        "max_seq_len": 64,
        "mean_seq_len": 20,
        "lognormal_sigma": 0.5,
    }
    (tmp_path / "lengths.json").write_text(json.dumps(table))
    monkeypatch.chdir(tmp_path)  # relative paths: against the working directory
    from_file = load_config(["--data.mock_config", "lengths.json"]).data.mock_config
    assert from_file == table
    toml = tmp_path / "run.toml"
    toml.write_text('[data]\nmock_config = "lengths.json"\n')
    assert load_config(["--job.config_file", str(toml)]).data.mock_config == table
    inline = load_config(["--data.mock_config", json.dumps(table)]).data.mock_config
    assert (mock_lengths(from_file, 100, 0) == mock_lengths(inline, 100, 0)).all()


@pytest.mark.parametrize(
    "text, message",
    [
        (None, r"data.mock_config = 'm.json': .*m.json does not exist"),
        (
            '{"mode": "file",\n "path": }',
            r"data.mock_config = 'm.json': .*m.json: invalid JSON: .*line 2 column 10",
        ),
        ("[1, 2]", r"data.mock_config = 'm.json': .*m.json holds a JSON list, expected an object"),
    ],
)
def test_mock_config_file_errors_name_the_file(text, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    if text is not None:
        (tmp_path / "m.json").write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(["--data.mock_config", "m.json"])
