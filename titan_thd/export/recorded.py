"""What a run already recorded, so that an export of its checkpoint asks for nothing twice, and its
output folder checked against every input before the run is opened (scripts/convert_hf.py to-hf /
to-peft of a run):

    argv = run_argv(src, out, config=None, overrides=[])   # config: --config's argv (inference/loading.py)

- the config: --config when given, else the run's own, `<job.dump_folder>/config.toml`, which the
  trainer writes beside run.json (components/run_settings.py `CONFIG_FILE`);
- the base: a LoRA checkpoint's meta.json holds its `lora.base` setting (the base folder and its
  fingerprint); a config without model.hf_path gets that folder. A recorded folder that is gone is
  refused here; one whose files changed is refused by export/checkpoint.py (another fingerprint).

Only the config's TOML and the checkpoint's meta.json are read before `refuse_overlap` has checked
the output against the run folder, the step folder and the base folder (models/hf/staging.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_thd.components.checkpoint_folder import META_FILE, resolve_step_dir
from titan_thd.components.run_settings import BASE, CONFIG_FILE
from titan_thd.config import load_config
from titan_thd.models.hf.staging import refuse_overlap


def saved_config(src: Path) -> Path:
    """The config.toml the trainer saved for the run whose checkpoint `src` names (a run folder, its
    checkpoint folder or a step folder); ValueError naming what to give otherwise."""
    src = Path(src)
    try:
        step_dir = resolve_step_dir(src)
    except ValueError:  # not a checkpoint of the default layout (or a DCP folder): only src itself
        step_dir = None
    for folder in (src, *(step_dir.parents[:2] if step_dir else ())):  # RUN/checkpoint/step-N
        if (folder / CONFIG_FILE).is_file():
            return folder / CONFIG_FILE
    raise ValueError(
        f"{src}: no {CONFIG_FILE} of its run beside it (the trainer saves <job.dump_folder>/{CONFIG_FILE}; "
        "older runs have none): give the run's TOML with --config, or for a DCP folder --flavor or --hf-config"
    )


def recorded_base(step_dir: Path) -> str | None:
    """The base folder a LoRA checkpoint recorded (meta.json settings' lora.base; None: a seeded base,
    a full fine-tuning run, or a checkpoint without settings)."""
    try:
        meta = json.loads((step_dir / META_FILE).read_text())
    except (OSError, ValueError):
        return None  # export/checkpoint.py names what is missing or damaged
    base = (meta.get("settings") or {}).get(BASE)
    return base.get("folder") if isinstance(base, dict) else None


def run_argv(src: Path, out: Path, config: list[str] | None, overrides: list[str]) -> list[str]:
    """The trainer's argv of the run whose checkpoint `src` names: `config` (--config's argv, or else
    the run's saved config.toml) + `overrides`, and model.hf_path the recorded base when the config
    has none; after `out` is refused in one line if it is, contains or lies inside the run, the step
    or the base."""
    refuse_overlap(out, {"run folder": src})  # before anything of the run is read
    argv = (config or ["--job.config_file", str(saved_config(src))]) + overrides
    cfg = load_config(argv)  # the TOML alone: nothing of the run is opened
    step_dir = resolve_step_dir(src, cfg.checkpoint.folder)
    recorded = recorded_base(step_dir)
    if recorded is not None and not cfg.model.hf_path:
        argv, base = [*argv, "--model.hf_path", recorded], recorded
    else:
        base = cfg.model.hf_path or None
    if recorded is not None and base and Path(base).resolve() == Path(recorded) and not Path(base).is_dir():
        raise ValueError(
            f"{step_dir} was trained on the base folder {recorded} (its lora.base), which is gone: give "
            "--model.hf_path a copy of that folder"
        )
    refuse_overlap(out, {"run folder": src, "checkpoint": step_dir, "base folder": base})
    return argv
