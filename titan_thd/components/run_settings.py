"""What a run is: the settings that decide what is trained, against those that only decide how it is
computed (docs/design.md §3.11).

    settings = run_settings(cfg)                # {"optimizer.lr": 3e-4, ...}: stored in every checkpoint's
                                                # meta.json and in <dump_folder>/run.json
    check_resume(saved, settings, cfg.checkpoint.allow_changes, where)   # at load and in preflight
    check_run_folder(cfg, settings, checkpoints)   # before a new run writes into job.dump_folder

A resume whose run settings differ from its checkpoint's is refused with the changes (old -> new) and
the two ways on: the checkpoint's values, or `--checkpoint.allow_changes KEY,...`, which continues with
the new values and logs them. `FIXED` settings place the checkpoint's data position (the loader's
cursor), so they cannot change on a resume at all. Layout (parallel degrees, world size) and
`training.steps` (how far this invocation trains; the schedule length is compared on its own) are how
the run is computed: DCP reshards, and a changed value is one info line.
Which keys are which is a config fact: `RUN_KEYS`, `FIXED` and `HOW_MODEL_ARGS` live in
titan_thd/config/resume_keys.py, where the checks of checkpoint.allow_changes read them too.

A new run (nothing to resume) into a `job.dump_folder` whose metrics.jsonl holds records of a run with
other settings is refused (naming the folder and the flags); the same settings again (a rerun of the
same command, on any layout) replace that run's metrics and TensorBoard events, with a log line.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from titan_thd.config import Config
from titan_thd.config.resume_keys import FIXED, HOW_MODEL_ARGS, RUN_KEYS
from titan_thd.data.sources import ASSETS_DIR, resolve_data_path
from titan_thd.parallel.parallel_dims import ParallelDims

logger = logging.getLogger("titan_thd")

RUN_FILE = "run.json"
"""`<job.dump_folder>/run.json`: the run settings of the run whose metrics.jsonl is there."""
CONFIG_FILE = "config.toml"
"""`<job.dump_folder>/config.toml`: that run's merged config (config/render.py `to_toml`), the
default --config of scripts/convert_hf.py."""
BASE = "lora.base"
"""A LoRA run's frozen base, added by start-up (`base_setting`): {"folder": model.hf_path resolved,
"fingerprint": models/hf/io.py folder_fingerprint}, or None for a seeded base. Compared by fingerprint
alone: the same weights read from another folder (a copy, another mount) are the same base."""


def run_settings(cfg: Config) -> dict[str, Any]:
    """The run's settings as stored (JSON values): `lr_scheduler.total_steps` is the schedule's
    length (training.steps when 0), `data.path` the file the run reads (resolved, as the loader does)."""
    out: dict[str, Any] = {}
    for key in RUN_KEYS:
        section, name = key.split(".")
        out[key] = getattr(getattr(cfg, section), name)
    out["lr_scheduler.total_steps"] = cfg.lr_scheduler.total_steps or cfg.training.steps
    if cfg.data.path:
        try:
            out["data.path"] = str(resolve_data_path(cfg.data.path))
        except ValueError:  # reported by the data checks, with the paths tried
            pass
    if cfg.data.source != "mock":  # not read: no difference to report
        out["data.mock_config"] = out["data.num_samples"] = None
    for name, value in sorted(cfg.model.args.items()):
        if name not in HOW_MODEL_ARGS:
            out[f"model.args.{name}"] = value
    return json.loads(json.dumps(out))  # tuples -> lists, as read back


def base_setting(hf_path: str, fingerprint: str | None) -> dict[str, str] | None:
    """The `lora.base` setting of a LoRA run on `hf_path` (None: no model.hf_path, a seeded base)."""
    return {"folder": str(Path(hf_path).resolve()), "fingerprint": fingerprint} if hf_path else None


def _same(key: str, a: Any, b: Any) -> bool:
    if key == BASE and isinstance(a, dict) and isinstance(b, dict):
        return a.get("fingerprint") == b.get("fingerprint")
    return a == b


def run_layout(dims: ParallelDims, training_steps: int) -> dict[str, int]:
    """How the run is computed (stored beside the settings; a change is logged, never refused)."""
    return {
        "world": dims.world_size,
        "dp": dims.dp,
        "cp": dims.cp,
        "tp": dims.tp,
        "pp": dims.pp,
        "ep": dims.ep,
        "training.steps": training_steps,
    }


def changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{key: (saved, current)} of the keys whose values differ (a key missing on one side is None;
    `lora.base` only between two LoRA runs: lora.enable tells a LoRA run from a full one)."""
    return {
        k: (saved.get(k), current.get(k))
        for k in sorted(set(saved) | set(current))
        if not _same(k, saved.get(k), current.get(k)) and (k != BASE or (k in saved and k in current))
    }


def _value(v: Any, key: str = "") -> str:
    if key == BASE:
        if isinstance(v, dict):
            return f"{v.get('folder')} (fingerprint {v.get('fingerprint')})"
        return "none (no model.hf_path: the seeded model)" if v is None else json.dumps(v)
    return "unset" if v is None else json.dumps(v) if isinstance(v, (dict, list, str)) else str(v)


def _flag(key: str, saved: Any) -> str:
    """The flag that gives `key` the checkpoint's value (empty: none does)."""
    if key == BASE:
        return f"--model.hf_path {saved.get('folder')}" if isinstance(saved, dict) else "--model.hf_path ''"
    return "" if saved is None else f"--{key} {_value(saved)}"


