"""LoRA on every layout equals LoRA on one process, through the Trainer, float64.

References are LoRA runs of the same trainer on one process (tests/test_train_compose.py's recipes:
the 4-layer tiny llama with clipping on, the dsv4 micro flavor with MTP, CSA / HCA, a hash-routed
layer and 4 routed experts; AdamW; every target group, dsv4's `attention.wo_a` too). Each layout must
give, per step:
- losses, gradient norms, dsv4's MTP and indexer terms rel <= 1e-12 (the bound of the layout tests:
  the layouts only reorder sums, ~1e-16 each in float64; clipping with a frozen base must count the
  adapters' gradients only, every stage, every shard, each once);
- the adapters after seeded init bitwise those of one process (drawn per global tensor: step 1's
  loss is then the base model's on every layout), and the trained adapters, gathered to full tensors
  in the ranks, within 1e-10 of the one-process adapters (max |a - b| / max |b| per tensor): a wrong
  shard of a frozen-base run's adapter is caught here even where the loss would hide it;
- each adapter placed by its base's rule (docs/lora.md §2): a base split on its output rows over tp
  (`tp`, `expert_tp`) splits B there and leaves A whole, a split of the input columns splits A and
  leaves B whole, a base whole over tp leaves both whole; the experts' adapters are split over ep
  with their experts.

Layouts: FSDP 2, CP 2 (llama zigzag and hybrid, dsv4 contiguous), TP 2, PP 2 with GPipe, 1F1B and
Interleaved1F1B (2 stages per rank), HSDP 2 x 2, and the compositions PP2 x TP2, TP2 x EP2 and
HSDP 2 x 2 x EP2, both families where the family has the dimension. dsv4 on 4 ranks with EP 1, 2 and 4
(4 data-parallel ranks each): the results must not depend on the expert-parallel degree (one adapter
per expert, never one per rank: Megatron-Bridge#5484), compared with each other as well as with one
process.

Default suite: one 2-process and one 4-process spawn, 2 steps each (`DEFAULT`); `extended`: the rest,
3 steps (`EXTENDED`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

from tests import _tiny_llama
from tests.test_train_compose import CP2, EP2, HSDP, PP2, SCHEDULE, TP2, _compare, _env, _spawn, config
from titan_thd.lora.targets import adapter_names, is_adapter
from titan_thd.models.packed_weight import packed_weights
from titan_thd.parallel.shards import canonical_name
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
STEPS, SHORT = 3, 2
LORA = {
    "llama": ["--lora.targets", "attention,mlp"],
    "dsv4": ["--optimizer.name", "adamw", "--lora.targets", "attention,attention.wo_a,shared_expert,experts"],
}
COMMON = ["--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8", "--checkpoint.enable", "false"]
EP = "--parallelism.expert_parallel_degree"
HYBRID = ["--parallelism.context_parallel_mode", "hybrid"]
GPIPE, INTERLEAVED = [SCHEDULE, "GPipe"], [SCHEDULE, "Interleaved1F1B"]

# name -> (model, world, parallelism args, steps); a world of 2 with one dimension of 2 is that
# dimension alone (no FSDP); on 4 ranks the rest is data-parallel.
DEFAULT = {
    2: {
        "llama-cp2-zigzag": ("llama", 2, CP2, SHORT),
        "llama-cp2-hybrid": ("llama", 2, [*CP2, *HYBRID], SHORT),
        "llama-pp2-interleaved": ("llama", 2, [*PP2, *INTERLEAVED], SHORT),
        "dsv4-tp2": ("dsv4", 2, TP2, SHORT),
        "dsv4-pp2-1f1b": ("dsv4", 2, PP2, SHORT),
    },
    4: {
        "llama-pp2-tp2": ("llama", 4, [*PP2, *TP2], SHORT),
        "dsv4-ep1": ("dsv4", 4, [EP, "1"], SHORT),
        "dsv4-ep2": ("dsv4", 4, [EP, "2"], SHORT),
        "dsv4-ep4": ("dsv4", 4, [EP, "4"], SHORT),
        "dsv4-tp2-ep2": ("dsv4", 4, [*TP2, *EP2], SHORT),
    },
}
EXTENDED = {
    2: {
        "llama-fsdp2": ("llama", 2, [], STEPS),
        "llama-tp2": ("llama", 2, TP2, STEPS),
        "llama-pp2-gpipe": ("llama", 2, [*PP2, *GPIPE], STEPS),
        "llama-pp2-1f1b": ("llama", 2, PP2, STEPS),
        "dsv4-fsdp2": ("dsv4", 2, [], STEPS),
        "dsv4-cp2": ("dsv4", 2, CP2, STEPS),
        "dsv4-pp2-gpipe": ("dsv4", 2, [*PP2, *GPIPE], STEPS),
        "dsv4-pp2-interleaved": ("dsv4", 2, [*PP2, *INTERLEAVED], STEPS),
    },
    4: {
        "llama-hsdp2x2": ("llama", 4, HSDP, STEPS),
        "llama-tp2-cp2": ("llama", 4, [*TP2, *CP2], STEPS),
        "dsv4-pp2-tp2": ("dsv4", 4, [*PP2, *TP2, *GPIPE], STEPS),
        "dsv4-hsdp2x2-ep2": ("dsv4", 4, [*HSDP, *EP2], STEPS),
        "dsv4-cp2-ep2": ("dsv4", 4, [*CP2, *EP2], STEPS),
    },
}
EP_DEGREES = ("dsv4-ep1", "dsv4-ep2", "dsv4-ep4")


def _placement(p: torch.Tensor) -> dict[str, str]:
    """{mesh dimension: placement} of a DTensor parameter ({} for a plain tensor)."""
    if not isinstance(p, DTensor):
        return {}
    return {d: repr(pl) for d, pl in zip(p.device_mesh.mesh_dim_names, p.placements, strict=True)}


def _placements(model: nn.Module) -> list[tuple[str, int, dict, dict, dict]]:
    """(base fqn, its ndim, its placements, A's, B's) of every adapted base parameter of this rank."""
    out = []
    for mname, module in model.named_modules():
        for base, (a_name, b_name) in adapter_names(module).items():
            p = getattr(module, base)  # a parameter, or a base kept as released (models/packed_weight.py)
            if not isinstance(p, torch.Tensor):
                continue
            A, B = module.get_parameter(a_name), module.get_parameter(b_name)
            out.append((canonical_name(f"{mname}.{base}"), p.dim(), *map(_placement, (p, A, B))))
    return out


def _adapters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (the adapters) of this rank's stages, as full tensors: every rank of a
    parameter's mesh takes part in its all-gather, in the same (module) order."""
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            full = p.full_tensor() if isinstance(p, DTensor) else p
            out[canonical_name(name)] = full.detach().clone()
    return out


