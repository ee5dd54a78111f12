"""Context-parallel user errors: every rule lives in titan_thd/parallel/context_parallel.py and is
checked before any process group exists, with the numbers. (A document not a multiple of 2*cp:
tests/ops/test_cp_attention.py and tests/data/test_cp_partition.py.)"""

import pytest
import torch

from titan_thd.config import CHOICES, Parallelism
from titan_thd.models import get_model_spec
from titan_thd.parallel.context_parallel import CP_MODES, resolve_mode, validate_context_parallel
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer


def test_modes_are_one_type():
    assert CP_MODES == ("zigzag", "contiguous", "hybrid")
    assert CHOICES["parallelism.context_parallel_mode"] == ("auto", "zigzag", "contiguous", "hybrid")
    assert Parallelism().context_parallel_mode == "auto"


@pytest.mark.parametrize("model, mode", [("llama", "zigzag"), ("dsv4", "contiguous")])
def test_auto_follows_the_model_and_another_mode_is_refused(model, mode):
    declared = get_model_spec(model).parallel.cp_mode
    assert declared == mode
    assert resolve_mode("auto", model, declared) == mode
    assert resolve_mode(mode, model, declared) == mode
    other = next(m for m in CP_MODES if m != mode)
    with pytest.raises(
        ValueError, match=rf"context_parallel_mode = {other}: model {model} computes only {mode}"
    ):
        resolve_mode(other, model, declared)


def _validate(**overrides):
    kwargs = {
        "degree": 2,
        "configured_mode": "auto",
        "model": "llama debug",
        "model_mode": "zigzag",
        "tokens_per_microbatch": 512,
        "pad_to_multiple": 4,
        "min_tokens_per_rank": 1,
    }
    return validate_context_parallel(**(kwargs | overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            {"degree": 3, "model_mode": "contiguous", "tokens_per_microbatch": 100, "pad_to_multiple": 1},
            r"tokens_per_microbatch = 100 is not divisible by 3 \(contiguous CP with degree 3\); .* above it is 102",
        ),
        (
            {"tokens_per_microbatch": 102, "pad_to_multiple": 2},
            r"not divisible by 4 \(zigzag CP with degree 2\); the smallest valid value above it is 104",
        ),
        (
            {"pad_to_multiple": 2},
            r"zigzag CP with degree 2 cuts every document into 4 chunks: data.pad_to_multiple = 2",
        ),
        (
            {
                "model": "dsv4 tiny",
                "model_mode": "contiguous",
                "tokens_per_microbatch": 32,
                "min_tokens_per_rank": 32,
            },
            (
                r"tokens_per_microbatch = 32 / context_parallel_degree = 2 leaves 16 tokens per CP rank; "
                r"model dsv4 tiny needs at least 32"
            ),
        ),
    ],
)
def test_layout_errors(overrides, message):
    with pytest.raises(ValueError, match=message):
        _validate(**overrides)


def test_valid_layouts_and_no_cp():
    assert _validate() == "zigzag"
    assert _validate(model_mode="contiguous", pad_to_multiple=1, tokens_per_microbatch=510) == "contiguous"
    # Without CP only the mode is checked.
    assert (
        _validate(degree=1, tokens_per_microbatch=7, pad_to_multiple=7, min_tokens_per_rank=10**6) == "zigzag"
    )
    with pytest.raises(ValueError, match="computes only zigzag"):
        _validate(degree=1, configured_mode="contiguous")


def test_trainer_refuses_dsv4_zigzag(make_config, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = make_config(
        *("--model.name", "dsv4", "--model.flavor", "tiny", "--parallelism.context_parallel_degree", "2"),
        *("--parallelism.context_parallel_mode", "zigzag", "--data.pad_to_multiple", "4"),
    )
    with pytest.raises(
        ValueError, match=r"context_parallel_mode = zigzag: model dsv4 tiny computes only contiguous"
    ):
        Trainer(resolve_run(cfg))
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("world, cp", [("4", "3"), ("3", "2")])
def test_cp_degree_must_divide_the_world(make_config, monkeypatch, world, cp):
    monkeypatch.setenv("WORLD_SIZE", world)
    overrides = ["--parallelism.context_parallel_degree", cp, "--data.pad_to_multiple", str(2 * int(cp))]
    cfg = make_config(*overrides, "--training.tokens_per_microbatch", "504")  # 504 = 2^3 * 3^2 * 7
    with pytest.raises(ValueError, match=rf"pp 1 × cp {cp} × tp 1 = {cp} does not divide world size {world}"):
        Trainer(resolve_run(cfg))
    assert not torch.distributed.is_initialized()
