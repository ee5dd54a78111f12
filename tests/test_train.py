"""Trainer: loss normalisation against an independent float64 reference, initialisation from a
Hugging Face checkpoint, and early user errors."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TRAIN_ARGS
from tests.models.dsv4._util import assert_loaded_and_first_ce
from titan_thd.config import load_config
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packed_batch import IGNORE_INDEX
from titan_thd.data.plan import attention_cost_weight
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer


def _cfg(tmp_path, *extra):
    return load_config([*TRAIN_ARGS, "--training.steps", "2", "--job.dump_folder", str(tmp_path), *extra])


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    # One thread: on a shared 2-core machine two threads per process are often far slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t = Trainer(resolve_run(_cfg(tmp_path_factory.mktemp("run"))))
    yield t
    t.close()
    torch.set_num_threads(threads)


@pytest.mark.slow
def test_loss_is_global_token_mean_over_microbatches(trainer):
    """Sum over microbatches of CE_sum / N (N from the step batch) == the plain token mean (float64)."""
    model = trainer.model.double()
    step_batch = next(trainer.dataloader)
    assert step_batch.num_microbatches >= 2  # otherwise the test would not test accumulation
    trained = sum(int(((mb.labels != IGNORE_INDEX) & mb.loss_mask).sum()) for mb in step_batch.microbatches)
    assert step_batch.trained_tokens == trained < step_batch.real_tokens  # chat: prompts are not trained

    model.zero_grad()
    N = step_batch.trained_tokens
    ce_sums = [trainer.runner.step([trainer.local_inputs(mb)], N)[0] for mb in step_batch.microbatches]
    loss = float(sum(ce_sums)) / step_batch.trained_tokens
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}

    # Reference: one graph over every trained token of the step, plain mean.
    model.zero_grad()
    per_token = []
    for mb in step_batch.microbatches:
        logits = model(mb.tokens, BatchMeta.from_batch(mb)).logits
        keep = (mb.labels != IGNORE_INDEX) & mb.loss_mask
        per_token.append(F.cross_entropy(logits[keep], mb.labels[keep], reduction="none"))
    ref = torch.cat(per_token).mean()
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-9, atol=1e-12, msg=n)
    model.float()


def test_the_run_folder_holds_the_tokenizer_it_trains_with(trainer):
    from titan_thd.data.tokenizer import HFTokenizer

    saved = HFTokenizer(Path(trainer.run.cfg.job.dump_folder) / "tokenizer" / "tokenizer.json")
    text = "What is 12 + 30?"
    assert saved.encode(text) == trainer.run.tokenizer.encode(text)
    assert saved.special_ids == trainer.run.tokenizer.special_ids


def test_vocab_rounded_and_train_step_runs(trainer):
    assert trainer.run.model_args.vocab_size % 64 == 0
    assert trainer.run.model_args.vocab_size >= trainer.run.tokenizer.vocab_size
    out = trainer.train_step(next(trainer.dataloader))
    assert set(out) >= {"loss", "grad_norm", "lr"}
    assert 0 < out["loss"] < 10 and out["grad_norm"] > 0


def test_a_run_beyond_the_hosts_memory_is_refused_with_the_numbers(trainer, monkeypatch):
    """CPU ranks share the host: 4 ranks of the memory plan's figure against 1 byte less than that is
    refused before the first step (the message names both sums and the way out); exactly enough passes."""
    import titan_thd.train as train_module
    from titan_thd.memory.state import size

    per_rank = trainer.memory.per_rank_total
    assert per_rank > sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(train_module, "available_host_bytes", lambda: 4 * per_rank - 1)
    with pytest.raises(ValueError) as refused:
        trainer._refuse_beyond_host_memory()
    message = str(refused.value)
    for part in (f"4 rank(s) on this host x {size(per_rank)} estimated", f") = {size(4 * per_rank)}, more",
                 "activation_checkpoint.mode = none", "--activation_checkpoint.mode full"):  # fmt: skip
        assert part in message, (part, message)
    monkeypatch.setattr(train_module, "available_host_bytes", lambda: 4 * per_rank)
    trainer._refuse_beyond_host_memory()


def test_attention_cost_weight_reads_the_flops_formula(trainer):
    """flops(L) = a (L + b L^2) for one document: b is the planner's weight of sum(len^2)."""
    spec, args = trainer.run.spec, trainer.run.model_args
    b = attention_cost_weight(spec.flops_per_step, args)
    f1 = spec.flops_per_step(args, [1])
    for L in (100, 3000):
        assert spec.flops_per_step(args, [L]) == pytest.approx(f1 * (L + b * L * L) / (1 + b), rel=1e-9)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (
            "4",
            ["--parallelism.tensor_parallel_degree", "4"],
            r"tensor_parallel_degree = 4 does not divide model llama debug n_kv_heads = 2; the nearest "
            r"valid degrees are 2 \(valid: 1, 2\)",
        ),
        (
            "4",
            ["--parallelism.data_parallel_replicate_degree", "3"],
            r"pp 1 × dp_replicate 3 × cp 1 × tp 1 = 3 does not divide world size 4",
        ),
        (
            "4",
            [
                "--parallelism.pipeline_parallel_degree",
                "4",
                "--parallelism.pipeline_parallel_stage_layers",
                "0|1|1|2-5",
            ],
            r"pipeline_parallel_stage_layers = '0\|1\|1\|2-5' repeats layer\(s\) \[1\]",
        ),
        (
            "2",
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_layers_per_stage",
                "3",
            ],
            r"layers_per_stage = 3 x 2 stages = 6, but the model has \d+ layers",
        ),
        (
            "1",
            ["--parallelism.data_parallel_shard_degree", "2"],
            r"multiply to 2 .* the world has 1 processes",
        ),
        (
            "2",
            ["--parallelism.data_parallel_shard_degree", "1"],
            r"multiply to 1 .* the world has 2 processes",
        ),
        (
            "2",
            [
                "--parallelism.context_parallel_degree",
                "2",
                "--parallelism.context_parallel_mode",
                "contiguous",
            ],
            r"context_parallel_mode = contiguous: model llama \S+ computes only zigzag exactly",
        ),
        (
            "2",
            [
                "--model.name",
                "dsv4",
                "--model.flavor",
                "tiny",
                "--parallelism.context_parallel_degree",
                "2",
                "--training.tokens_per_microbatch",
                "32",
            ],
            (
                r"tokens_per_microbatch = 32 / context_parallel_degree = 2 leaves 16 tokens per CP rank; "
                r"model dsv4 tiny needs at least"
            ),
        ),
        ("1", ["--data.tokenizer", "/no/tokenizer.json"], r"/no/tokenizer.json"),
        (
            "1",
            ["--model.hf_path", "/ckpt"],
            r"model.hf_path = '/ckpt': model llama cannot be initialised from a Hugging Face checkpoint",
        ),
        (
            "1",
            ["--model.name", "dsv4", "--model.flavor", "micro", "--model.hf_path", "/ckpt"],
            r"model.hf_path = '/ckpt': the folder does not exist",
        ),
        (
            "1",
            ["--model.flavor", "huge"],
            r"model.flavor: got 'huge' for llama, expected one of debug, bench",
        ),
    ],
)
def test_user_errors_before_any_process_group(tmp_path, monkeypatch, world, overrides, message):
    monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(ValueError, match=message):
        Trainer(resolve_run(_cfg(tmp_path, *overrides)))
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A dsv4 `micro` model (vocab 320 covers the byte tokenizer) exported in the HF format; seed 7,
    not the trainer's seed, so that only loading can give the trainer these weights."""
    args = dataclasses.replace(flavors["micro"], vocab_size=320)
    torch.manual_seed(7)
    model = build_dsv4(args)
    return model, export_hf(model, args, tmp_path_factory.mktemp("hf") / "micro")


