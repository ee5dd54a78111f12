"""Checkpoints with torch.distributed.checkpoint (DCP): atomic, resumable across layouts.

Folder layout, `<job.dump_folder>/<checkpoint.folder>/`:

    step-40/              a complete checkpoint: DCP shards (`__<rank>_0.distcp`), `.metadata`,
                          and `meta.json` (step, world size, model fingerprint, file checksums,
                          the run settings and layout: components/run_settings.py)
    step-60.tmp-<tag>/    a save in progress, or one a crash interrupted; never loaded

What one checkpoint holds (top-level keys of the DCP state dict):

| key            | content                                              | across layouts          |
|----------------|------------------------------------------------------|-------------------------|
| `model`        | get_model_state_dict of the rank's module (DTensors) | resharded by DCP        |
| `optimizer`    | the optimizer container's state (flattened to FQNs)  | resharded by DCP        |
| `lr_scheduler` | `{"0": state_dict, ...}` one per scheduler, one leaf | identical on all ranks  |
| `<states key>` | `states[key].state_dict()` (train state, data), one leaf | layout-free by contract |
| `rng`          | `{"rank_<r>": torch CPU (and CUDA) generator state}` | restored only when the  |
|                |                                                      | world size is unchanged |

Atomicity: every rank writes into `step-N.tmp-<tag>`; after DCP's final collective (the
metadata is written), each rank's checksums and rank 0's `meta.json`, rank 0 renames the folder
to `step-N`. A rename is atomic, so a crash at any moment leaves either the old set of complete
checkpoints or the new one.

Integrity: `meta.json` lists every other file of the checkpoint with its size and CRC-32 (each
rank checksums the shards it wrote, from the page cache; measured on this repo's 2-core CPU box,
CRC-32 reads 2.1 GB/s per core idle and 0.5-0.8 GB/s loaded: +0.04-0.16 s on a 76 MB save of
0.35-0.7 s, and as much on a load). Loading verifies them first (the ranks share the files) and
a mismatch, a missing file or an unreadable `meta.json` raises a ValueError that names the
checkpoint folder and the file. A damaged checkpoint is never deleted, never skipped and never
replaced by a fresh start: the run stops, and the message says to move the folder away to resume
from the complete checkpoint before it (moving keeps it for inspection; `checkpoint.load_step`
would resume too, but re-saving that step later replaces the damaged folder).

Failures while saving (a full disk, an I/O error on any rank) raise `CheckpointError` on every
rank with the checkpoint path and the error (`[Errno 28] No space left on device: ...`): the
`.tmp` folder is removed (it never becomes `step-N`) and the complete checkpoints stay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
import warnings
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)

from titan_thd.components.checkpoint_folder import (
    META_FILE,
    PER_EXPERT_PARAM,
    RESERVED_KEYS,
    SHARD_FILE,
    STEP_DIR,
    TMP_DIR,
    check_contents,
    checkpoint_steps,
    crc32,
    fingerprint_differences,
    fsync_dir,
)
from titan_thd.components.run_settings import check_resume
from titan_thd.config import Checkpoint
from titan_thd.parallel import distributed

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A save failed (e.g. a full disk); raised on every rank, the complete checkpoints are kept."""


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@contextlib.contextmanager
def _single_process_is_fine() -> Iterator[None]:
    """DCP warns on every call without a process group; one process is a supported layout here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _describe(e: BaseException) -> str:
    """One line per failing rank; DCP wraps each rank's exception in a CheckpointException."""
    if isinstance(e, CheckpointException):
        return "; ".join(f"rank {rank}: {_describe(exc)}" for rank, (exc, _) in sorted(e.failures.items()))
    return str(e) if isinstance(e, OSError) and e.errno else f"{type(e).__name__}: {e}"


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])


