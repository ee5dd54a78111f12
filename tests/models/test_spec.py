"""ModelSpec hooks are typed fields: a misspelt hook fails where the spec is built."""

import dataclasses

import pytest

from titan_thd.models import get_model_spec
from titan_thd.models.dsv4 import load_hf_into, update_router_bias
from titan_thd.models.dsv4.hf_interop import check_hf
from titan_thd.models.spec import ModelSpec


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
