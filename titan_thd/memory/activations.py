"""Activation memory of one microbatch per layer: what a rank (each pipeline stage) keeps per in-flight
microbatch, and what a recomputation brings back for one layer (docs/design.md §5.3, §5.4).

A stage keeps, for every microbatch whose backward has not run yet, what autograd saved in its
forward. That is measured, not modelled: the model's forward and loss run once on one document of
T_local tokens under a saved-tensor hook that counts every saved storage once (parameters excluded).
Bytes saved while layer i runs are layer i's; before the first layer they belong to the first stage
(the embedding), after the last to the last stage (final norm, head, loss, MTP).

A model too large to build here (DSv4-Flash) is measured on a narrowed copy (`ModelSpec.narrow`:
every width divided by f, one layer of each kind, the counts kept: heads, windows, top-k, routed
experts per token, vocabulary). Each saved tensor is either linear in one width or independent of
the widths, so saved(1/f) = A/f + B: two narrow measurements (f and f/2) give A and B and so the
full-width value (tested against a direct measurement). Not counted: context-parallel exchange
buffers (the measurement runs without CP) and the transient memory inside one op.

Under activation recomputation the measured model is the run's (its `parallelize` on one process
applies the same `apply_ac`), so the hook sees what the checkpoints keep: the regions' inputs, and the
decisions recorded for their recomputation (parallel/recompute.py). What a layer's recomputation holds
again during its backward is that layer's bytes without recomputation less its bytes with it
(`ActivationMemory.recompute`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.components.progress import Progress
from titan_thd.config import ActivationCheckpoint
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packer import pack_microbatch
from titan_thd.data.sample import Sample
from titan_thd.lora.targets import LoRAPlan, attach, init_adapters
from titan_thd.memory import cache
from titan_thd.memory.state import size
from titan_thd.models.spec import ModelSpec, count_params
from titan_thd.parallel.offload import observe_offload
from titan_thd.parallel.recompute import observe_decisions

logger = logging.getLogger("titan_thd")

MAX_MEASURED_PARAMS = 60_000_000
"""Models up to this size are measured at their own widths; larger ones on narrowed copies."""


@dataclasses.dataclass(frozen=True)
class SavedBytes:
    """Bytes autograd saves for the backward of one microbatch."""

    layers: dict[str, float]
    """Layer key (the model's `layers.<key>`) -> bytes saved inside that layer."""
    before: float
    """Saved before the first layer: the first stage's."""
    after: float
    """Saved after the last layer: the last stage's."""
    host: dict[str, float] = dataclasses.field(default_factory=dict)
    """activation_checkpoint.offload: layer key (or "after": dsv4's MTP) -> its inputs in host memory."""

    def of(self, layer_keys: list[str], first: bool, last: bool) -> float:
        """One stage's (or pipeline chunk's) bytes per microbatch."""
        return sum(self.layers[k] for k in layer_keys) + first * self.before + last * self.after


Prepare = Callable[[nn.Module], nn.Module]
"""A built model -> the model as the run computes it (its activation recomputation applied)."""


def recomputation(spec: ModelSpec, ac: ActivationCheckpoint) -> Prepare | None:
    """The run's activation recomputation on every block of a model built in this process (the model's
    `parallelize` on one process: no TP, EP or FSDP, eager), for `measure`; None for mode none."""
    if ac.mode == "none":
        return None
    assert spec.parallelize is not None  # validate_combinations refused recomputation without it
    from titan_thd.parallel.parallel_dims import ParallelDims

    one = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    every_block = dataclasses.replace(ac, layers=0)
    return lambda model: spec.parallelize(model, one, compile=False, ac=every_block)


def measure(
    spec: ModelSpec,
    args: Any,
    tokens: int,
    dtype: torch.dtype,
    prepare: Prepare | None = None,
    loss_chunk: int = 0,
) -> SavedBytes:
    """Saved bytes of one forward + loss of `spec.build(args)` (through `prepare`) on one document of
    `tokens` tokens; `loss_chunk` > 0: the loss as loss.chunked computes it (no [T, V] logits)."""
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched
        torch.manual_seed(0)
        model = spec.build(args).to(dtype).train()
    if prepare is not None:
        model = prepare(model)
    rng = np.random.default_rng(0)
    doc = Sample(rng.integers(0, args.vocab_size, tokens), np.arange(tokens) > 0)
    batch = pack_microbatch([doc], tokens, 1, 0)
    meta = BatchMeta.from_batch(batch)

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()
    counts: dict[str, float] = {}
    state: dict[str, Any] = {"layer": None, "passed": False}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in params and ptr not in seen:  # saved tensors stay alive: addresses are unique
            seen.add(ptr)
            where = state["layer"] or ("after" if state["passed"] else "before")
            counts[where] = counts.get(where, 0) + storage.nbytes()
        return t

    def decision(value: Any) -> None:  # kept for a recomputation: alive like a saved tensor
        for t in value if isinstance(value, tuple) else (value,):
            if isinstance(t, torch.Tensor):
                pack(t)

    host: dict[str, float] = {}

    def offloaded(t: torch.Tensor) -> None:  # a block's input copied to host memory (offload)
        where = state["layer"] or "after"
        host[where] = host.get(where, 0) + t.untyped_storage().nbytes()

    hooks = []
    for key, layer in model.layers.items():
        hooks.append(layer.register_forward_pre_hook(lambda m, a, key=key: state.update(layer=key)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: state.update(layer=None, passed=True)))
    try:
        with (
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
            observe_decisions(decision),
            observe_offload(offloaded),
        ):
            out = model(batch.tokens, meta, **({"loss_chunk": loss_chunk} if loss_chunk else {}))
            loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask)
            loss = loss + sum(out.aux_losses.values())
    finally:
        for h in hooks:
            h.remove()
    del loss, out  # no backward: the graph and what it saved go here
    layers = {key: counts.get(key, 0.0) for key in model.layers}
    return SavedBytes(layers, counts.get("before", 0.0), counts.get("after", 0.0), host)


