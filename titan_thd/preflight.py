"""What a run reads and writes outside the config, checked before it starts (its folders are start-up's:
titan_thd/startup.py `check_folders`): the outputs of another run it would replace (by the Trainer), and, with
--job.preflight (run by run_train.sh before torchrun), every input its ranks would read before their
first step, read here in one process so that an input error is one line and not torchrun's failure
report.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from titan_thd.components import run_settings
from titan_thd.components.checkpoint import CheckpointManager
from titan_thd.components.checkpoint_folder import checkpoint_steps, model_fingerprint
from titan_thd.config import Config
from titan_thd.data.dataloader import OrderedSteps, build_dataloader
from titan_thd.data.stores import build_stores
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.run import Run

logger = logging.getLogger("titan_thd")


def check_outputs(cfg: Config, settings: dict[str, Any]) -> None:
    """ValueError when a new run would replace another run's metrics in job.dump_folder
    (components/run_settings.py check_run_folder)."""
    checkpoints = checkpoint_steps(Path(cfg.job.dump_folder) / cfg.checkpoint.folder)
    run_settings.check_run_folder(cfg, settings, checkpoints)


def preflight(run: Run) -> None:
    """Read what the ranks of `run` (resolved for NGPU processes) would read before their first step, in
    this one process and without a process group: the tokenizer, the data (tokenised into the cache
    that the run then reuses), the checkpoint to resume (its model and settings, as the trainer's
    resume checks them) and the run folder's outputs."""
    cfg = run.cfg
    layout = run.layout(dp_rank=0)
    store = None
    if cfg.data.source != "packed":
        store, val_store = build_stores(
            cfg.data, cfg.validation, run.tokenizer, cfg.training.seed, run.cache_dir, progress=True
        )
        if val_store is not None:
            OrderedSteps(
                val_store.view(layout.T, cfg.data.overlong), layout, pad_to_multiple=run.pad_to_multiple
            )
    build_dataloader(dataclasses.replace(cfg.data, num_workers=0), store, layout, run.tokenizer)
    if cfg.checkpoint.enable:  # the fingerprint has global shapes: a model on the meta device has them
        model = build_on_meta(run.build_model)
        CheckpointManager(
            cfg.checkpoint,
            cfg.job.dump_folder,
            model=model,  # the model entries alone: no optimizer, data or schedule state
            fingerprint=model_fingerprint([model], model=cfg.model.name, flavor=run.flavor),
            settings=run.settings,
            layout=run_settings.run_layout(run.dims, cfg.training.steps),
        ).check_resumable()
    check_outputs(cfg, run.settings)
    logger.info("preflight: inputs of a %d-process run are fine", run.dims.world_size)
