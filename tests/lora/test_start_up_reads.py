"""One LoRA start-up on a released-format base (tests/models/dsv4/_release.write_micro_release) reads
the Hugging Face folder once: `resolve_run` opens it (config.json read once, each safetensors header
parsed once, the fingerprint taken once from the headers as parsed), the `Run` carries it (`Run.hf`), and the load into the
allocated model (the trainer's `init_base`) reads that one folder. The model is built on the meta
device twice: once by start-up (the folder's plan, the adapters' targets and the packed-base plan are
all checked against it; the memory plan reads that one, `Run.meta_model`) and once as the model itself."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

import titan_thd.models.dsv4 as dsv4
from tests.lora.test_lora_layouts import COMMON, LORA
from tests.lora.test_resident import BLOCK, RELEASED
from tests.models.dsv4._release import write_micro_release
from tests.test_train_compose import config
from titan_thd.memory.plan import plan_memory
from titan_thd.models.hf import folder as hf_folder
from titan_thd.models.hf import io as hf_io
from titan_thd.models.hf.base import init_base
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.pipeline.runner import build
from titan_thd.startup import resolve_run

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def test_a_released_lora_start_up_reads_the_folder_once(tmp_path, monkeypatch):
    folder = write_micro_release(tmp_path / "micro", BLOCK)
    files = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(files) > 1  # several files and an index: each header counts
    reads: Counter[str] = Counter()

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            reads[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    meta_builds = []
    spec = dsv4.spec

    def build_model(args):
        meta_builds.append(torch.empty(()).device.type == "meta")
        return spec.build(args)

    monkeypatch.setattr(dsv4, "spec", dataclasses.replace(spec, build=build_model))
    monkeypatch.setattr(hf_folder, "read_json_object", counted("config.json", hf_folder.read_json_object))
    monkeypatch.setattr(hf_folder, "folder_fingerprint", counted("fingerprint", hf_folder.folder_fingerprint))
    # The fingerprint hashes the headers as parsed: it reads none again.
    monkeypatch.setattr(hf_io, "_data_offsets", counted("a header read again", hf_io._data_offsets))
    header = hf_io.SafetensorsFolder._header
    monkeypatch.setattr(
        hf_io.SafetensorsFolder, "_header", lambda self, f: (reads.update([f.name]), header(self, f))[1]
    )
    cfg = config(
        tmp_path / "run", "dsv4", 1, *LORA["dsv4"], *COMMON, "--model.hf_path", str(folder), *RELEASED
    )
    run = resolve_run(cfg)
    assert run.hf is not None and run.resident and run.settings["lora.base"]["fingerprint"]
    assert plan_memory(run, measure=False).ranks  # the trainer's plan, before it builds the model
    model = build_on_meta(run.build_model).to(run.precision.master)
    stats = {}
    build(model, run, torch.device("cpu"), init=lambda m: stats.update(load=init_base(m, run.hf, 7)))
    assert stats["load"].tensors > 0 and stats["load"].bytes_read > 0  # the base was read, as released
    assert reads == Counter({"config.json": 1, "fingerprint": 1, **dict.fromkeys(files, 1)}), reads
    assert meta_builds == [True, True], meta_builds  # start-up's, and the model's own
