"""A third family from the guide alone: a toy model, its spec (docs/adding_a_model.md §2) and
the guide's own Hugging Face adapter (docs/adding_a_model.md §6, its code block run as written),
registered like a family; the generic door then exports it and loads it back bitwise, checks a
folder against a flavor, and names transformers' modules, with no other Hugging Face code written
for it. Its projection follows docs/adding_a_model.md §7 (`models/projection.Linear`), so `[lora]`
adapts it; the same family built on a plain `nn.Linear` is refused at start-up in one line."""

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
from titan_thd.lora.targets import LoRAPlan, attach, init_adapters, resolve_lora
from titan_thd.models import get_model_spec, hf
from titan_thd.models.projection import Linear, LoRATargets, Target
from titan_thd.models.spec import ModelSpec, ParallelSpec, build_initialised

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "adding_a_model.md"


@dataclasses.dataclass
class ToyArgs:
    vocab_size: int = 64
    dim: int = 16
    n_layers: int = 2


class Block(nn.Module):
    def __init__(self, dim: int, linear: type[nn.Linear] = Linear):
        super().__init__()
        self.proj = linear(dim, dim, bias=False)  # a projection (docs/adding_a_model.md §7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(torch.relu(x))


class Toy(nn.Module):
    def __init__(self, args: ToyArgs, linear: type[nn.Linear] = Linear):
        super().__init__()
        self.args = args
        self.embed = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args.dim, linear) for i in range(args.n_layers)})
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


TOY_LORA = LoRATargets(targets={"mlp.proj": Target("proj")}, groups={"mlp": ("mlp.proj",)})


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
        lora=TOY_LORA,
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


def test_lora_adapts_the_toy_familys_projection_and_refuses_a_plain_linear(toy):
    args = toy.flavors["small"]
    with torch.device("meta"):  # what start-up resolves against: shapes only
        meta = toy.build(args)
    plan = resolve_lora(["mlp"], 4, 8.0, False, toy.lora, meta, "toy/small")
    assert plan.targets == ("mlp.proj",)

    torch.manual_seed(0)
    model = toy.build(args)
    tokens = torch.tensor([1, 5, 9, 2])
    base = model(tokens)
    assert attach(model, plan) == ["layers.0.proj", "layers.1.proj"]
    init_adapters(model, seed=3)
    assert torch.equal(model(tokens), base)  # B = 0: the base model exactly
    with torch.no_grad():
        model.layers["1"].proj.lora_B.fill_(0.5)
    assert not torch.allclose(model(tokens), base)  # the projection's forward reads its adapter

    with torch.device("meta"):
        plain = Toy(args, linear=nn.Linear)
    refusal = (
        r"^lora.targets: 'mlp.proj' is layers.0.proj, a torch.nn.modules.linear.Linear adapting \['weight'\], "
        r"not a projection whose forward reads an adapter; build it as titan_thd.models.projection.Linear .*"
        r"docs/adding_a_model.md §7$"
    )
    with pytest.raises(ValueError, match=refusal):
        resolve_lora(["mlp"], 4, 8.0, False, toy.lora, plain, "toy/small")
    with pytest.raises(ValueError, match=refusal):
        attach(plain, LoRAPlan(("mlp.proj",), toy.lora, 4, 8.0, False))
    assert not any("lora" in name for name, _ in plain.named_parameters())  # refused before attaching
