"""ModelSpec hooks are typed fields: a misspelt hook fails where the spec is built; the guide to adding a
model lists exactly the spec's fields; no code outside a model's package names the model."""

import dataclasses
import re
from pathlib import Path

import pytest

from titan_thd.models import get_model_spec
from titan_thd.models.dsv4 import load_hf_into, update_router_bias
from titan_thd.models.dsv4.hf_interop import check_hf
from titan_thd.models.spec import ModelSpec, PipelineSpec


def test_misspelt_hook_is_a_type_error():
    with pytest.raises(TypeError, match="after_optimizer_stp"):
        ModelSpec(
            name="toy",
            flavors={},
            build=None,
            flops_per_step=None,
            cp_mode="zigzag",
            after_optimizer_stp=print,
        )
    with pytest.raises(TypeError, match="hooks"):  # the old string-keyed dict is gone
        ModelSpec(name="toy", flavors={}, build=None, flops_per_step=None, cp_mode="zigzag", hooks={})


def test_specs_hooks():
    llama, dsv4 = get_model_spec("llama"), get_model_spec("dsv4")
    assert llama.init_from_hf is None and llama.check_hf is None and llama.after_optimizer_step is None
    assert dsv4.init_from_hf is load_hf_into and dsv4.check_hf is check_hf
    assert dsv4.after_optimizer_step is update_router_bias
    with pytest.raises(dataclasses.FrozenInstanceError):
        llama.after_optimizer_step = update_router_bias


def _table_fields(text: str, heading: str) -> list[str]:
    """The backquoted names in the first column of the table under `heading` (up to the next heading)."""
    section = text.split(heading, 1)[1].split("\n#", 1)[0]
    names = []
    for line in section.splitlines():
        cells = line.split("|")
        if len(cells) > 2 and cells[1].strip().startswith("`"):
            names.append(re.match(r"`(\w+)", cells[1].strip()).group(1))
    return names


def test_the_guide_lists_exactly_the_spec_fields():
    """docs/adding_a_model.md's tables list every field of ModelSpec and PipelineSpec, in order, and
    nothing else: a field added to the spec without a line in the guide fails here."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "adding_a_model.md").read_text()
    assert _table_fields(text, "## 2. What a ModelSpec holds") == [
        f.name for f in dataclasses.fields(ModelSpec)
    ]
    assert _table_fields(text, "### PipelineSpec") == [f.name for f in dataclasses.fields(PipelineSpec)]


def test_no_model_is_named_outside_its_package():
    """The trainer, data, parallel and pipeline code never tests for a model by name (the spec says it all)."""
    root = Path(__file__).resolve().parents[2] / "titan_thd"
    offenders = []
    for path in root.rglob("*.py"):
        if "models" in path.relative_to(root).parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(
                r"""==\s*["'](llama|dsv4)["']|["'](llama|dsv4)["']\s*(==|in\b)|\b_FIRST\b|\b_LAST\b""", line
            ):
                offenders.append(f"{path.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