def _dsv4_cfg(tmp_path, hf_path, flavor="micro"):
    return _cfg(
        tmp_path,
        *("--model.name", "dsv4", "--model.flavor", flavor, "--model.hf_path", str(hf_path)),
        *("--training.steps", "1", "--metrics.peak_tflops", "1"),
    )


def test_hf_checkpoint_initialises_the_trainer_model(tmp_path, hf_checkpoint):
    reference, path = hf_checkpoint
    trainer = Trainer(resolve_run(_dsv4_cfg(tmp_path, path)))
    try:
        # The first logged loss is the exported model's loss on the first step's batch.
        ce = assert_loaded_and_first_ce(trainer, reference)
        step_batch = trainer.dataloader.steps[0]
        trainer.train()
    finally:
        trainer.close()
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] == pytest.approx(float(ce) / step_batch.trained_tokens, rel=1e-6)

    torch.manual_seed(42)  # the trainer's seed: without loading its weights would differ
    fresh = build_dsv4(reference.args)
    assert not torch.equal(fresh.state_dict()["embed.weight"], reference.state_dict()["embed.weight"])


def test_the_trainer_never_draws_what_the_hf_folder_provides(tmp_path, hf_checkpoint, monkeypatch):
    """The seeded init skips every tensor the folder holds (they are read next), draws the rest (dsv4's
    MTP, which transformers' export lacks, non-persistent buffers), and the weights are the folder's."""
    from titan_thd.models import get_model_spec, hf
    from titan_thd.parallel import seeded_init

    reference, path = hf_checkpoint
    drawn: list[str] = []
    draw = seeded_init.init_tensor
    monkeypatch.setattr(
        seeded_init, "init_tensor", lambda t, seed, fqn, rule: (drawn.append(fqn), draw(t, seed, fqn, rule))
    )
    trainer = Trainer(resolve_run(_dsv4_cfg(tmp_path, path)))
    try:
        assert_loaded_and_first_ce(trainer, reference)
    finally:
        trainer.close()
    provided = set(hf.HFFolder(get_model_spec("dsv4"), path).sources(reference.args))
    assert provided and drawn and not provided & set(drawn)
    assert set(drawn) | provided >= set(reference.state_dict())


