"""Long documents through the Trainer: the chunked loss equals the full logits' loss, and offloaded
block inputs give the same step bitwise.

`loss.chunked` against today's loss (F.cross_entropy on the [T, V] logits), float64, the recipes of
tests/test_train_compose.py (the 4-layer tiny llama with clipping, the dsv4 micro flavor with MTP,
CSA / HCA, a hash-routed layer; 2 steps) and their LoRA runs (tests/lora/test_lora_layouts.py's
targets): the references are one-process runs on the full logits. Every chunked run, on one process
and on FSDP 2, CP 2, TP 2 (the vocabulary-parallel head), PP 2 (the last stage's loss and MTP) and
EP 2, full fine-tuning and LoRA, must give per step the losses, the MTP and indexer terms and the
gradient norms rel <= 1e-12, and trained weights (gathered to full tensors) within 1e-12 of the
reference model's largest weight (max |a - b| over every tensor / max |b| over the model: a tensor
that starts at zero, dsv4's mHC bases, is all AdamW update after 2 steps, and AdamW divides each
gradient entry by its own magnitude, so a near-zero entry's 1e-16 is amplified; measured worst
3.6e-14 absolute against weights up to ~0.05). The chunk, 37 rows, ends inside
documents and leaves a last chunk of another size. The layouts only reorder sums (their own bound,
tests/test_train_compose.py), and so does the chunking: ~1e-16 per operation in float64.

`activation_checkpoint.offload` against the same run with full recomputation kept on the device:
every metric and every trained weight bitwise equal (a copy to host memory and back is exact), on
one process (dsv4 with MTP, llama LoRA) and on TP 2 (llama: DTensor block inputs), CP 2, FSDP 2,
PP 2 (dsv4: every stage, the MTP block on the last) and EP 2, full fine-tuning and LoRA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor

from tests import _tiny_llama
from tests.test_train_compose import CP2, EP2, PP2, TP2, _env, _spawn, config
from tests.test_train_layouts import records
from titan_thd.parallel.offload import observe_offload
from titan_thd.parallel.shards import canonical_name
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
STEPS = 2
KEYS = ("loss", "grad_norm", "aux/mtp", "aux/indexer")
CHUNK = ["--loss.chunked", "true", "--loss.chunk_tokens", "37"]
LORA = {
    "llama": ["--lora.enable", "true", "--lora.targets", "attention,mlp"],
    "dsv4": ["--lora.enable", "true", "--optimizer.name", "adamw", "--lora.targets", "attention,experts"],
}
LORA_COMMON = ["--lora.rank", "4", "--lora.alpha", "8"]
DP2 = ["--parallelism.data_parallel_shard_degree", "2"]
FULL = ["--activation_checkpoint.mode", "full"]
OFFLOAD = [*FULL, "--activation_checkpoint.offload", "true"]

# name -> (model, lora, extra args) of the 2-process chunked runs, each compared with the
# one-process reference of its (model, lora)
LAYOUTS = {
    "llama-fsdp2": ("llama", False, DP2),
    "llama-cp2": ("llama", False, CP2),
    "llama-pp2-lora": ("llama", True, PP2),
    "dsv4-tp2": ("dsv4", False, TP2),
    "dsv4-pp2": ("dsv4", False, PP2),
    "dsv4-ep2": ("dsv4", False, EP2),
    "dsv4-cp2-lora": ("dsv4", True, CP2),
    "dsv4-tp2-lora": ("dsv4", True, TP2),
}

# name -> (model, lora, layout args) of the runs made twice, with full recomputation on the device and
# offloaded (`<name>-offload`); 1: one process, 2: the 2-process spawn
OFFLOAD_LAYOUTS = {
    1: {"dsv4-one": ("dsv4", False, []), "llama-one-lora": ("llama", True, [])},
    2: {
        "llama-tp2": ("llama", False, TP2),
        "llama-cp2-lora": ("llama", True, CP2),
        "llama-fsdp2-lora": ("llama", True, DP2),
        "dsv4-pp2": ("dsv4", False, PP2),
        "dsv4-ep2-lora": ("dsv4", True, EP2),
    },
}


def _offload_pairs(world: int) -> dict:
    """The runs of OFFLOAD_LAYOUTS[world], each without and with offload (names `ac-...`)."""
    runs = {}
    for name, (model, lora, extra) in OFFLOAD_LAYOUTS[world].items():
        runs[f"ac-{name}"] = (model, lora, [*extra, *FULL])
        runs[f"ac-{name}-offload"] = (model, lora, [*extra, *OFFLOAD])
    return runs


def _bitwise(base: Path, name: str, got: dict, want: dict) -> None:
    """`name`-offload equals `name`: metrics.jsonl's values and the trained weights, bitwise."""
    keep = ("loss", "grad_norm", "aux/mtp", "aux/indexer", "tokens_trained")
    a = [{k: r[k] for k in keep if k in r} for r in records(base / name)]
    b = [{k: r[k] for k in keep if k in r} for r in records(base / f"{name}-offload")]
    assert len(a) == STEPS and a == b, (name, a, b)
    assert got.keys() == want.keys() and got, name
    for fqn, w in want.items():
        assert torch.equal(got[fqn], w), (name, fqn)


