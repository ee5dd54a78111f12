import dataclasses

import pytest

from titan_thd.config import CHOICES, Config, field_docs, help_text, load_config, to_toml


def _toml(tmp_path, text, name="run.toml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_defaults_without_arguments():
    assert load_config([]) == Config()


def test_precedence_cli_over_toml_over_defaults(tmp_path):
    path = _toml(tmp_path, "[training]\nsteps = 7\nseed = 3\n[optimizer]\nlr = 1e-3\n")
    cfg = load_config(["--job.config_file", path, "--training.steps", "9"])
    assert cfg.training.steps == 9  # CLI wins over TOML
    assert cfg.training.seed == 3  # TOML wins over the default
    assert cfg.optimizer.lr == 1e-3
    assert cfg.training.global_batch_size == Config().training.global_batch_size  # default
    assert cfg.job.config_file == path
    # The file is read first even when named after the overrides.
    assert load_config(["--training.steps", "9", f"--job.config_file={path}"]).training.steps == 9


def test_cli_value_forms():
    cfg = load_config(
        [
            "--checkpoint.enable",
            "true",
            "--metrics.enable_tensorboard=False",
            "--parallelism.data_parallel_shard_degree",
            "-1",
            "--training.seed",
            "-5",
            "--optimizer.lr",
            "2e-4",
            "--training.steps=1_000",
            "--job.description=--not-a-flag",
            "--data.mock_config",
            '{"mode": "file", "path": "x.csv"}',
        ]
    )
    assert cfg.checkpoint.enable is True and cfg.metrics.enable_tensorboard is False
    assert cfg.parallelism.data_parallel_shard_degree == -1 and cfg.training.seed == -5
    assert cfg.optimizer.lr == 2e-4 and cfg.training.steps == 1000
    assert cfg.job.description == "--not-a-flag"
    assert cfg.data.mock_config == {"mode": "file", "path": "x.csv"}
    assert load_config([]).training.compile == "auto"  # bool | Literal["auto"]: either arm
    assert load_config(["--training.compile", "True"]).training.compile is True
    assert load_config(["--training.compile", "auto"]).training.compile == "auto"
    toml_table = load_config(["--data.mock_config", '{mode = "file", path = "y.csv"}'])
    assert toml_table.data.mock_config == {"mode": "file", "path": "y.csv"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stpes", "3"], r"command line: unknown key 'training.stpes'. Did you mean 'steps'\?"),
        (["--trainig.steps", "3"], r"unknown config section 'trainig'. Did you mean 'training'\?"),
        (["--training", "3"], r"unknown config section 'training'"),
        (["--checkpoint.enable", "yes"], r"checkpoint.enable: got 'yes', expected true or false"),
        (["--training.steps", "1.5"], r"training.steps: got '1.5', expected an integer"),
        (
            ["--training.compile", "yes"],
            r"training.compile: got 'yes', expected true or false, or one of auto",
        ),
        (["--optimizer.lr", "fast"], r"optimizer.lr: got 'fast', expected a number"),
        (["--data.mock_config", "[1, 2]"], r"data.mock_config: got '\[1, 2\]', expected a table"),
        (["--training.steps"], r"--training.steps needs a value"),
        (["--checkpoint.enable", "--training.steps", "3"], r"--checkpoint.enable needs a value"),
        (["training.steps", "3"], r"expected --section.field, got 'training.steps'"),
        (["--job.config_file", "/nonexistent/x.toml"], r"config file not found: /nonexistent/x.toml"),
    ],
)
def test_cli_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        load_config(argv)


