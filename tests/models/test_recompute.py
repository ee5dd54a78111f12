"""Activation recomputation on one process, both models, float64: every mode trains like none.

For `full`, `full` on the first block only, every selective region alone and all regions together:
the loss, every auxiliary term and every parameter gradient of one forward + backward equal those of
the same model without recomputation bitwise (the recomputation runs the same ops on the same
inputs), the router loads after the backward and the biases after their update are identical, and a
router that breaks a forced tie differently on every call still dispatches in the recomputation as
the forward did (the decision is replayed, parallel/recompute.py). The saved-tensor hook of
memory/activations.py shows what each mode keeps (`full`: only the block input and the recorded
decisions), and FlopCounterMode what it recomputes (`full`: one more forward of every block; a
module region: one more forward of that module). The trainer's layouts: tests/test_train_recompute.py.
"""

from __future__ import annotations

import copy
from collections import namedtuple

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tests import _tiny_llama
from tests.models.dsv4._util import build as build_dsv4_random
from tests.models.dsv4._util import meta, micro, packed
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import ActivationCheckpoint
from titan_thd.memory import activations
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4.indexer import Indexer
from titan_thd.parallel.parallel_dims import ParallelDims

LENGTHS = [37, 90, 13, 64]
"""Documents of one packed microbatch (T = 204 plus padding)."""


def _args(name: str):
    return micro() if name == "dsv4" else _tiny_llama.ARGS


def _model(name: str) -> torch.nn.Module:
    if name == "dsv4":
        return build_dsv4_random(micro())  # every parameter and router bias randomised
    torch.manual_seed(0)
    return get_model_spec("llama").build(_tiny_llama.ARGS).double()


def _modes(name: str) -> dict[str, ActivationCheckpoint]:
    regions = tuple(get_model_spec(name).ac_regions)
    return {
        "full": ActivationCheckpoint(mode="full"),
        "full first1": ActivationCheckpoint(mode="full", layers=1),
        **{r: ActivationCheckpoint(mode="selective", regions=(r,)) for r in regions},
        "all": ActivationCheckpoint(mode="selective", regions=regions),
    }


def _cases() -> list[tuple[str, str]]:
    return [(name, mode) for name in ("llama", "dsv4") for mode in _modes(name)]


def _prepared(name: str, base: torch.nn.Module, ac: ActivationCheckpoint) -> torch.nn.Module:
    spec = get_model_spec(name)
    dims = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    model = copy.deepcopy(base)
    return spec.parallelize(model, dims, ac=ac).train()


def _step(model: torch.nn.Module, vocab: int) -> dict:
    """Loss, aux terms and gradients of one forward + backward; router loads; biases after update."""
    tokens, batch = packed(LENGTHS, vocab, pad_to=4, tail=12, seed=3)
    out = model(tokens, meta(batch))
    ce = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask)
    (ce + sum(out.aux_losses.values())).backward()
    loads = {n: b.clone() for n, b in model.named_buffers() if n.endswith(".load")}
    for gate in getattr(model, "router_gates", list)():
        gate.update_bias(None)
    return {
        "ce": ce.detach(),
        "aux": {k: v.detach() for k, v in out.aux_losses.items()},
        "grads": {n: p.grad for n, p in model.named_parameters()},
        "loads": loads,
        "biases": {n: b.clone() for n, b in model.named_buffers() if n.endswith(".bias")},
    }


def _assert_same(got: dict, want: dict, label) -> None:
    assert torch.equal(got["ce"], want["ce"]), label
    assert got["aux"].keys() == want["aux"].keys(), label
    for k in want["aux"]:
        assert torch.equal(got["aux"][k], want["aux"][k]), (label, k)
    assert got["grads"].keys() == want["grads"].keys()
    for n, g in want["grads"].items():
        assert g is not None, n
        assert torch.equal(got["grads"][n], g), (label, n, (got["grads"][n] - g).abs().max())
    for key in ("loads", "biases"):
        assert got[key].keys() == want[key].keys(), (label, key)
        for n in want[key]:
            assert torch.equal(got[key][n], want[key][n]), (label, key, n)


@pytest.fixture(scope="module")
def plain() -> dict[str, tuple[torch.nn.Module, dict]]:
    out = {}
    for name in ("llama", "dsv4"):
        base = _model(name)
        out[name] = (base, _step(_prepared(name, base, ActivationCheckpoint()), _args(name).vocab_size))
    return out