def describe(diff: dict[str, tuple[Any, Any]]) -> str:
    """`optimizer.lr 0.0003 -> 0.001, ...` (the schedule length says what it is)."""
    length = " (the LR schedule's length; 0 = training.steps)"
    return ", ".join(
        f"{k}{length if k == 'lr_scheduler.total_steps' else ''} {_value(a, k)} -> {_value(b, k)}"
        for k, (a, b) in diff.items()
    )


def check_resume(
    saved: dict[str, Any] | None,
    current: dict[str, Any],
    allowed: tuple[str, ...],
    where: Path,
    saved_layout: dict[str, Any] | None = None,
    current_layout: dict[str, Any] | None = None,
) -> None:
    """ValueError when resuming checkpoint `where` would change the run without `allowed` naming each
    change; otherwise the changes, and those of the layout, are logged."""
    if saved is None:
        logger.warning(
            "checkpoint: %s records no run settings (saved before they were): resuming unchecked", where
        )
        return
    diff = changes(saved, current)
    fixed = {k: v for k, v in diff.items() if k in FIXED}
    if fixed:
        back = " ".join(_flag(k, a) for k, (a, _) in fixed.items())
        raise ValueError(
            f"checkpoint {where} was saved by a run with {describe(fixed)}: these place the checkpoint's data "
            f"position and cannot change on a resume; run with {back}, or start a new run in another "
            "--job.dump_folder"
        )
    refused = {k: v for k, v in diff.items() if k not in allowed}
    if refused:
        back = " ".join(f for f in (_flag(k, a) for k, (a, _) in refused.items()) if f)
        raise ValueError(
            f"checkpoint {where} was saved by a run with other settings: {describe(refused)}. Resuming would "
            f"change the run: pass --checkpoint.allow_changes {','.join(refused)} to continue with the new "
            f"values" + (f", or run with the checkpoint's ({back})" if back else "")
        )
    if diff:
        logger.warning(
            "checkpoint: resuming %s with changed settings (checkpoint.allow_changes): %s",
            where,
            describe(diff),
        )
    how = changes(saved_layout or {}, current_layout or {}) if saved_layout and current_layout else {}
    a, b = saved.get(BASE), current.get(BASE)
    if isinstance(a, dict) and isinstance(b, dict) and a.get("folder") != b.get("folder"):
        how[f"{BASE} folder"] = (a.get("folder"), b.get("folder"))  # the same fingerprint: a copy
    if how:
        logger.info(
            "checkpoint: resuming %s with another layout or length (how the run is computed, not what it "
            "trains; DCP reshards): %s",
            where,
            describe(how),
        )


def data_description(cfg: Config) -> str:
    """What the run trains on, for the log header: the file (resolved; the embedded dataset named as
    such) or the mock lengths."""
    if cfg.data.source == "mock":
        return f"mock lengths {json.dumps(cfg.data.mock_config)}"
    try:
        path = resolve_data_path(cfg.data.path)
    except ValueError:
        return cfg.data.path
    return (
        f"titan_thd/assets/{path.relative_to(ASSETS_DIR)} (embedded)"
        if path.is_relative_to(ASSETS_DIR)
        else str(path)
    )


# ============================================================================ run folder
def read_run_file(folder: Path) -> dict[str, Any] | None:
    """The settings in `folder/run.json` (None when absent or unreadable)."""
    try:
        data = json.loads((folder / RUN_FILE).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return data.get("settings") if isinstance(data, dict) else None


def _recorded_steps(path: Path) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def check_run_folder(cfg: Config, settings: dict[str, Any], checkpoints: list[int]) -> None:
    """ValueError when a new run would replace the metrics of another run in job.dump_folder
    (`checkpoints`: the complete checkpoint steps in its checkpoint folder; with checkpoint.enable the
    run resumes the newest, which appends); a rerun of the same settings, or metrics.overwrite, replaces them."""
    folder = Path(cfg.job.dump_folder)
    metrics = folder / "metrics.jsonl"
    resuming = cfg.checkpoint.enable and cfg.comm.mode != "fake" and bool(checkpoints)
    if resuming or not metrics.is_file() or _recorded_steps(metrics) == 0:
        return
    steps = _recorded_steps(metrics)
    if cfg.metrics.overwrite:
        logger.info("metrics: replacing %s (%d records; metrics.overwrite = true)", metrics, steps)
        return
    saved = read_run_file(folder)
    diff = None if saved is None else changes(saved, settings)
    if diff == {}:
        logger.info(
            "metrics: replacing %s (%d records) of an earlier run of the same settings", metrics, steps
        )
        return
    why = f"no {RUN_FILE}, so its settings are unknown" if diff is None else f"settings: {describe(diff)}"
    ckpt = folder / cfg.checkpoint.folder
    resume = (
        f", or --checkpoint.enable true to resume it from {ckpt / f'step-{checkpoints[-1]}'}"
        if checkpoints
        else ""
    )
    raise ValueError(
        f"job.dump_folder = {str(folder)!r} holds metrics.jsonl of another run ({steps} records; {why}): "
        f"choose another --job.dump_folder for this run, or pass --metrics.overwrite true to replace it{resume}"
    )


def write_run_file(folder: Path, settings: dict[str, Any], config: str | None = None) -> None:
    """Record the settings of the run that writes `folder/metrics.jsonl` (rank 0, at its first record),
    and its merged config (`config`, TOML) as `folder/config.toml`; each file replaced in one rename."""
    files = {RUN_FILE: json.dumps({"settings": settings}, indent=1) + "\n"}
    if config is not None:
        files[CONFIG_FILE] = config
    for name, text in files.items():
        tmp = folder / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(folder / name)
