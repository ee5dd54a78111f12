"""An export's output folder: refused when it overlaps an input, written whole or not at all."""

from __future__ import annotations

import os
import stat

import pytest

from titan_thd.models.hf.staging import refuse_overlap, staged


def test_refuse_overlap_names_the_relation_and_the_input(tmp_path):
    base, run = tmp_path / "base", tmp_path / "run"
    base.mkdir(), run.mkdir()
    cases = [
        (base, "is the base folder"),
        (base / "merged", "lies inside the base folder"),
        (tmp_path, "contains the base folder"),
        (run / "checkpoint" / "step-4" / "hf", "lies inside the run"),
    ]
    for out, words in cases:
        with pytest.raises(ValueError, match=words) as e:
            refuse_overlap(out, {"base folder": base, "run": run, "checkpoint": None})
        assert "\n" not in str(e.value) and str(out) in str(e.value)
    refuse_overlap(tmp_path / "out", {"base folder": base, "run": run})  # a sibling is fine
    refuse_overlap(tmp_path / "base2", {"base folder": base})  # a prefix of the name is not a parent


def test_a_failed_export_leaves_the_old_output_and_no_partial_folder(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"old")
    with pytest.raises(RuntimeError, match="disk full"), staged(out) as tmp:
        (tmp / "model-00001-of-00002.safetensors").write_bytes(b"new")
        raise RuntimeError("disk full")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"old"


def test_success_replaces_the_old_shards_and_keeps_other_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    for name in ("model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"):
        (out / name).write_bytes(b"old")
    (out / "model.safetensors.index.json").write_text("{}")
    (out / "README.md").write_text("mine")
    (out / "config.json").write_text("old")
    with staged(out) as tmp:
        (tmp / "model.safetensors").write_bytes(b"new")
        (tmp / "config.json").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (out / "config.json").read_text() == "new" and (out / "README.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_new_output_gets_the_users_umask(tmp_path):
    old = os.umask(0o022)
    try:
        with staged(tmp_path / "new" / "out") as tmp:
            (tmp / "adapter_config.json").write_text("{}")
    finally:
        os.umask(old)
    out = tmp_path / "new" / "out"
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert stat.S_IMODE((out / "adapter_config.json").stat().st_mode) == 0o644


def test_a_file_in_the_way_is_refused(tmp_path):
    (tmp_path / "out").write_text("x")
    with pytest.raises(ValueError, match="not a folder"), staged(tmp_path / "out"):
        pass