@pytest.mark.parametrize(("name", "mode"), _cases())
def test_recomputation_reproduces_loss_aux_gradients_and_routing(plain, name, mode):
    base, want = plain[name]
    model = _prepared(name, base, _modes(name)[mode])
    got = _step(model, _args(name).vocab_size)
    _assert_same(got, want, (name, mode))
    if name == "dsv4":
        assert set(want["aux"]) == {"indexer", "mtp"}
        assert sum(int(v.sum()) for v in want["loads"].values()) > 0  # the learned routers counted


def _tie_breaking_topk(calls: list[int]):
    """torch.topk that breaks ties towards the low index on even calls and towards the high index on
    odd calls (indices sorted): a router evaluated twice on a tie would route differently."""
    result = namedtuple("topk", "values indices")

    def topk(x, k, dim=-1, largest=True, sorted=True):
        assert dim in (-1, x.dim() - 1) and largest
        flip = len(calls) % 2 == 1
        calls.append(1)
        xs = x.flip(-1) if flip else x
        idx = torch.sort(xs, dim=-1, descending=True, stable=True).indices[..., :k]
        idx = (x.shape[-1] - 1 - idx) if flip else idx
        idx = idx.sort(dim=-1).values
        return result(x.gather(-1, idx), idx)

    return topk


def test_forced_router_tie_does_not_change_dispatch_in_the_recomputation(monkeypatch):
    """Experts 0 and 1 of every learned router score the same for every token; with a top-k that
    breaks the tie differently on each call, recomputation under `full` and `experts` gives the
    gradients and loads of no recomputation: the recomputation reuses the forward's choice (if it
    routed again, experts 0 and 1 would swap rows and the expert gradients would differ)."""
    base = build_dsv4_random(micro())
    with torch.no_grad():
        for gate in base.router_gates():
            gate.weight[1].copy_(gate.weight[0])
            gate.bias[1] = gate.bias[0]
    vocab = micro().vocab_size
    runs = {}
    for label, ac in [
        ("none", ActivationCheckpoint()),
        ("full", ActivationCheckpoint(mode="full")),
        ("experts", ActivationCheckpoint(mode="selective", regions=("experts",))),
    ]:
        calls: list[int] = []
        monkeypatch.setattr(torch, "topk", _tie_breaking_topk(calls))
        runs[label] = _step(_prepared("dsv4", base, ac), vocab), len(calls)
        monkeypatch.undo()
    want, n_calls = runs["none"]
    n_routers = len(list(base.router_gates()))
    assert n_calls == n_routers  # one top-k per learned router and forward, never in a recomputation
    for label in ("full", "experts"):
        got, n = runs[label]
        assert n == n_calls, label
        _assert_same(got, want, label)
    # The tie matters: the alternative choice on the second call routes differently.
    assert any(int(want["loads"][n][0]) != int(want["loads"][n][1]) for n in want["loads"])


# ============================================================================ saved bytes
T_SAVED = 128


def _saved(name: str, ac: ActivationCheckpoint | None, tokens: int = T_SAVED) -> activations.SavedBytes:
    spec, args = get_model_spec(name), _args(name)
    prepare = None if ac is None else activations.recomputation(spec, ac)
    return activations.measure(spec, args, tokens, torch.float64, prepare)


@pytest.mark.parametrize("name", ["llama", "dsv4"])
def test_saved_bytes_drop_to_the_block_input_under_full_and_by_each_region(name):
    args = _args(name)
    none = _saved(name, None)
    full = _saved(name, ActivationCheckpoint(mode="full"))
    width = args.dim * (args.hc_mult if name == "dsv4" else 1)
    block_input = T_SAVED * width * 8
    decisions = {}
    if name == "dsv4":  # the recorded expert ids [T, k] and, in CSA layers, the entries [T, index_topk]
        hashed = set(range(args.n_hash_layers))
        for i, kind in enumerate(args.layer_types):
            ids = 0 if i in hashed else T_SAVED * args.n_activated_experts * 8
            decisions[str(i)] = ids + (T_SAVED * args.index_topk * 8 if kind == "csa" else 0)
    for key, plain_bytes in none.layers.items():
        assert full.layers[key] == block_input + decisions.get(key, 0), key
        assert plain_bytes > 4 * full.layers[key], key
    for region, ac in _modes(name).items():
        if ac.mode != "selective":
            continue
        kept = _saved(name, ac)
        drop = {k: none.layers[k] - kept.layers[k] for k in none.layers}
        assert all(d >= 0 for d in drop.values()), (region, drop)
        assert sum(drop.values()) > 0, region
        # The embedding keeps its bytes; after the layers dsv4's MTP block recomputes the region too.
        assert kept.before == none.before and kept.after <= none.after, region
    # Per token and layer, tokens double -> bytes double (what docs/results.md §7's table reports per token).
    assert _saved(name, ActivationCheckpoint(mode="full"), 2 * T_SAVED).layers["0"] == 2 * full.layers["0"]