def train(dump: Path, model: str, lora: bool, *extra: str) -> dict[str, torch.Tensor]:
    """One run; its trained parameters as full tensors (every rank of a mesh takes part in the
    all-gather, in the same order)."""
    own = [*LORA[model], *LORA_COMMON] if lora else []
    trainer = Trainer(resolve_run(config(dump, model, STEPS, *own, "--checkpoint.enable", "false", *extra)))
    offloaded: list[torch.Tensor] = []
    try:
        with observe_offload(offloaded.append):
            trainer.train()
    finally:
        trainer.close()
    # offload moved every wrapped block's inputs of every step; without it nothing moved
    assert bool(offloaded) == trainer.run.cfg.activation_checkpoint.offload, dump.name
    out = {}
    for name, p in trainer.model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical_name(name)] = full.detach().clone()
    return out


def _runs(rank: int, world: int, base: Path, runs: dict) -> dict[str, dict]:
    _env(rank, world)
    return {name: train(base / name, model, lora, *extra) for name, (model, lora, extra) in runs.items()}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process references on the full logits, and the same runs chunked."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    base = tmp_path_factory.mktemp("long")
    weights = {}
    try:
        for model in ("llama", "dsv4"):
            for lora in (False, True):
                ref = _ref(model, lora)
                weights[ref] = train(base / ref, model, lora)
                weights[f"{ref}-chunked"] = train(base / f"{ref}-chunked", model, lora, *CHUNK)
    finally:
        torch.set_num_threads(threads)
    return base, weights


def _ref(model: str, lora: bool) -> str:
    return f"{model}-one" + ("-lora" if lora else "")


def _compare(base: Path, name: str, ref: str, got: dict, want: dict, model: str) -> None:
    a_records, b_records = records(base / ref), records(base / name)
    assert [r["step"] for r in a_records] == [r["step"] for r in b_records] == list(range(1, STEPS + 1))
    for a, b in zip(a_records, b_records, strict=True):
        assert b["tokens_trained"] == a["tokens_trained"]
        for key in (k for k in KEYS if k in a):
            assert b[key] == pytest.approx(a[key], rel=1e-12, abs=0), (name, a["step"], key)
    if model == "dsv4":
        assert a_records[0]["aux/mtp"] > 0
    assert got.keys() == want.keys() and got, name
    scale = max(w.abs().max().item() for w in want.values())
    for fqn, w in want.items():
        diff = (got[fqn] - w).abs().max().item()
        assert diff <= 1e-12 * scale, (name, fqn, diff, scale)


@pytest.mark.slow
def test_chunked_loss_equals_full_logits_on_one_process(one):
    base, weights = one
    for model in ("llama", "dsv4"):
        for lora in (False, True):
            ref = _ref(model, lora)
            _compare(base, f"{ref}-chunked", ref, weights[f"{ref}-chunked"], weights[ref], model)


def _merge(ranks: list[dict], name: str) -> dict[str, torch.Tensor]:
    """One run's weights over its ranks (pipeline stages hold different layers; a stage's ranks the
    same full tensors)."""
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:
        for fqn, t in r[name].items():
            assert fqn not in merged or torch.equal(merged[fqn], t), (name, fqn)
            merged[fqn] = t
    return merged


