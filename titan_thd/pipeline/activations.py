"""Activation memory of one microbatch per layer: what each pipeline stage keeps per in-flight
microbatch (docs/design.md §5.3).

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
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import numpy as np
import torch

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packer import pack_microbatch
from titan_thd.models.spec import ModelSpec, count_params

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

    def of(self, layer_keys: list[str], first: bool, last: bool) -> float:
        """One stage's (or pipeline chunk's) bytes per microbatch."""
        return sum(self.layers[k] for k in layer_keys) + first * self.before + last * self.after


@dataclasses.dataclass
class _Document:
    input_ids: np.ndarray
    target_mask: np.ndarray


def measure(spec: ModelSpec, args: Any, tokens: int, dtype: torch.dtype) -> SavedBytes:
    """Saved bytes of one forward + loss of `spec.build(args)` on one document of `tokens` tokens."""
    with torch.random.fork_rng(devices=[]):  # the caller's RNG stream stays untouched
        torch.manual_seed(0)
        model = spec.build(args).to(dtype).train()
    rng = np.random.default_rng(0)
    doc = _Document(rng.integers(0, args.vocab_size, tokens), np.arange(tokens) > 0)
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

    hooks = []
    for key, layer in model.layers.items():
        hooks.append(layer.register_forward_pre_hook(lambda m, a, key=key: state.update(layer=key)))
        hooks.append(layer.register_forward_hook(lambda m, a, o: state.update(layer=None, passed=True)))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(batch.tokens, meta)
            loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask)
            loss = loss + sum(out.aux_losses.values())
    finally:
        for h in hooks:
            h.remove()
    del loss, out  # no backward: the graph and what it saved go here
    layers = {key: counts.get(key, 0.0) for key in model.layers}
    return SavedBytes(layers, counts.get("before", 0.0), counts.get("after", 0.0))


def estimate(
    spec: ModelSpec, args: Any, tokens: int, dtype: torch.dtype, narrow_ok: bool = True
) -> SavedBytes | None:
    """`measure` at full width when the model is small enough, else extrapolated from two narrowed
    copies (module docstring; minutes of CPU for DSv4-Flash, so only where `narrow_ok`, else None).
    The keys are the full model's layers either way."""
    with torch.device("meta"):
        n = count_params(spec.build(args))
    f = next((f for f in (64, 32, 16, 8, 4) if _narrows(spec, args, f)), None)
    if n <= MAX_MEASURED_PARAMS or f is None:
        return measure(spec, args, tokens, dtype)
    if not narrow_ok:
        return None
    logger.info(
        "dry run: measuring the saved activations per layer on narrowed copies of the model (minutes)"
    )
    (narrow_a, kind_of), (narrow_b, _) = spec.narrow(args, f), spec.narrow(args, f // 2)
    a = measure(spec, narrow_a, tokens, dtype)
    b = measure(spec, narrow_b, tokens, dtype)
    full = extrapolate(a, b, f)
    return SavedBytes({str(i): full.layers[str(k)] for i, k in enumerate(kind_of)}, full.before, full.after)


def extrapolate(a: SavedBytes, b: SavedBytes, f: int) -> SavedBytes:
    """Full-width bytes from measurements at widths 1/f (a) and 2/f (b): x(1) = b + (b - a)(f - 2)."""

    def line(x: float, y: float) -> float:
        return y + (y - x) * (f - 2)

    return SavedBytes(
        {k: line(a.layers[k], b.layers[k]) for k in a.layers},
        line(a.before, b.before),
        line(a.after, b.after),
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
