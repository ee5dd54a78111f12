"""A DeepseekV4 checkpoint of any supported architecture trains: with model.hf_path and an empty
model.flavor the architecture is read from its config.json; an explicit flavor must still match.

The checkpoint is a 5-layer d = 96 model (no flavor has these sizes) exported with export_hf; the
trainer must load exactly its weights (seed 7, not the trainer's 42) and train a step on them.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tests.conftest import TRAIN_ARGS
from tests.models.dsv4._util import assert_loaded_and_first_ce
from titan_thd.config import load_config
from titan_thd.models.dsv4 import DSv4Args, build_dsv4, export_hf, flavors
from titan_thd.models.llama.args import flavors as llama_flavors
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

ARGS = DSv4Args(
    vocab_size=320,  # covers the byte tokenizer's 264 ids
    dim=96,
    layer_types=("sliding", "csa", "hca", "csa", "sliding"),
    n_heads=4,
    head_dim=24,
    rope_dim=8,
    q_lora_rank=48,
    o_groups=2,
    o_lora_rank=24,
    window=8,
    csa_ratio=4,
    hca_ratio=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    n_experts=4,
    n_activated_experts=2,
    moe_inter_dim=48,
    n_hash_layers=1,
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    model = build_dsv4(ARGS)
    return model, export_hf(model, ARGS, tmp_path_factory.mktemp("hf") / "d96")


def _cfg(tmp_path, *extra):
    return load_config(
        [
            *TRAIN_ARGS,
            *("--training.steps", "1", "--metrics.peak_tflops", "1", "--job.dump_folder", str(tmp_path)),
            *("--training.global_batch_size", "2", "--training.tokens_per_microbatch", "256"),
            *("--model.name", "dsv4", *extra),
        ]
    )


@pytest.fixture
def one_thread():
    # On the shared 2-core machine two threads per process are often far slower (10x here).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_architecture_comes_from_config_json_and_trains(tmp_path, checkpoint, one_thread):
    reference, path = checkpoint
    assert all(f.architecture() != ARGS.architecture() for f in flavors.values())
    trainer = Trainer(resolve_run(_cfg(tmp_path, "--model.hf_path", str(path))))
    try:
        assert trainer.run.model_args.architecture() == ARGS.architecture()
        ce = assert_loaded_and_first_ce(trainer, reference)
        step_batch = trainer.dataloader.steps[0]
        trainer.train()
        after = trainer.model.state_dict()
        assert not torch.equal(
            after["layers.4.attn.wq_a.weight"], reference.state_dict()["layers.4.attn.wq_a.weight"]
        )
    finally:
        trainer.close()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(float(ce) / step_batch.trained_tokens, rel=1e-6)


def test_an_explicit_flavor_must_match_and_no_flavor_without_checkpoint_is_the_default(tmp_path, checkpoint):
    _, path = checkpoint
    with pytest.raises(
        ValueError, match=r"config.json does not match model.flavor = 'tiny': .*dim: checkpoint 96 vs 256"
    ):
        resolve_run(_cfg(tmp_path, "--model.hf_path", str(path), "--model.flavor", "tiny"), 1)
    args = resolve_run(_cfg(tmp_path), 1).model_args  # no checkpoint: dsv4's default flavor
    assert args == dataclasses.replace(flavors["tiny"], vocab_size=320)
    args = resolve_run(load_config([*TRAIN_ARGS, "--job.dump_folder", str(tmp_path)]), 1).model_args
    assert args == dataclasses.replace(llama_flavors["debug"], vocab_size=320)  # llama's default flavor
