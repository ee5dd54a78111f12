"""One optimizer step of each recipe creates no tensor without an explicit device.

The model and the batch live on the CPU while the step (forward, backward, clipping, optimizer step)
runs under `torch.set_default_device("meta")`: a tensor the step makes without `device=` lands on
meta and the step fails at that place (on a GPU it would land on the CPU, the wrong device, or cost
a copy). Start-up (model building, loading, the data) runs as usual. Recipes: dsv4 (micro flavor),
the tiny llama, LoRA on the dsv4 base kept as released; each as configured and with loss.chunked +
full recomputation + activation_checkpoint.offload (the offload places tensors on two devices on
purpose). docs/design.md §3.12 says what this guards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import _tiny_llama
from tests.lora.test_lora_layouts import LORA
from tests.models.dsv4._release import write_micro_release
from tests.test_train_compose import config
from tests.test_train_long import LORA_COMMON
from tests.test_train_syncs import OPTIONS
from titan_thd.models.hf import quant
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
BLOCK = (16, 16)  # FP8 scale blocks of the micro release (tests/lora/test_resident.py)
RECIPES = ["dsv4", "llama", "lora-released"]


@pytest.fixture(scope="module")
def release(tmp_path_factory) -> Path:
    return write_micro_release(tmp_path_factory.mktemp("device") / "micro", BLOCK)


def _args(recipe: str, release: Path) -> tuple[str, list[str]]:
    if recipe == "lora-released":
        lora = ["--lora.enable", "true", *LORA["dsv4"], *LORA_COMMON]
        return "dsv4", [*lora, "--model.hf_path", str(release), "--lora.base_dtype", "released"]
    return recipe, []


@pytest.mark.parametrize("options", [False, True], ids=["as-configured", "chunked-offload"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_one_step_makes_no_tensor_on_the_default_device(tmp_path, release, recipe, options):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    _tiny_llama.register()
    model, extra = _args(recipe, release)
    extra += ["--checkpoint.enable", "false", *(OPTIONS * options)]
    trainer = Trainer(resolve_run(config(tmp_path / "run", model, 1, *extra)))
    try:
        assert trainer.dist.device.type == "cpu"
        batch = trainer.next_step_batch()
        # The FP8 / FP4 byte tables are cached per process and device: an earlier test's tables
        # would hide the ones this step makes.
        quant._TABLES.clear()
        previous = torch.get_default_device()
        torch.set_default_device("meta")
        try:
            assert torch.empty(1).device.type == "meta"  # the trap is set
            result = trainer.train_step(batch)
        finally:
            torch.set_default_device(previous)
    finally:
        trainer.close()
        torch.set_num_threads(threads)
    # the step ran on the CPU: real, finite numbers (a meta tensor has no value to read)
    assert all(torch.isfinite(torch.tensor(v)) for v in result.values()), result
    assert all(p.device.type == "cpu" for p in trainer.model.parameters())