def test_hf_checkpoint_of_another_architecture_or_vocab_is_refused(tmp_path, hf_checkpoint):
    _, path = hf_checkpoint
    with pytest.raises(
        ValueError,
        match=r"config.json does not match model.flavor = 'tiny': .*dim: checkpoint 128 vs",
    ):
        Trainer(resolve_run(_dsv4_cfg(tmp_path, path, flavor="tiny")))
    small = tmp_path / "small_vocab"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"vocab_size": 100}))
    with pytest.raises(ValueError, match=r"vocab_size = 100, fewer rows than the tokenizer's 264 ids"):
        Trainer(resolve_run(_dsv4_cfg(tmp_path, small)))


@pytest.mark.parametrize("model", ["llama", "dsv4"])
def test_trimmed_microbatches_train_exactly_like_full_ones(tmp_path, tiny_llama, model):
    """data.trim_padding computes no tail-padding rows and changes nothing else: the same losses,
    gradient norms as full T-row microbatches over 2 steps (float64, rel 1e-12), and weights equal to
    float64 rounding (abs 1e-13)."""
    flavor = ("--model.flavor", tiny_llama) if model == "llama" else ("--model.flavor", "micro")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs = {}
    try:
        for trim in ("true", "false"):
            cfg = _cfg(
                tmp_path / trim,
                *("--model.name", model, *flavor, "--training.dtype", "float64"),
                *("--data.trim_padding", trim, "--metrics.peak_tflops", "1"),
            )
            t = Trainer(resolve_run(cfg))
            try:
                batches = [next(t.dataloader) for _ in range(2)]
                results = [t.train_step(b) for b in batches]
                runs[trim] = (batches, results, {k: v.clone() for k, v in t.model.state_dict().items()})
            finally:
                t.close()
    finally:
        torch.set_num_threads(threads)
    (trim_b, trim_r, trim_w), (full_b, full_r, full_w) = runs["true"], runs["false"]
    T = 512
    assert all(mb.total_tokens == T for b in full_b for mb in b.microbatches)
    assert sum(mb.total_tokens for b in trim_b for mb in b.microbatches) < 0.9 * sum(
        b.slot_tokens for b in full_b
    )
    for a, b in zip(trim_r, full_r, strict=True):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == pytest.approx(b[k], rel=1e-12), k
    for k in full_w:  # the weight-gradient sums run over other row counts: rounding (~1e-15) apart
        torch.testing.assert_close(
            trim_w[k], full_w[k], rtol=1e-10, atol=1e-13, msg=lambda m, k=k: f"{k}: {m}"
        )