def estimate(
    spec: ModelSpec,
    args: Any,
    tokens: int,
    dtype: torch.dtype,
    narrow_ok: bool = True,
    prepare: Prepare | None = None,
    progress: Progress | None = None,
    loss_chunk: int = 0,
) -> SavedBytes | None:
    """`measure` at full width when the model is small enough, else extrapolated from two narrowed
    copies (module docstring; a minute or more of CPU for DSv4-Flash, so only where `narrow_ok`, else
    None). The keys are the full model's layers either way; `progress` counts each forward."""
    f = narrow_factor(spec, args, narrow_ok)
    if f is None:
        return None
    if f == 1:
        got = measure(spec, args, tokens, dtype, prepare, loss_chunk)
        if progress is not None:
            progress.advance(tokens)
        return got
    (narrow_a, kind_of), (narrow_b, _) = narrowed(spec, args, f), narrowed(spec, args, f // 2)
    a = measure(spec, narrow_a, tokens, dtype, prepare, loss_chunk)
    if progress is not None:
        progress.advance(tokens)
    b = measure(spec, narrow_b, tokens, dtype, prepare, loss_chunk)
    if progress is not None:
        progress.advance(tokens)
    full = extrapolate(a, b, f)
    host = {str(i): full.host[str(k)] for i, k in enumerate(kind_of) if str(k) in full.host}
    host |= {"after": full.host["after"]} if "after" in full.host else {}
    return SavedBytes(
        {str(i): full.layers[str(k)] for i, k in enumerate(kind_of)}, full.before, full.after, host
    )


def narrow_factor(spec: ModelSpec, args: Any, narrow_ok: bool = True) -> int | None:
    """How `estimate` measures `args`: 1 at full width (up to `MAX_MEASURED_PARAMS`, or a model that
    does not narrow), f on copies narrowed by f and f / 2, None not at all (too large, not `narrow_ok`)."""
    with torch.device("meta"):
        n = count_params(spec.build(args))
    f = next((f for f in (64, 32, 16, 8, 4) if _narrows(spec, args, f)), None)
    if n <= MAX_MEASURED_PARAMS or f is None:
        return 1
    return f if narrow_ok else None


def narrowed(spec: ModelSpec, args: Any, f: int) -> tuple[Any, list[int]]:
    """`spec.narrow(args, f)` with the vocabulary / f as well where f divides it: the logits, the
    loss's log-probabilities and their float32 copies ([T, V] each) are linear in V as the other
    saved tensors are in their one width, so the extrapolation stays exact; at Flash's 129,280 and
    8,192 tokens they were 7.6 of the 8.0 GiB a narrowed copy saved and 30 % of its time
    (docs/results.md §14)."""
    narrow_args, kind_of = spec.narrow(args, f)
    if args.vocab_size % f == 0:
        narrow_args = dataclasses.replace(narrow_args, vocab_size=args.vocab_size // f)
    return narrow_args, kind_of


def extrapolate(a: SavedBytes, b: SavedBytes, f: int) -> SavedBytes:
    """Full-width bytes from measurements at widths 1/f (a) and 2/f (b): x(1) = b + (b - a)(f - 2)."""

    def line(x: float, y: float) -> float:
        return y + (y - x) * (f - 2)

    return SavedBytes(
        {k: line(a.layers[k], b.layers[k]) for k in a.layers},
        line(a.before, b.before),
        line(a.after, b.after),
        {k: line(a.host.get(k, 0.0), b.host.get(k, 0.0)) for k in {*a.host, *b.host}},
    )


def _narrows(spec: ModelSpec, args: Any, f: int) -> bool:
    if spec.narrow is None:
        return False
    try:
        spec.narrow(args, f)
        spec.narrow(args, f // 2)
    except ValueError:
        return False
    return True


RECOMPUTE_TOKENS = 2048
"""What a layer's recomputation holds is measured on a document of at most this many tokens and
scaled to T (linear in the tokens): measured at T it would hold, once at start-up, the activations of
a whole forward without recomputation, the memory the recomputation is there to avoid."""


@dataclasses.dataclass(frozen=True)
class ActivationMemory:
    """Activation bytes of one microbatch, per layer, with and without the run's recomputation."""

    plain: SavedBytes | None
    """Saved from the forward to the backward without recomputation (None: not measured at T, since
    every block is recomputed)."""
    kept: SavedBytes
    """The same with every block recomputed as the run's mode says (= plain for mode none)."""
    recompute: dict[str, float]
    """Layer key -> bytes its recomputation holds again while its backward runs (0 for mode none;
    `activation_memory`); "after": the same for the blocks after the last layer (dsv4's MTP)."""
    layers: int = 0
    """activation_checkpoint.layers: only the first N blocks of each stage are recomputed (0 = all)."""
    loss_grad: float = 0.0
    """What the loss's backward holds at the start of the last stage's backward: the gradients of
    the log-softmax and of the logits, [T, vocab] each in at least float32, or under loss.chunked one
    chunk's (`loss_gradient_bytes`)."""

    def stage(self, layer_keys: list[str], first: bool, last: bool) -> tuple[float, float]:
        """(saved bytes per microbatch, the backward's largest transient) of one pipeline stage (or of
        the whole model): its first `layers` blocks, the blocks after its last layer counted last,
        keep `kept`, the others `plain`; one block is recomputed at a time, and not while the loss's
        backward (last stage) holds its gradients."""
        n = self.layers or len(layer_keys) + 1
        wrapped, tail = layer_keys[:n], last and len(layer_keys) < n
        plain = self.plain or self.kept
        assert self.plain is not None or (len(wrapped) == len(layer_keys) and (tail or not last))
        saved = sum(self.kept.layers[k] if k in wrapped else plain.layers[k] for k in layer_keys)
        saved += first * self.kept.before + last * (self.kept.after if tail else plain.after)
        peaks = [self.recompute[k] for k in wrapped] + [self.recompute["after"]] * tail
        ahead = max(self.kept.host.values(), default=0.0)  # offload: the next block's inputs fetched
        return saved, max([p + ahead for p in peaks] + [last * self.loss_grad], default=0.0)

    def host(self, layer_keys: list[str], last: bool) -> float:
        """activation_checkpoint.offload: host bytes per microbatch of one stage (its recomputed
        blocks' inputs, `stage`'s `wrapped` and tail); 0 without offload."""
        n = self.layers or len(layer_keys) + 1
        wrapped, tail = layer_keys[:n], last and len(layer_keys) < n
        return sum(self.kept.host.get(k, 0.0) for k in wrapped) + tail * self.kept.host.get("after", 0.0)


def loss_gradient_bytes(
    args: Any, tokens: int, dtype: torch.dtype, loss_chunk: int = 0, head_trained: bool = True
) -> float:
    """ActivationMemory.loss_grad: cross-entropy's backward makes the gradient of the log-softmax and
    from it the gradient of the logits ([T, vocab] each, float32 at least: loss.py upcasts), both alive
    at once (measured: memory/live.py). loss.chunked (chunked_loss.py): one chunk of min(loss_chunk, T)
    rows: its logits in the compute dtype, their float32 copy turned in place into the gradient, cast
    back; a trained head below float32 adds its weight gradient's float32 accumulator [vocab, dim]."""
    acc = torch.promote_types(dtype, torch.float32)
    itemsize = torch.empty((), dtype=acc).element_size()
    if not loss_chunk:
        return 2.0 * tokens * args.vocab_size * itemsize
    rows, narrow = min(loss_chunk, tokens), (dtype != acc) * dtype.itemsize
    accumulator = head_trained * (dtype != acc) * args.vocab_size * args.dim * itemsize
    return float(rows * args.vocab_size * (itemsize + narrow) + accumulator)


_MEASURED: dict[str, ActivationMemory | None] = {}


def activation_memory(
    spec: ModelSpec,
    args: Any,
    tokens: int,
    dtype: torch.dtype,
    ac: ActivationCheckpoint,
    narrow_ok: bool = True,
    lora: LoRAPlan | None = None,
    loss_chunk: int = 0,
) -> ActivationMemory | None:
    """Saved bytes per layer of one microbatch of `tokens` tokens without and with the run's
    recomputation, and what each layer's recomputation holds; None where `estimate` is None (a model
    too large to measure). Measured once per process and setting (a test that starts several runs of
    one model measures once; the one-process `parallelize` reads no parallelism degree). With `lora`
    the model measured carries the run's adapters on its frozen base: a frozen projection does not
    save its input for a weight gradient (its adapter's A does, the same tensor once).

    What a layer's recomputation holds: under `full` the layer's plain bytes less what it keeps;
    under `selective` the regions are recomputed one at a time (each at its own first unpack in the
    backward), so the largest region's own bytes, each region measured alone."""
    key = repr((spec.name, args, tokens, dtype, ac, narrow_ok, lora))
    key += f" loss_chunk {loss_chunk}" if loss_chunk else ""  # the keys of the full logits unchanged
    if key not in _MEASURED:
        if lora is not None:  # every build of the measurement (narrowed copies too) gets the adapters
            spec = dataclasses.replace(spec, build=functools.partial(_with_adapters, spec.build, lora))
        head_trained = lora is None  # LoRA never adapts the head
        _MEASURED[key] = _activation_memory(
            spec, args, tokens, dtype, ac, narrow_ok, key, (loss_chunk, head_trained)
        )
    return _MEASURED[key]


def _with_adapters(build: Callable[[Any], nn.Module], lora: LoRAPlan, args: Any) -> nn.Module:
    model = build(args)
    attach(model, lora)
    if next(model.parameters()).device.type != "meta":
        init_adapters(model, 0)
    return model


def lengths_measured(tokens: int, ac: ActivationCheckpoint) -> list[int]:
    """The document lengths `activation_memory` measures, in order (one forward each, two on
    narrowed copies): T with the run's recomputation; then, under recomputation, at
    min(T, RECOMPUTE_TOKENS) without it and with it (each region alone under `selective`), and at T
    without it where only the first `layers` blocks are recomputed."""
    if ac.mode == "none":
        return [tokens]
    short = min(tokens, RECOMPUTE_TOKENS)
    regions = len(ac.regions) if ac.mode == "selective" and len(ac.regions) > 1 else 0
    kept_short = [short] if short != tokens and not regions else []
    return [
        tokens,
        short,
        *kept_short,
        *[short] * regions,
        *([tokens] if short < tokens and ac.layers else []),
    ]


def _activation_memory(spec, args, tokens, dtype, ac, narrow_ok, key, loss=(0, True)):
    """`activation_memory` measured, or read from the disk cache (memory/cache.py) where it measures
    narrowed copies (a minute or more: once per model shape, length, dtype and recomputation)."""
    f = narrow_factor(spec, args, narrow_ok)
    if f is None:
        return None
    if f > 1 and (stored := cache.load(key)) is not None:
        logger.info(
            "memory plan: saved activations per layer read from %s (measured before)", cache.path_of(key)
        )
        return from_json(stored)
    lengths = lengths_measured(tokens, ac)
    forwards = len(lengths) * (1 if f == 1 else 2)
    on = f"narrowed copies (widths / {f} and / {f // 2})" if f > 1 else "the model"
    what = f"memory plan: measuring the saved activations per layer of one microbatch of {tokens:,} tokens"
    what += f" on {on}"
    weight = sum(lengths) * (1 if f == 1 else 2)
    with Progress(what, forwards, "forwards", weight=weight, announce=f > 1) as progress:
        got = _measure_all(spec, args, tokens, dtype, ac, narrow_ok, progress, loss)
    assert progress.count == forwards, (progress.count, forwards)  # lengths_measured is the plan
    if f > 1 and got is not None:
        cache.store(key, dataclasses.asdict(got))
    return got


def from_json(d: dict[str, Any]) -> ActivationMemory:
    """An `ActivationMemory` from its `dataclasses.asdict` (the disk cache's JSON)."""
    plain = None if d["plain"] is None else SavedBytes(**d["plain"])
    return ActivationMemory(plain, SavedBytes(**d["kept"]), d["recompute"], d["layers"], d["loss_grad"])


def _measure_all(spec, args, tokens, dtype, ac, narrow_ok, progress, loss):
    """`loss`: (loss.chunked's rows per chunk or 0, whether the head is trained)."""
    recompute, chunk = recomputation(spec, ac), loss[0]
    measured = functools.partial(estimate, loss_chunk=chunk)  # the loss as the run computes it
    kept = measured(spec, args, tokens, dtype, narrow_ok, recompute, progress)
    if kept is None:
        return None
    loss_grad = loss_gradient_bytes(args, tokens, dtype, *loss)
    if recompute is None:
        return ActivationMemory(kept, kept, dict.fromkeys([*kept.layers, "after"], 0.0), 0, loss_grad)
    short = min(tokens, RECOMPUTE_TOKENS)
    plain_short = measured(spec, args, short, dtype, narrow_ok, None, progress)
    assert plain_short is not None
    if ac.mode == "selective" and len(ac.regions) > 1:
        one_region = [dataclasses.replace(ac, regions=(r,)) for r in ac.regions]
        alone = [
            measured(spec, args, short, dtype, narrow_ok, recomputation(spec, a), progress)
            for a in one_region
        ]
    else:
        kept_short = (
            kept if short == tokens else measured(spec, args, short, dtype, narrow_ok, recompute, progress)
        )
        alone = [kept_short]
    scale = tokens / short

    def held(plain: float, kept_alone: list[float]) -> float:
        return max(max(0.0, plain - k) for k in kept_alone) * scale

    back = {k: held(plain_short.layers[k], [a.layers[k] for a in alone]) for k in kept.layers}
    back["after"] = held(plain_short.after, [a.after for a in alone])
    plain = plain_short
    if short < tokens:  # the blocks after the first `layers` of a stage keep their plain bytes at T
        plain = measured(spec, args, tokens, dtype, narrow_ok, None, progress) if ac.layers else None
    return ActivationMemory(plain, kept, back, ac.layers, loss_grad)


def summary(
    acts: ActivationMemory,
    tokens: int,
    other_bytes: int,
    other: str = "parameters, gradients and optimizer state",
) -> str:
    """The log header's activation line of a run without pipeline parallelism (one microbatch in
    flight at a time); `other_bytes`: the rank's parameters, gradients and optimizer state (what
    `other` names: a base kept as released adds its stored bytes and transients)."""
    saved, back = acts.stage(list(acts.kept.layers), first=True, last=True)
    return (
        f"activations per rank (measured per layer, docs/design.md §5.3): one microbatch of {tokens:,} "
        f"tokens saves {size(saved)}"
        + (f" + backward transient (recomputation or loss gradient) {size(back)}" if back else "")
        + f" = {size(saved + back)}; total with {other} {size(saved + back + other_bytes)}"
    )
