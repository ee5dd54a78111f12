"""Saved-activation bytes per layer (titan_thd/memory/activations.py): the count against a model
whose saved tensors are known by hand, and the narrowed-copy extrapolation against a direct
measurement of the same model (both exact: the bytes are integers)."""

import dataclasses

import pytest
import torch
from torch import nn

from titan_thd.memory import activations
from titan_thd.models import get_model_spec
from titan_thd.models.spec import ModelOutput, ModelSpec, ParallelSpec

T, D, V = 64, 16, 32


class _Toy(nn.Module):
    """embed -> n x (Linear, ReLU) -> head: autograd saves each Linear's input and ReLU's output."""

    def __init__(self, args):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(D, D), nn.ReLU()) for i in range(3)})
        self.head = nn.Linear(D, V)

    def forward(self, tokens, meta):
        h = self.embed(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return ModelOutput(self.head(h), {})


@dataclasses.dataclass
class _ToyArgs:
    vocab_size: int = V


def test_counts_each_saved_storage_once_where_it_is_saved_first():
    spec = ModelSpec("toy", {}, build=_Toy, flops_per_step=lambda a, d: 0.0, parallel=ParallelSpec("zigzag"))
    got = activations.measure(spec, _ToyArgs(), T, torch.float32)
    row = T * D * 4
    # Layer 0 saves the embedding output and its ReLU output; later layers only their ReLU output
    # (their Linear's input is the previous ReLU's output, already counted); the embedding saves
    # its int64 indices.
    assert got.layers == {"0": 2 * row, "1": row, "2": row}
    assert got.before == T * 8
    assert got.after > 0  # the head and the loss save the logits' worth (implementation-defined)
    assert got.of(["1", "2"], first=False, last=False) == 2 * row


@pytest.mark.parametrize(("name", "flavor"), [("llama", "debug"), ("dsv4", "micro")])
def test_narrowed_copies_extrapolate_to_the_full_width(name, flavor):
    """Measured at widths (and vocabulary) / 4 and / 2 with one layer per kind, extrapolated to full width: the
    first layer of each kind and the non-layer parts match the direct measurement to the byte.
    Later layers of a kind may differ by what they share with the layer before (<= 1 %)."""
    spec = get_model_spec(name)
    args = dataclasses.replace(spec.flavors[flavor], vocab_size=V * 4)
    tokens = 128
    direct = activations.measure(spec, args, tokens, torch.float32)
    (a_args, kind_of), (b_args, _) = activations.narrowed(spec, args, 4), activations.narrowed(spec, args, 2)
    assert a_args.vocab_size == args.vocab_size // 4  # the logits narrow too
    a = activations.measure(spec, a_args, tokens, torch.float32)
    b = activations.measure(spec, b_args, tokens, torch.float32)
    full = activations.extrapolate(a, b, 4)
    assert (full.before, full.after) == (direct.before, direct.after)
    first_of_kind = {k: i for i, k in reversed(list(enumerate(kind_of)))}
    for k, i in first_of_kind.items():
        assert full.layers[str(k)] == direct.layers[str(i)], (k, i)
    for i, k in enumerate(kind_of):
        assert full.layers[str(k)] == pytest.approx(direct.layers[str(i)], rel=0.01), i
    with pytest.raises(ValueError, match="do not narrow"):
        spec.narrow(args, 3)


def test_estimate_of_a_large_model_uses_the_narrowed_copies(monkeypatch):
    """Above the size limit `estimate` measures narrowed copies, with every full layer keyed."""
    spec = get_model_spec("dsv4")
    args = dataclasses.replace(spec.flavors["micro"], vocab_size=V * 4)
    monkeypatch.setattr(activations, "MAX_MEASURED_PARAMS", 0)
    got = activations.estimate(spec, args, 128, torch.float32)
    direct = activations.measure(spec, args, 128, torch.float32)
    assert got.layers.keys() == direct.layers.keys()
    assert got.of(list(got.layers), True, True) == pytest.approx(
        direct.of(list(direct.layers), True, True), rel=0.01
    )
