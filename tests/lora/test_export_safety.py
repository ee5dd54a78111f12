"""Exports never destroy their input and ask for nothing the run recorded:
- the trainer saves its merged config as <job.dump_folder>/config.toml; `to-peft` / `to-hf RUN OUT`
  read it when --config is omitted, and a config without model.hf_path gets the base folder the
  LoRA checkpoint recorded (lora.base); that folder gone, or changed, is refused in one line;
- an output folder that is, contains or lies inside an input (base folder, run, step, source folder)
  is refused with exit code 2 before the run is opened, the input untouched;
- an export that fails halfway leaves the earlier output as it was, and no staging folder.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from tests.lora.test_lora_export import DSV4, convert, convert_hf, train
from tests.models.dsv4._util import build, micro
from titan_thd.config import load_config, to_toml
from titan_thd.data.tokenizer import ByteTokenizer
from titan_thd.models.dsv4 import export_hf


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """(base HF folder, LoRA run folder, a copy of the run's config without model.hf_path)."""
    root = tmp_path_factory.mktemp("export_safety")
    args = micro(vocab_size=320)
    base = export_hf(build(args, seed=1, dtype=torch.float32), args, root / "base", tokenizer=ByteTokenizer())
    config, _ = train(root / "run", *DSV4, "--model.hf_path", str(base), steps=1)
    text = config.read_text()
    assert f'hf_path = "{base}"' in text
    bare = root / "bare.toml"
    bare.write_text(text.replace(f'hf_path = "{base}"', 'hf_path = ""'))
    return base, root / "run", bare


def files_of(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir()) if p.is_file()}


def test_the_trainer_saves_its_config(lora_run):
    _, run, _ = lora_run
    saved = run / "config.toml"
    assert saved.is_file() and (run / "run.json").is_file()
    assert saved.read_text() == run.with_suffix(".toml").read_text()  # train(): to_toml of the run's cfg
    cfg = load_config(["--job.config_file", str(saved)])  # it loads back as the same config
    assert to_toml(cfg).replace(f'config_file = "{saved}"', 'config_file = ""') == saved.read_text()


def test_to_peft_and_to_hf_need_neither_config_nor_base(lora_run, tmp_path, capsys):
    base, run, bare = lora_run
    rc, _, err = convert(capsys, "to-peft", run, tmp_path / "peft")  # the run's saved config.toml
    assert rc == 0, err
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base)
    mask = os.umask(0)
    os.umask(mask)  # the files get the user's umask, not a temporary folder's 0700 / 0600
    assert (tmp_path / "peft").stat().st_mode & 0o777 == 0o777 & ~mask
    for f in (tmp_path / "peft").iterdir():
        assert f.stat().st_mode & 0o777 == 0o666 & ~mask, f
    rc, _, err = convert(capsys, "to-peft", run, tmp_path / "peft2", "--config", bare)  # no model.hf_path
    assert rc == 0, err
    config = json.loads((tmp_path / "peft2" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base.resolve())  # the recorded folder
    rc, out, err = convert(capsys, "to-hf", run, tmp_path / "merged", "--config", bare)
    assert rc == 0 and "base + the adapters of" in out, err
    rc, out, err = convert(capsys, "to-hf", run, tmp_path / "merged2")
    assert rc == 0 and "base + the adapters of" in out, err
    assert (tmp_path / "merged2" / "model.safetensors").read_bytes() == (
        tmp_path / "merged" / "model.safetensors"
    ).read_bytes()


def test_a_recorded_base_gone_or_changed_is_refused(lora_run, tmp_path, capsys):
    base, run, bare = lora_run
    away = base.with_name("base_away")
    base.rename(away)
    try:
        rc, _, err = convert(capsys, "to-peft", run, tmp_path / "a", "--config", bare)
    finally:
        away.rename(base)
    assert rc == 2 and err.count("\n") == 1 and "which is gone" in err, err
    shutil.copytree(base, away)
    try:
        first = next(p for p in sorted(base.glob("*.safetensors")))
        data = bytearray(first.read_bytes())
        data[-1] ^= 0xFF  # another tensor value: another fingerprint
        first.write_bytes(bytes(data))
        rc, _, err = convert(capsys, "to-peft", run, tmp_path / "b")
    finally:
        shutil.rmtree(base)
        away.rename(base)
    assert rc == 2 and err.count("\n") == 1 and "lora.base" in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_an_output_among_the_inputs_is_refused_before_anything_is_read(lora_run, monkeypatch, capsys):
    base, run, bare = lora_run

    def opened(*_a, **_k):
        raise AssertionError("the run was opened before the output was checked")

    monkeypatch.setattr(convert_hf, "resolve_run", opened)
    before, step = files_of(base), run / "checkpoint" / "step-1"
    cases = [
        (("to-hf", run, base, "--config", bare), "is the base folder"),
        (("to-peft", run, base / "adapters"), "lies inside the base folder"),
        (("to-hf", run, run / "hf"), "lies inside the run folder"),
        (("to-hf", step, step / "hf"), "lies inside the run folder"),
        (("to-hf", step, run), "contains the run folder"),
        (("to-dcp", base, base / "dcp"), "lies inside the source folder"),
        (("to-release", base, base), "is the source folder"),
        (("stack-experts", step, step), "is the checkpoint"),
        (("to-hf", step, step, "--flavor", "micro"), "is the DCP folder"),
    ]
    for (cmd, src, out, *rest), message in cases:
        rc, _, err = convert(capsys, cmd, src, out, *rest)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (cmd, err)
        assert message in err, (message, err)
    assert files_of(base) == before and not (base / "adapters").exists() and not (base / "dcp").exists()


def test_a_failing_export_leaves_the_old_output(lora_run, tmp_path, monkeypatch, capsys):
    _, run, _ = lora_run
    out = tmp_path / "merged"
    rc, _, err = convert(capsys, "to-hf", run, out, "--dtype", "float32")
    assert rc == 0, err
    before = files_of(out)
    from titan_thd.models.hf import write

    def full_disk(self, name, tensor):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(write.SafetensorsFile, "write", full_disk)
    with pytest.raises(OSError, match="No space left"):
        convert_hf.main([str(a) for a in ("to-hf", run, out, "--dtype", "bfloat16")])
    assert files_of(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]  # the staging folder removed