def train(dump: Path, model: str, steps: int, *extra: str) -> dict:
    """One LoRA run: its adapters after the seeded init and after each optimizer step, and their
    placements."""
    t0 = time.perf_counter()
    trainer = Trainer(resolve_run(config(dump, model, steps, *LORA[model], *COMMON, *extra)))
    trained: list[dict[str, torch.Tensor]] = []
    optimizer_step = trainer.optimizers.step

    def recording_step() -> None:
        optimizer_step()
        trained.append(_adapters(trainer.model))

    trainer.optimizers.step = recording_step
    try:
        # The base stays frozen whatever re-registers its parameters (a TP style, FSDP, EP).
        assert all(p.requires_grad == is_adapter(n) for n, p in trainer.model.named_parameters()), dump.name
        init = _adapters(trainer.model)
        trainer.train()
        placements = _placements(trainer.model)
        kept = len(packed_weights(trainer.model))
    finally:
        trainer.close()
    return {
        "init": init,
        "trained": trained,
        "placements": placements,
        "resident": kept,
        "seconds": time.perf_counter() - t0,
    }


def _runs(rank: int, world: int, base: Path, runs: dict) -> dict[str, dict]:
    _env(rank, world)
    return {name: train(base / name, model, steps, *extra) for name, (model, _, extra, steps) in runs.items()}


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    """The one-process LoRA runs (3 steps; a 2-step layout compares with their first 2)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    path = tmp_path_factory.mktemp("lora_layouts")
    try:
        runs = {model: train(path / f"{model}-one", model, STEPS) for model in ("llama", "dsv4")}
    finally:
        torch.set_num_threads(threads)
    return path, runs


def _merge(ranks: list[dict], name: str) -> dict:
    """One layout's adapters over its ranks (pipeline stages hold different layers; the ranks of a
    stage gather the same full tensors)."""
    steps = len(ranks[0][name]["trained"])
    merged: dict = {"init": {}, "trained": [{} for _ in range(steps)]}
    merged["placements"] = [r[name]["placements"] for r in ranks]
    for r in ranks:
        assert len(r[name]["trained"]) == steps, name
        for into, got in zip([merged["init"], *merged["trained"]], [r[name]["init"], *r[name]["trained"]]):
            for fqn, t in got.items():
                if fqn in into:
                    assert torch.equal(into[fqn], t), (name, fqn)
                into[fqn] = t
    return merged


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (0 when both are zero: an expert that no token reached keeps B = 0)."""
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff / scale if scale else diff