# ============================================================================ manager
class CheckpointManager:
    """Save / resume model, optimizer, LR schedulers, extra `states`, and RNG with DCP.

    `optimizer` is a Stateful whose state is keyed by parameter FQN (the trainer's
    OptimizersContainer); left out with `lr_schedulers` and `states`: the model entries alone (the
    preflight's resume check, `read_model`). `states` maps a key to any object with
    `state_dict()` / `load_state_dict()` whose state is the same on every rank (train state,
    the layout-free data state). `fingerprint` (see `model_fingerprint`) is stored and compared
    on load so a checkpoint of another model fails with the list of differences. `settings` and
    `layout` (components/run_settings.py) are stored too; a resume whose settings differ is refused
    unless checkpoint.allow_changes names every change.
    """

    def __init__(
        self,
        cfg: Checkpoint,
        dump_folder: str,
        *,
        model: nn.Module,
        fingerprint: dict[str, Any],
        optimizer: Stateful | None = None,
        lr_schedulers: Any = (),
        states: dict[str, Stateful] | None = None,
        settings: dict[str, Any] | None = None,
        layout: dict[str, Any] | None = None,
        model_keys: Collection[str] | None = None,
    ) -> None:
        """`model_keys`: the model entries saved and loaded (None: all; a LoRA run: its adapters)."""
        states = states or {}
        clash = sorted(set(states) & set(RESERVED_KEYS))
        assert not clash, f"states keys {clash} collide with the checkpoint's own keys {RESERVED_KEYS}"
        self.cfg = cfg
        self.folder = Path(dump_folder) / cfg.folder
        self.model, self.optimizer = model, optimizer
        self.lr_schedulers = (
            list(lr_schedulers) if isinstance(lr_schedulers, (list, tuple)) else [lr_schedulers]
        )
        self.states = dict(states)
        self.fingerprint = json.loads(json.dumps(fingerprint))  # tuples -> lists, as stored
        self.settings, self.layout, self.model_keys = settings, layout, model_keys
        self.enabled = cfg.enable and not distributed.is_fake()
        if cfg.enable and not self.enabled:
            logger.warning("checkpoint: disabled in a fake-process-group dry run (DCP needs real processes)")
        self._last_saved = -1

    # ------------------------------------------------------------------ folder
    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints (folders named exactly step-<N>), ascending."""
        return checkpoint_steps(self.folder)

    def _leftovers(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        return sorted(p for p in self.folder.iterdir() if p.is_dir() and TMP_DIR.match(p.name))

    # ------------------------------------------------------------------ state
    def _state_dict(self) -> dict[str, Any]:
        model = get_model_state_dict(self.model)
        keys = model.keys() if self.model_keys is None else self.model_keys
        sd: dict[str, Any] = {
            "model": {k: v for k, v in model.items() if k in keys},
            "optimizer": {} if self.optimizer is None else self.optimizer.state_dict(),
        }
        # Small replicated Python state is stored whole: DCP treats a tuple as one leaf and on load
        # replaces it with what was saved, so the loading side needs no template of its keys.
        sd["lr_scheduler"] = ({str(i): s.state_dict() for i, s in enumerate(self.lr_schedulers)},)
        for key, obj in self.states.items():
            sd[key] = (obj.state_dict(),)
        sd["rng"] = {f"rank_{distributed.rank()}": _rng_state()}
        return sd

    # ------------------------------------------------------------------ save
    def save(self, step: int, force: bool = False) -> None:
        """Save at multiples of `checkpoint.interval`, or now when `force` (final step, a stop signal)."""
        if not self.enabled or step == self._last_saved or (not force and step % self.cfg.interval):
            return
        start = time.perf_counter()
        main = distributed.rank() == 0
        tag = distributed.broadcast_object(f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        tmp = self.folder / f"step-{step}.tmp-{tag}"
        if main:  # other ranks may already have created `tmp`: it is not a leftover
            for old in (p for p in self._leftovers() if p != tmp):
                logger.warning("checkpoint: removing %s, left by an interrupted save", old)
                shutil.rmtree(old, ignore_errors=True)
        # Each phase ends with every rank knowing whether any rank failed, so a failure on one
        # rank stops all of them at the same point instead of leaving the others in a collective.
        error = None
        try:
            with _single_process_is_fine():  # DCP creates `tmp` and gathers every rank's failure
                dcp.save(self._state_dict(), storage_writer=dcp.FileSystemWriter(tmp))
        except (OSError, CheckpointException) as e:
            error = _describe(e)
        files: dict[str, list[int]] = {}
        if error is None:
            try:
                local = (self._checksums(tmp), None)
            except OSError as e:
                local = ({}, f"rank {distributed.rank()}: {e}")
            for part, err in distributed.all_gather_object(local):
                files.update(part)
                error = error or err
        if error is None and main:
            try:
                self._write_meta(tmp, step, files)
                self._publish(tmp, step)
            except OSError as e:
                error = f"rank 0: {e}"
        error = distributed.broadcast_object(error)  # also: no rank returns before the rename
        if error is not None:
            if main:  # every rank is past its writes: the partial folder only takes space
                shutil.rmtree(tmp, ignore_errors=True)
            kept = self.complete_steps()
            with contextlib.suppress(OSError):  # the cause when a serializer hides the errno
                error += f" ({shutil.disk_usage(self.folder).free / 1e9:.2f} GB free there)"
            raise CheckpointError(
                f"checkpoint: saving step {step} to {self.step_dir(step)} failed: {error}. "
                + (
                    f"The complete checkpoints are kept (newest: {self.step_dir(kept[-1])})"
                    if kept
                    else "There is no complete checkpoint yet"
                )
            )
        if main:
            self._purge(keep=step)
        self._last_saved = step
        if main:
            size = sum(f.stat().st_size for f in self.step_dir(step).iterdir())
            logger.info(
                "checkpoint: saved step %d to %s (%.1f MB) in %.2f s",
                step,
                self.step_dir(step),
                size / 1e6,
                time.perf_counter() - start,
            )

    def _checksums(self, tmp: Path) -> dict[str, list[int]]:
        """[size, CRC-32] of the files this rank wrote (rank 0: also DCP's .metadata)."""
        me = distributed.rank()
        out = {}
        for f in sorted(tmp.iterdir()):
            m = SHARD_FILE.match(f.name)
            if f.is_file() and f.name != META_FILE and (int(m.group(1)) == me if m else me == 0):
                out[f.name] = [f.stat().st_size, crc32(f)]
        return out

    def _write_meta(self, tmp: Path, step: int, files: dict[str, list[int]]) -> None:
        on_disk = sorted(f.name for f in tmp.iterdir() if f.name != META_FILE)
        assert on_disk == sorted(files), (on_disk, sorted(files))  # every file has one owner
        meta = {
            "step": step,
            "world_size": distributed.world_size(),
            "fingerprint": self.fingerprint,
            "settings": self.settings,
            "layout": self.layout,
            "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "files": dict(sorted(files.items())),
        }
        with open(tmp / META_FILE, "w") as f:
            json.dump(meta, f)
            f.flush()
            os.fsync(f.fileno())

    def _publish(self, tmp: Path, step: int) -> None:
        final = self.step_dir(step)
        stale = None
        if final.exists():  # re-saving a step (a run resumed from an earlier checkpoint)
            stale = self.folder / f"step-{step}.tmp-replaced-{os.getpid()}"
            os.rename(final, stale)
        os.rename(tmp, final)
        fsync_dir(self.folder)
        if stale is not None:
            shutil.rmtree(stale, ignore_errors=True)

    def _purge(self, keep: int) -> None:
        if self.cfg.keep_latest_k <= 0:
            return
        others = [s for s in self.complete_steps() if s != keep]
        for step in others[: max(0, len(others) - (self.cfg.keep_latest_k - 1))]:
            logger.info("checkpoint: deleting step-%d (keep_latest_k = %d)", step, self.cfg.keep_latest_k)
            shutil.rmtree(self.step_dir(step), ignore_errors=True)

    # ------------------------------------------------------------------ load
    def _resume_step(self) -> int | None:
        steps = self.complete_steps()
        for old in self._leftovers():
            logger.warning("checkpoint: ignoring incomplete %s (an interrupted save)", old)
        want = self.cfg.load_step  # >= -1 (config.validate)
        if want >= 0 and want not in steps:
            raise ValueError(
                f"checkpoint.load_step = {want}: there is no complete checkpoint {self.step_dir(want)}; "
                f"steps found in {self.folder}: {', '.join(map(str, steps)) or 'none'}"
            )
        if want >= 0:
            return want
        return steps[-1] if steps else None

    def _read_meta(self, path: Path) -> dict[str, Any]:
        """meta.json of a checkpoint, after checking that it was saved from this model."""
        try:
            meta = json.loads((path / META_FILE).read_text())
        except FileNotFoundError:
            raise ValueError(
                f"checkpoint {path}: {META_FILE} is missing (damaged, or not written by titan_thd)"
                + self._earlier(path)
            ) from None
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(
                f"checkpoint {path} is damaged: {path / META_FILE} is not valid JSON (invalid JSON: {e}){self._earlier(path)}"
            ) from None
        if not isinstance(meta, dict) or not {"step", "world_size", "fingerprint"} <= set(meta):
            raise ValueError(
                f"checkpoint {path} is damaged: {META_FILE} lacks its fields{self._earlier(path)}"
            )
        diffs = fingerprint_differences(meta["fingerprint"], self.fingerprint)
        if diffs and any(PER_EXPERT_PARAM.search(n) for n in meta["fingerprint"].get("params", {})):
            raise ValueError(
                f"checkpoint {path} holds one tensor per routed expert (`...ffn.experts.<e>.w1.weight`): it "
                "was written before the experts were stacked ([E, out, in] per layer). Convert it once with "
                f"`scripts/convert_hf.py stack-experts {path} NEW_FOLDER/step-{meta['step']}` (model, optimizer "
                "and the rest of the state) and resume from NEW_FOLDER with --checkpoint.folder"
            )
        if diffs:
            raise ValueError(f"checkpoint {path} was saved from another model:\n  " + "\n  ".join(diffs))
        if self.settings is not None:
            check_resume(
                meta.get("settings"),
                self.settings,
                self.cfg.allow_changes,
                path,
                meta.get("layout"),
                self.layout,
            )
        return meta

    def _earlier(self, path: Path) -> str:
        """What the user can do about the damaged checkpoint `path` (which stays as it is)."""
        step = int(STEP_DIR.match(path.name).group(1))
        earlier = [s for s in self.complete_steps() if s < step]
        where = f"resume from {self.step_dir(earlier[-1])}" if earlier else "start afresh"
        return f". The folder is left as it is: move it away (e.g. to {path.name}.damaged) to {where}"

    def _verify_files(self, path: Path, meta: dict[str, Any]) -> None:
        """ValueError naming the first file whose size or CRC-32 differs from meta.json's list."""
        files = sorted(meta.get("files", {}).items())
        if not files:  # saved before checksums were recorded
            logger.warning("checkpoint: %s has no file checksums in %s: not verified", path, META_FILE)
            return
        problems = []
        for name, (size, crc) in files[distributed.rank() :: distributed.world_size()]:
            f = path / name
            if not f.is_file():
                problems.append(f"{f} is missing")
            elif f.stat().st_size != size:
                problems.append(f"{f} has {f.stat().st_size} bytes, {size} when saved")
            elif crc32(f) != crc:
                problems.append(f"{f} has other contents than when saved (CRC-32 mismatch)")
        problems = sorted(p for part in distributed.all_gather_object(problems) for p in part)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise ValueError(f"checkpoint {path} is damaged: {problems[0]}{more}{self._earlier(path)}")

    def check_resumable(self) -> None:
        """ValueError now when `load()` would refuse its checkpoint: checkpoint.load_step not saved, the
        checkpoint saved from another model or by a run with other settings (a preflight, without loading
        anything)."""
        step = self._resume_step() if self.enabled else None
        if step is not None:
            self._read_meta(self.step_dir(step))

    def load(self) -> int:
        """Restore the newest complete checkpoint (or `checkpoint.load_step`); the step, 0 if none."""
        if not self.enabled:
            return 0
        step = self._resume_step()
        if step is None:
            logger.info("checkpoint: nothing to resume in %s; starting from step 0", self.folder)
            return 0
        start = time.perf_counter()
        path = self.step_dir(step)
        meta = self._read_meta(path)
        self._verify_files(path, meta)
        sd = self._state_dict()
        if meta["world_size"] != distributed.world_size():
            # RNG streams are per rank; a different world has different ranks.
            logger.warning(
                "checkpoint: saved on %d ranks, running on %d: RNG state not restored",
                meta["world_size"],
                distributed.world_size(),
            )
            del sd["rng"]
        check_contents(path, sd)
        with _single_process_is_fine():
            dcp.load(sd, checkpoint_id=path)
        set_model_state_dict(self.model, sd["model"], options=StateDictOptions(strict=False))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(sd["optimizer"])
        for i, scheduler in enumerate(self.lr_schedulers):
            scheduler.load_state_dict(sd["lr_scheduler"][0][str(i)])
        for key, obj in self.states.items():
            obj.load_state_dict(sd[key][0])
        if "rng" in sd:
            _set_rng_state(sd["rng"][f"rank_{distributed.rank()}"])
        self._last_saved = step
        logger.info("checkpoint: resumed from %s in %.2f s", path, time.perf_counter() - start)
        return step


def read_model(
    model: nn.Module, step_dir: Path, fingerprint: dict[str, Any], *, load: bool = True, keys: Collection = ()
) -> None:
    """The model entries of the trainer checkpoint `step_dir` (RUN/checkpoint/step-N) read into `model`
    (`keys`: only those, e.g. a LoRA run's adapters; empty: all); its optimizer, data and schedule
    state stay on disk. ValueError first when it was saved from another model (each difference from
    `fingerprint` named) or its files fail their CRC-32s. `load=False`: the check alone, nothing read."""
    step = STEP_DIR.match(step_dir.name)
    if step is None or not (step_dir / META_FILE).is_file():
        raise ValueError(
            f"--checkpoint {step_dir}: no meta.json, so not a complete titan_thd trainer checkpoint (a folder "
            "written by scripts/convert_hf.py to-dcp converts back with to-hf and loads via --model.hf_path)"
        )
    cfg = Checkpoint(enable=True, folder=step_dir.parent.name, load_step=int(step.group(1)))
    manager = CheckpointManager(
        cfg, str(step_dir.parent.parent), model=model, fingerprint=fingerprint, model_keys=keys or None
    )
    manager.load() if load else manager.check_resumable()