def test_llama_mlp_region_drops_exactly_its_hidden_activations():
    """llama's SwiGLU saves four [T, ffn_hidden] tensors (w1 x, w3 x, silu(w1 x), their product w2
    reads) besides its input, which under recomputation is all it keeps: the drop is those four."""
    args = _tiny_llama.ARGS
    none = _saved("llama", None)
    kept = _saved("llama", ActivationCheckpoint(mode="selective", regions=("mlp",)))
    hidden = T_SAVED * args.ffn_hidden_dim * 8
    for key in none.layers:
        drop = none.layers[key] - kept.layers[key]
        assert drop == 4 * hidden, (key, drop / hidden)


# ============================================================================ recompute FLOPs
def _flops(model: torch.nn.Module, vocab: int, monkeypatch=None) -> tuple[int, dict, int]:
    """(FLOPs of forward + backward, the forward's FLOPs per module, the forward's FLOPs inside the
    indexer's selection: decided once, so never recomputed)."""
    tokens, batch = packed(LENGTHS, vocab, pad_to=4, tail=12, seed=3)
    selected = [0]
    with FlopCounterMode(display=False) as counter:
        if monkeypatch is not None:
            select = Indexer.select

            def counted(self, *a, **k):
                before = counter.get_total_flops()
                out = select(self, *a, **k)
                selected[0] += counter.get_total_flops() - before
                return out

            monkeypatch.setattr(Indexer, "select", counted)
        out = model(tokens, meta(batch))
        loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask) + sum(out.aux_losses.values())
        forward = {k: sum(v.values()) for k, v in counter.get_flop_counts().items()}
        loss.backward()
    if monkeypatch is not None:
        monkeypatch.undo()
    return counter.get_total_flops(), forward, selected[0]


def _module_forward(forward: dict, suffixes: list[str]) -> int:
    return sum(v for k, v in forward.items() if any(k.endswith(s) for s in suffixes))


@pytest.mark.parametrize("name", ["llama", pytest.param("dsv4", marks=pytest.mark.extended)])
def test_recompute_flops_are_one_more_forward_of_what_is_recomputed(plain, name, monkeypatch):
    """Forward + backward FLOPs with recomputation less without = the forward FLOPs of the recomputed
    blocks / modules, less the indexer's top-k scoring inside them (decided once, replayed)."""
    base, _ = plain[name]
    vocab = _args(name).vocab_size
    total_none, forward, _ = _flops(_prepared(name, base, ActivationCheckpoint()), vocab)
    top = type(base).__name__
    blocks = [f"{top}.layers.{k}" for k in base.layers]
    if name == "dsv4":
        blocks += [f"{top}.mtp.{i}" for i in range(len(base.mtp))]
    cases = {"full": blocks, "full first1": blocks[:1]}
    if name == "llama":
        cases["mlp"] = [f"{b}.feed_forward" for b in blocks]
    else:
        cases["mhc"] = [f"{b}.{hc}" for b in blocks for hc in ("hc_attn", "hc_ffn")]
        cases["experts"] = [f"{b}.ffn.experts" for b in blocks]
    for mode, modules in cases.items():
        total, _, selected = _flops(_prepared(name, base, _modes(name)[mode]), vocab, monkeypatch)
        expected = sum(forward[m] for m in modules)
        assert expected > 0, (mode, modules)
        not_replayed = selected if mode == "full" else 0  # layer 0 (first1) is a sliding layer
        assert name == "llama" or mode != "full" or selected > 0
        assert total - total_none == expected - not_replayed, (mode, total - total_none, expected)


def test_recompute_region_without_a_module_adds_its_own_flops(plain):
    """attn_up_proj is a function region: its recomputation adds the query up-projection and the
    K=V projection of every block once more (2 T in out per matmul), nothing else."""
    base, _ = plain["dsv4"]
    args, vocab = micro(), micro().vocab_size
    total_none, _, _ = _flops(_prepared("dsv4", base, ActivationCheckpoint()), vocab)
    total, _, _ = _flops(
        _prepared("dsv4", base, ActivationCheckpoint(mode="selective", regions=("attn_up_proj",))), vocab
    )
    T = sum(-(-L // 4) * 4 for L in LENGTHS) + 12
    n_blocks = len(base.layers) + len(base.mtp)
    q = 2 * T * args.q_lora_rank * args.n_heads * args.head_dim
    kv = 2 * T * args.dim * args.head_dim  # no CP: the key rows are this rank's T rows
    assert total - total_none == n_blocks * (q + kv)