def _check_adapters(name: str, got: dict, ref: dict) -> float:
    """Init bitwise, after each step within 1e-10; returns the worst trained difference."""
    assert got["init"].keys() == ref["init"].keys(), name
    for fqn, t in ref["init"].items():
        assert torch.equal(got["init"][fqn], t), (name, "init", fqn)
    worst = (0.0, "")
    assert 0 < len(got["trained"]) <= len(ref["trained"]), name
    for step, (a, b) in enumerate(zip(got["trained"], ref["trained"]), 1):
        assert a.keys() == b.keys(), name
        # B moved off zero (else the bound says nothing about it)
        assert all(b[f].abs().max() > 0 for f in b if ".lora_B" in f), (name, step)
        worst = max(worst, *((_rel(a[f], t), f"step {step} {f}") for f, t in b.items()))
    print(f"{name}: adapters init bitwise, trained worst rel {worst[0]:.1e} ({worst[1]})")
    assert worst[0] <= 1e-10, (name, worst)
    return worst[0]


def _tp_split(placements: dict[str, str]) -> dict[str, str]:
    return {d: pl for d, pl in placements.items() if d.endswith("tp") and pl != repr(Replicate())}


def _check_placements(name: str, ranks_placements: list) -> None:
    """docs/lora.md §2: each adapter follows its base's split over tp and ep."""
    seen_tp = seen_ep = False
    for placements in ranks_placements:
        for fqn, ndim, base, A, B in placements:
            out_dim, in_dim = repr(Shard(ndim - 2)), repr(Shard(ndim - 1))
            a_tp, b_tp = _tp_split(A), _tp_split(B)
            for d, pl in _tp_split(base).items():
                seen_tp = True
                assert pl in (out_dim, in_dim), (name, fqn, base)
                split, whole = (b_tp, a_tp) if pl == out_dim else (a_tp, b_tp)
                assert split.get(d) == pl and d not in whole, (name, fqn, base, A, B)
            if not _tp_split(base):
                assert not a_tp and not b_tp, (name, fqn, base, A, B)
            for d in ("ep", "expert_ep"):  # the experts' mesh without and with tp
                if base.get(d) == repr(Shard(0)):
                    seen_ep = True
                    assert A[d] == B[d] == repr(Shard(0)), (name, fqn, A, B)
    assert seen_tp == ("tp" in name), name
    ep = "-ep" in name and not name.endswith("-ep1")
    assert seen_ep == ep, name


def _check(one_path: Path, refs: dict, runs: dict, ranks: list[dict]) -> dict[str, dict]:
    merged = {}
    for name, (model, *_rest) in runs.items():
        _compare(one_path, name, model)
        merged[name] = _merge(ranks, name)
        _check_adapters(name, merged[name], refs[model])
        _check_placements(name, merged[name]["placements"])
        print(f"{name}: {ranks[0][name]['seconds']:.1f} s")
    return merged


def _spawn_and_check(one, runs: dict[int, dict]) -> dict[str, dict]:
    path, refs = one
    merged = {}
    for world, layouts in runs.items():
        ranks = _spawn(_runs, world, path, layouts)
        merged |= _check(path, refs, layouts, ranks)
    return merged


@pytest.mark.slow
def test_lora_on_layouts_and_every_ep_degree_match_one_process(one):
    merged = _spawn_and_check(one, DEFAULT)
    # The result does not depend on the expert-parallel degree: EP 2 and 4 equal EP 1 on the same
    # 4 data-parallel ranks (and each equals one process, checked above).
    path = one[0]
    for name in EP_DEGREES[1:]:
        _compare(path, name, "dsv4", reference=EP_DEGREES[0])
        _check_adapters(f"{name} vs ep1", merged[name], merged[EP_DEGREES[0]])


@pytest.mark.slow
@pytest.mark.extended
def test_lora_on_more_layouts_matches_one_process(one):
    _spawn_and_check(one, EXTENDED)
