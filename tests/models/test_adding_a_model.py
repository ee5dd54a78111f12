"""A third family from the guide alone: a toy model, its spec (docs/adding_a_model.md §2) and
the guide's own Hugging Face adapter (docs/adding_a_model.md §6, its code block run as written),
registered like a family; the generic door then exports it and loads it back bitwise, checks a
folder against a flavor, and names transformers' modules, with no other Hugging Face code written
for it."""

from __future__ import annotations

import dataclasses
import json
import re
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

import titan_thd.models
from titan_thd.models import get_model_spec, hf
from titan_thd.models.spec import ModelSpec, ParallelSpec, build_initialised

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding_a_model.md"


@dataclasses.dataclass
class ToyArgs:
    vocab_size: int = 64
    dim: int = 16
    n_layers: int = 2


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(x))


class Toy(nn.Module):
    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim)
        self.head = nn.Linear(args.dim, args.vocab_size, bias=False)

    def init_weights(self, seed: int | None = None) -> None:
        with torch.no_grad():
            for p in self.parameters():
                p.normal_(0.0, 0.1)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(self.norm(x))


def guide_adapter():
    """The adapter of docs/adding_a_model.md §6, its code block run as written (`ToyArgs` is the family's)."""
    section = GUIDE.read_text().split("## 6. Hugging Face weights", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    namespace = {"ToyArgs": ToyArgs}
    exec(compile(code, str(GUIDE), "exec"), namespace)
    return namespace["HF"]


@pytest.fixture
def toy(monkeypatch):
    """The family registered as the guide says: a package exposing `spec`, its name a model name."""
    spec = ModelSpec(
        name="toy",
        flavors={"small": ToyArgs(), "wide": ToyArgs(dim=32)},
        build=lambda args: build_initialised(lambda: Toy(args)),
        flops_per_step=lambda args, lengths: 6.0 * sum(lengths) * args.dim * args.dim * args.n_layers,
        parallel=ParallelSpec(cp_mode="zigzag"),
        hf=guide_adapter(),
    )
    package = types.ModuleType("titan_thd.models.toy")
    package.spec = spec
    monkeypatch.setitem(sys.modules, "titan_thd.models.toy", package)
    monkeypatch.setattr(titan_thd.models, "MODEL_NAMES", (*titan_thd.models.MODEL_NAMES, "toy"))
    return get_model_spec("toy")


def test_a_toy_family_round_trips_through_the_guides_adapter(toy, tmp_path):
    torch.manual_seed(0)
    args = toy.flavors["small"]
    model = toy.build(args)
    out = hf.export(toy, model, args, tmp_path / "hf", max_shard_size=2_000)  # several files + index
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(index.values())) > 1
    assert "model.layers.1.mlp.down_proj.weight" in index and "lm_head.weight" in index
    assert json.loads((out / "config.json").read_text())["hidden_size"] == args.dim

    back = hf.load(toy, out)  # args from config.json, weights each from its file
    assert back.args == args
    for (k, a), (k2, b) in zip(model.state_dict().items(), back.state_dict().items(), strict=True):
        assert k == k2 and torch.equal(a, b), k
    tokens = torch.tensor([1, 5, 9, 2])
    assert torch.equal(model(tokens), back(tokens))

    hf.check(toy, args, out, "model.flavor = 'small'")
    with pytest.raises(
        ValueError, match=r"config.json does not match flavor 'wide': dim: checkpoint 16 vs 32"
    ):
        hf.load(toy, out, "wide")
    assert toy.hf.hf_module("layers.0.proj") == "model.layers.0.mlp.down_proj"
    with pytest.raises(ValueError, match="no transformers module"):
        toy.hf.hf_module("layers.0")
