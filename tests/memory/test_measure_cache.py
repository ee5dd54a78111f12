"""How the activation measurement (memory/activations.py) spends its time: the forwards it runs are
the ones `lengths_measured` plans (the progress count and ETA rest on it), and a measurement on
narrowed copies is kept on disk per model shape (memory/cache.py) and read back exactly
(docs/results.md §14)."""

import dataclasses
import functools
import logging

import pytest
import torch

from titan_thd.config import ActivationCheckpoint
from titan_thd.lora.targets import resolve_lora
from titan_thd.memory import activations, cache
from titan_thd.models import get_model_spec

AC = {
    "none": ActivationCheckpoint(mode="none"),
    "full": ActivationCheckpoint(mode="full"),
    "full first 1": ActivationCheckpoint(mode="full", layers=1),
    "selective 2 regions": ActivationCheckpoint(mode="selective", regions=("moe_act", "mhc")),
    "selective 1 region": ActivationCheckpoint(mode="selective", regions=("mhc",)),
}


@pytest.fixture
def micro():
    spec = get_model_spec("dsv4")
    return spec, dataclasses.replace(spec.flavors["micro"], vocab_size=128)


@pytest.mark.parametrize("mode", list(AC))
@pytest.mark.parametrize(("tokens", "narrow"), [(4096, False), (1024, False), (4096, True)])
def test_the_forwards_measured_are_the_planned_ones(monkeypatch, micro, mode, tokens, narrow):
    spec, args = micro
    seen: list[int] = []

    def measure(spec, args, tokens, dtype, prepare=None, loss_chunk=0):
        seen.append(tokens)
        return activations.SavedBytes(dict.fromkeys(map(str, range(args.n_layers)), 1.0), 1.0, 1.0)

    monkeypatch.setattr(activations, "measure", measure)
    monkeypatch.setattr(activations, "_MEASURED", {})
    monkeypatch.setenv("TITAN_THD_CACHE", "off")
    if narrow:
        monkeypatch.setattr(activations, "MAX_MEASURED_PARAMS", 0)
    got = activations.activation_memory(spec, args, tokens, torch.float32, AC[mode])
    assert got is not None  # (_activation_memory asserts that the progress count is the plan's)
    planned = activations.lengths_measured(tokens, AC[mode])
    assert seen == ([n for n in planned for _ in (0, 1)] if narrow else planned)


def test_a_narrowed_measurement_is_read_back_exactly(monkeypatch, micro, tmp_path, caplog):
    spec, args = micro
    monkeypatch.setenv("TITAN_THD_CACHE", str(tmp_path))
    monkeypatch.setattr(activations, "MAX_MEASURED_PARAMS", 0)  # measured on narrowed copies
    monkeypatch.setattr(activations, "_MEASURED", {})
    ac = AC["full"]
    with caplog.at_level(logging.INFO, logger="titan_thd"):
        measured = activations.activation_memory(spec, args, 256, torch.float32, ac)
    assert "on narrowed copies (widths / 4 and / 2): 0/4 forwards" in caplog.text  # announced
    assert len(list((tmp_path / "activations").glob("*.json"))) == 1

    def no_measure(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(activations, "measure", no_measure)
    monkeypatch.setattr(activations, "_MEASURED", {})  # a new process
    assert activations.activation_memory(spec, args, 256, torch.float32, ac) == measured
    # Another length, or another source of the package, is another measurement.
    monkeypatch.setattr(activations, "_MEASURED", {})
    with pytest.raises(AssertionError, match="measured again"):
        activations.activation_memory(spec, args, 128, torch.float32, ac)
    monkeypatch.setattr(cache, "source_fingerprint", lambda: "edited")
    with pytest.raises(AssertionError, match="measured again"):
        activations.activation_memory(spec, args, 256, torch.float32, ac)


def test_a_measurement_at_full_width_is_not_stored(monkeypatch, micro, tmp_path):
    spec, args = micro
    monkeypatch.setenv("TITAN_THD_CACHE", str(tmp_path))
    monkeypatch.setattr(activations, "_MEASURED", {})
    activations.activation_memory(spec, args, 128, torch.float32, AC["none"])
    assert not (tmp_path / "activations").exists()


def test_a_lora_run_is_measured_with_its_adapters_and_narrows_exactly(micro):
    """A frozen projection saves no input for its weight's gradient; its adapter's A saves the same
    input once and B saves [T, rank], which no width changes: the narrowed copies still extrapolate
    to the direct measurement exactly (the first layer of each kind and the parts around the layers)."""
    spec, args = micro
    with torch.device("meta"):
        meta = spec.build(args)
    targets = ("attention", "shared_expert", "experts")
    lora = resolve_lora(targets, 2, 4.0, False, spec.lora, meta, "dsv4/micro")
    adapted = dataclasses.replace(spec, build=functools.partial(activations._with_adapters, spec.build, lora))
    tokens = 128
    direct = activations.measure(adapted, args, tokens, torch.float32)
    base = activations.measure(spec, args, tokens, torch.float32)
    every = list(direct.layers)
    assert direct.of(every, True, True) < base.of(every, True, True)
    (a_args, kind_of), (b_args, _) = activations.narrowed(spec, args, 4), activations.narrowed(spec, args, 2)
    a = activations.measure(adapted, a_args, tokens, torch.float32)
    b = activations.measure(adapted, b_args, tokens, torch.float32)
    full = activations.extrapolate(a, b, 4)
    assert (full.before, full.after) == (direct.before, direct.after)
    for k, i in {k: i for i, k in reversed(list(enumerate(kind_of)))}.items():
        assert full.layers[str(k)] == direct.layers[str(i)], (k, i)