@pytest.mark.parametrize(
    "text, message",
    [
        ("[training]\nsteps = 'ten'\n", r"run.toml: training.steps: got 'ten', expected an integer"),
        ("[training]\nsteps = 10.0\n", r"training.steps: got 10.0, expected an integer"),
        ("[training]\nmax_norm = true\n", r"training.max_norm: got True, expected a number"),
        ("[checkpoint]\nenable = 'true'\n", r"checkpoint.enable: got 'true', expected true or false"),
        ("[training]\ncompile = 1\n", r"training.compile: got 1, expected true or false, or one of auto"),
        ("[model]\nname = 3\n", r"model.name: got 3, expected one of llama, dsv4"),
        (
            "[optimiser]\nlr = 1.0\n",
            r"run.toml: unknown config section 'optimiser'. Did you mean 'optimizer'\?",
        ),
        (
            "[data]\ntokeniser = 'byte'\n",
            r"unknown key 'data.tokeniser'. Did you mean 'tokenizer'\?.*Valid keys",
        ),
        ("steps = 3\n", r"top-level key 'steps' must be a \[section\] table"),
        ("[training\n", r"run.toml: invalid TOML"),
    ],
)
def test_toml_errors_name_the_file(tmp_path, text, message):
    path = _toml(tmp_path, text)
    with pytest.raises(ValueError, match=message):
        load_config(["--job.config_file", path])


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"model.name": "gpt"}, r"model.name: got 'gpt', expected one of llama, dsv4"),
        (
            {"training.planner": "greedy"},
            r"training.planner: got 'greedy', expected one of balanced, dp_balanced",
        ),
        ({"training.steps": "0"}, r"training.steps: got 0, expected a positive value"),
        ({"training.global_batch_size": "-2"}, r"training.global_batch_size: got -2"),
        ({"training.tokens_per_microbatch": "0"}, r"training.tokens_per_microbatch: got 0"),
        ({"training.max_norm": "-1"}, r"training.max_norm: got -1.0, expected a non-negative value"),
        ({"training.planner_cost_attention": "-1"}, r"training.planner_cost_attention: got -1.0"),
        ({"optimizer.lr": "0"}, r"optimizer.lr: got 0.0, expected a positive value"),
        ({"optimizer.weight_decay": "-0.1"}, r"optimizer.weight_decay: got -0.1"),
        ({"optimizer.eps": "0"}, r"optimizer.eps: got 0.0"),
        ({"optimizer.beta2": "1.0"}, r"optimizer.beta2: got 1.0, expected 0 <= value < 1"),
        ({"optimizer.muon_momentum": "-0.5"}, r"optimizer.muon_momentum: got -0.5"),
        ({"optimizer.muon_ns_steps": "100"}, r"optimizer.muon_ns_steps: got 100, expected 1..99"),
        ({"lr_scheduler.warmup_steps": "-1"}, r"lr_scheduler.warmup_steps: got -1"),
        ({"lr_scheduler.total_steps": "-1"}, r"lr_scheduler.total_steps: got -1"),
        ({"lr_scheduler.min_lr_factor": "1.5"}, r"lr_scheduler.min_lr_factor: got 1.5, expected 0..1"),
        ({"data.pad_to_multiple": "-2"}, r"data.pad_to_multiple: got -2, expected a non-negative value"),
        ({"data.num_workers": "-1"}, r"data.num_workers: got -1"),
        ({"data.num_samples": "-1"}, r"data.num_samples: got -1"),
        ({"data.source": "jsonl"}, r"data.source = jsonl needs data.path"),
        ({"checkpoint.interval": "0"}, r"checkpoint.interval: got 0"),
        ({"checkpoint.keep_latest_k": "-1"}, r"checkpoint.keep_latest_k: got -1"),
        (
            {"checkpoint.keep_latest_k": "1"},
            r"checkpoint.keep_latest_k: got 1, expected 0 \(keep all\) or >= 2",
        ),
        ({"checkpoint.load_step": "-2"}, r"checkpoint.load_step: got -2, expected -1"),
        ({"metrics.log_freq": "0"}, r"metrics.log_freq: got 0"),
        ({"metrics.peak_tflops": "-1"}, r"metrics.peak_tflops: got -1.0"),
        ({"comm.init_timeout_seconds": "0"}, r"comm.init_timeout_seconds: got 0"),
        ({"parallelism.context_parallel_degree": "0"}, r"parallelism.context_parallel_degree: got 0"),
        ({"parallelism.tensor_parallel_degree": "-1"}, r"parallelism.tensor_parallel_degree: got -1"),
        ({"parallelism.pipeline_parallel_degree": "0"}, r"parallelism.pipeline_parallel_degree: got 0"),
        (
            {"parallelism.data_parallel_shard_degree": "0"},
            r"data_parallel_shard_degree: got 0, expected -1 or >= 1",
        ),
        ({"parallelism.data_parallel_shard_degree": "-3"}, r"data_parallel_shard_degree: got -3"),
        (
            {"parallelism.context_parallel_mode": "ring"},
            r"context_parallel_mode: got 'ring', expected one of auto, zigzag, contiguous",
        ),
    ],
)
def test_validation_errors(overrides, message):
    argv = [x for k, v in overrides.items() for x in (f"--{k}", v)]
    with pytest.raises(ValueError, match=message):
        load_config(argv)


def test_every_choice_field_is_validated():
    for key in CHOICES:
        with pytest.raises(ValueError, match=f"{key}: got 'nope', expected one of"):
            load_config([f"--{key}", "nope"])


def test_help_lists_every_field_with_its_doc():
    text = help_text()
    docs = field_docs()
    for section in dataclasses.fields(Config):
        for f in dataclasses.fields(section.default_factory()):
            key = f"{section.name}.{f.name}"
            assert docs[key], f"{key} has no docstring"
            assert f"--{key}" in text
            assert docs[key] in text
    assert "{auto|zigzag|contiguous|hybrid}" in text


def test_print_config_round_trip(tmp_path):
    cfg = load_config(
        [
            "--training.steps",
            "11",
            "--parallelism.data_parallel_shard_degree",
            "-1",
            "--optimizer.eps",
            "1e-10",
            "--job.description",
            'quote " and \\ backslash',
            "--checkpoint.enable",
            "true",
            "--data.mock_config",
            (
                '{"mode": "distribution", "type": "lognormal", "min_seq_len": 4, '
                '"max_seq_len": 64, "mean_seq_len": 16, "lognormal_sigma": 0.5}'
            ),
        ]
    )
    path = _toml(tmp_path, to_toml(cfg), "printed.toml")
    again = load_config(["--job.config_file", path])
    again.job.config_file = cfg.job.config_file
    assert again == cfg