@pytest.mark.slow
def test_chunked_loss_and_offload_on_every_layout(one):
    """One 2-process launch: the chunked runs against the one-process references, and the offload
    pairs against each other."""
    base, weights = one
    runs = LAYOUTS | _offload_pairs(2)
    ranks = _spawn(_runs, 2, base, runs)
    for name, (model, lora, _) in LAYOUTS.items():
        ref = _ref(model, lora)
        _compare(base, name, ref, _merge(ranks, name), weights[ref], model)
    for name in OFFLOAD_LAYOUTS[2]:
        _bitwise(base, f"ac-{name}", _merge(ranks, f"ac-{name}-offload"), _merge(ranks, f"ac-{name}"))


@pytest.mark.slow
def test_offload_is_bitwise_on_one_process(tmp_path):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    try:
        got = {n: train(tmp_path / n, m, lora, *extra) for n, (m, lora, extra) in _offload_pairs(1).items()}
    finally:
        torch.set_num_threads(threads)
    for name in OFFLOAD_LAYOUTS[1]:
        _bitwise(tmp_path, f"ac-{name}", got[f"ac-{name}-offload"], got[f"ac-{name}"])


@pytest.mark.parametrize("chunk", ["0", "-3", "513"])
def test_a_chunk_outside_the_microbatch_is_one_line(tmp_path, chunk):
    """loss.chunk_tokens <= 0 or beyond training.tokens_per_microbatch (512): refused at load time,
    before any process group, naming the field, the value and the fix."""
    with pytest.raises(
        ValueError, match=rf"^loss.chunk_tokens: got {chunk}, expected 1..512 .*chunked = false"
    ):
        config(tmp_path, "llama", 1, "--loss.chunked", "true", "--loss.chunk_tokens", chunk)


def test_offload_without_full_recomputation_is_one_line(tmp_path):
    for mode in ("none", "selective"):
        extra = ["--activation_checkpoint.regions", "mlp"] if mode == "selective" else []
        with pytest.raises(ValueError, match=rf"^activation_checkpoint.offload = true with mode = '{mode}'"):
            config(tmp_path, "llama", 1, "--activation_checkpoint.mode", mode, *extra, *OFFLOAD[2:])


def _plan(*extra: str):
    from titan_thd.config import load_config
    from titan_thd.memory.plan import plan_memory

    micro = ["--model.name", "dsv4", "--model.flavor", "micro", "--training.tokens_per_microbatch", "512"]
    return plan_memory(resolve_run(load_config([*micro, *extra]), 1))


def test_the_plan_counts_the_chunk_and_the_offloaded_inputs():
    """The memory plan measures the run as it computes: chunked, no [T, V] float32 log-softmax is
    saved (the "after" bytes shrink by at least that); offloaded, the blocks' inputs leave the device
    figures for a host line per rank and per node, and a node that cannot hold them is refused with
    the numbers (memory.host_gib)."""
    from titan_thd.memory.host import offload_refusal

    full, chunked = _plan(*FULL), _plan(*FULL, *CHUNK)
    V = full.acts.loss_grad / (2 * 512 * 4)  # [T, V] float32 twice
    assert full.acts.kept.after - chunked.acts.kept.after >= 512 * V * 4
    assert chunked.acts.loss_grad == 37 * V * 4  # one chunk of 37 rows, float32 compute
    assert full.offload_line() == "" and full.ranks[0].offloaded_bytes == 0

    off = _plan(*OFFLOAD, "--memory.host_gib", "1", "--memory.ranks_per_node", "4")
    on, r = off.ranks[0], full.ranks[0]
    assert on.offloaded_bytes > 0 and on.saved_bytes < r.saved_bytes
    # what left the device is in host memory (more: an input another op saves too stays as well)
    assert r.saved_bytes - on.saved_bytes <= on.offloaded_bytes
    line = off.offload_line()
    assert (
        "per rank <= 1 x" in line and "per node of 4 ranks" in line and "1.00 GiB (memory.host_gib)" in line
    )
    assert offload_refusal(off) == ""
    tiny = _plan(*OFFLOAD, "--memory.host_gib", "0.0001", "--memory.ranks_per_node", "4")
    assert offload_refusal(tiny).startswith("memory: activation_checkpoint.offload keeps ")
    assert "more than its 0.1 MiB (memory.host_gib)" in offload_refusal(tiny)
