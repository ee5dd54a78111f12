"""Convert weights between a Hugging Face folder and a DCP checkpoint folder (needs the `hf` extra:
./scripts/setup_env.sh hf).

    # a trainer checkpoint -> HF folder with the run's tokenizer, loadable by transformers'
    # AutoModelForCausalLM / AutoTokenizer (dsv4: DeepseekV4ForCausalLM, llama: LlamaForCausalLM)
    .venv/bin/python scripts/convert_hf.py to-hf RUN_OR_CHECKPOINT OUT_DIR --config dsv4_flash_thd.toml [--dtype bfloat16]

    # a LoRA run's checkpoint -> adapter_config.json + adapter_model.safetensors for peft / vLLM on the
    # base folder (model.hf_path); `to-hf` on a LoRA run writes the merged model, W + s * B @ A
    .venv/bin/python scripts/convert_hf.py to-peft outputs/dsv4_flash_lora OUT_DIR --config dsv4_flash_lora.toml [--dtype bfloat16]

    # HF (config.json + *.safetensors) -> DCP folder holding the trainer's "model" entries (dsv4)
    .venv/bin/python scripts/convert_hf.py to-dcp HF_DIR OUT_DIR [--flavor tiny]

    # a to-dcp folder (or a dsv4 checkpoint without its run's config) -> HF weights and config.json only
    .venv/bin/python scripts/convert_hf.py to-hf DCP_DIR OUT_DIR (--flavor tiny | --hf-config config.json)

With --config (the run's TOML, a path or a name in train_configs/, plus `--section.field value` overrides
as for the trainer) `to-hf` reads a trainer checkpoint of any parallel layout: `RUN/checkpoint/step-N`, or
a run folder / checkpoint folder for its newest step (titan_thd/inference/loading.py checks the
checkpoint's model fingerprint against the config). The export then holds config.json (with the
tokenizer's bos / eos / pad ids), the weights, tokenizer.json, tokenizer_config.json (with the chat
template) and generation_config.json, so `generate` stops at the end of an assistant turn
(titan_thd/models/hf/tokenizer.py).

`to-hf` never builds the model: it streams the checkpoint's model entries a group at a time
(titan_thd/models/hf/write.py) into safetensors files of at most `--max-shard-size` bytes (default
5GB, as transformers), `model.safetensors` alone or `model-0000K-of-0000N.safetensors` with
`model.safetensors.index.json`; peak memory is about 1.25 files plus the largest tensor plus the
process (docs/dsv4.md §17.3). `to-dcp` never builds the model either: DCP plans the checkpoint from a
meta-device model and reads each tensor from the folder when it writes it (titan_thd/models/hf/to_dcp.py:
the peak is one tensor plus the process).

A LoRA run's checkpoint holds its adapters only (titan_thd/inference/lora_export.py, docs/lora.md §4):
both exports check that it was trained with the config's lora.* and on the config's base (the
fingerprint of model.hf_path, or the seed), read only the adapter entries, and never gather the base. `to-peft`
writes a block of adapters at a time (--dtype float32 by default). `to-hf` reads the base a group of
tensors at a time (model.hf_path's, FP8 / FP4 dequantised on read, or drawn from training.seed),
folds each adapter in as W + s * B @ A in float32 (expert stacks one expert at a time) and writes
float32 or bfloat16. Its peak is the same as above plus one group's adapters.

    # a run whose base (model.hf_path) is a release folder -> that folder's FP8 / FP4 format; a LoRA
    # merge prints per target how much of its update survives the re-encoding (docs/lora.md §6)
    .venv/bin/python scripts/convert_hf.py to-hf outputs/dsv4_flash_lora OUT_DIR --config dsv4_flash_lora.toml --dtype released

    # any HF folder (dsv4) -> DeepSeek's release format, e.g. a small base to try lora.base_dtype = "released"
    .venv/bin/python scripts/convert_hf.py to-release HF_DIR OUT_DIR [--fp8-block 128x128]

    # a trainer checkpoint written before the routed experts were stacked (one tensor per expert)
    # -> the same checkpoint with [E, out, in] stacks (model and optimizer state; resumable)
    .venv/bin/python scripts/convert_hf.py stack-experts outputs/x/checkpoint/step-60 NEW/step-60

The DCP state dict has the trainer's layout (`{"model": {fqn: tensor}}`, so keys `model.<fqn>`),
written by one process; DCP reshards it when a multi-rank job loads it. The model family is reached
through its ModelSpec's Hugging Face adapter (`spec.hf`, read and written by titan_thd/models/hf/; the
names live in titan_thd/models/<family>/). `to-dcp` reads DeepSeek's published FP8 / packed-FP4
checkpoints too: their weights are dequantised to float32 (docs/dsv4.md §17.1). For `to-hf` the
architecture comes from the flavor (its vocabulary size is taken from the checkpoint's embedding, since
the trainer rounds the tokenizer's up to a multiple of 64) or from an HF config.json; `to-dcp` copies
config.json next to the shards so the folder converts back with `--hf-config OUT_DIR/config.json`.
`to-hf` also reads the per-expert layout of checkpoints written before the experts were stacked.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shutil
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titan_thd.components.checkpoint import read_model
from titan_thd.components.checkpoint_folder import (
    META_FILE,
    PER_EXPERT_PARAM,
    model_fingerprint,
    resolve_step_dir,
    write_meta,
)
from titan_thd.inference.loading import config_argv, inference_config, one_line
from titan_thd.inference.lora_export import (
    MergedSource,
    check_adapters,
    check_exportable,
    check_merge_dtype,
    lora_checkpoint,
    write_peft_streamed,
)
from titan_thd.inference.released_export import release_encoder
from titan_thd.models import MODEL_NAMES, get_model_spec, hf
from titan_thd.models.hf.released import parse_block, write_release
from titan_thd.models.hf.to_dcp import save_dcp
from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE, DcpSource, parse_size
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.startup import resolve_run

HF_EXTRA = "the hf extra (safetensors, transformers): install it with ./scripts/setup_env.sh hf"


def hf_family(hf_dir: Path):
    """(spec, args) of the family whose adapter reads the folder's config.json (its model_type)."""
    errors = []
    for name in MODEL_NAMES:
        spec = get_model_spec(name)
        if spec.hf is None:
            continue
        try:
            return spec, hf.folder_args(spec, str(hf_dir))
        except ValueError as e:
            errors.append(f"{name}: {one_line(e)}")
    raise ValueError(f"{hf_dir}: no model family reads this config.json ({'; '.join(errors)})")


def to_dcp(hf_dir: Path, out: Path, flavor: str | None) -> None:
    spec, args = hf_family(hf_dir)
    if flavor is not None:
        if flavor not in spec.flavors:
            raise ValueError(f"--flavor {flavor!r}: expected one of {list(spec.flavors)} ({spec.name})")
        hf.check(spec, spec.flavors[flavor], str(hf_dir), f"flavor {flavor!r}")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    # One tensor at a time; what the folder lacks (transformers writes no MTP) is drawn from a seed.
    n = save_dcp(spec, args, hf_dir, out, seed=int(torch.randint(2**62, ())))
    shutil.copy(hf_dir / "config.json", out / "config.json")
    print(f"wrote {out}: {n} model tensors, args {spec.hf.architecture(args)}")


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _run(config: str, overrides: list[str]):
    """The run of a config (+ overrides) for one process; ValueError without a Hugging Face format."""
    cfg = inference_config(config_argv(config) + overrides)
    run = resolve_run(cfg, 1)
    if run.spec.hf is None:
        raise ValueError(f"model {cfg.model.name} has no Hugging Face export (its ModelSpec.hf is None)")
    return run


def to_peft(src: Path, out: Path, config: str, overrides: list[str], dtype: str) -> None:
    """A LoRA run's checkpoint -> adapter_config.json + adapter_model.safetensors (PEFT), the adapters
    alone read from the checkpoint, a block at a time (the base is never built)."""
    check_merge_dtype(dtype, lora=False)
    run = _run(config, overrides)
    check_exportable(run)
    step_dir, meta = lora_checkpoint(run, src)
    path, n, size = write_peft_streamed(run, step_dir, meta, out, getattr(torch, dtype), _progress)
    print(f"wrote {path} from checkpoint {step_dir}: {n} adapter tensors ({size / 1e6:.1f} MB, {dtype})")


def run_to_hf(
    src: Path, out: Path, config: str, overrides: list[str], dtype: str | None, max_shard_size: int
) -> None:
    """A trainer checkpoint with its run's config -> HF folder with the tokenizer files, streamed from
    the checkpoint's model entries a group at a time (the model is never built). A LoRA run's: the
    base (model.hf_path or the seed) with its adapters merged, W + s * B @ A (inference/lora_export.py)."""
    run = _run(config, overrides)
    check_merge_dtype(dtype, lora=run.lora is not None, released=True)  # FP8 / FP4: as the base stores them
    cfg = run.cfg
    if run.lora is not None:
        step_dir, meta = lora_checkpoint(run, src)
        source = MergedSource(run, step_dir, meta, _progress)
    else:
        step_dir = resolve_step_dir(src, cfg.checkpoint.folder)
        check_adapters(run, step_dir)  # a LoRA checkpoint needs its run's [lora]
        meta = build_on_meta(lambda: run.spec.build(run.model_args))
        fingerprint = model_fingerprint([meta], model=cfg.model.name, flavor=run.flavor)
        read_model(meta, step_dir, fingerprint, load=False)
        source = DcpSource(step_dir, "model.")
    # --dtype released: the base folder's own FP8 / FP4 format (inference/released_export.py)
    encoder, extra = release_encoder(run, source) if dtype == "released" else (None, None)
    hf.export(
        run.spec,
        source,
        run.model_args,
        out,
        getattr(torch, dtype) if dtype and encoder is None else None,
        tokenizer=run.tokenizer,
        tokenizer_source=None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer,
        context=cfg.training.tokens_per_microbatch,
        max_shard_size=max_shard_size,
        encode=encoder,
        config_extra=extra,
    )
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    merged = f" (base + the adapters of {source.merged} tensors)" if run.lora is not None else ""
    print(f"wrote {out} from checkpoint {step_dir}{merged}: {files}")
    for line in encoder.report() if encoder is not None else []:
        print(line)


def _dcp_args(spec, source: DcpSource, flavor: str | None, hf_config: Path | None):
    """The args of a DCP folder: from an HF config.json, or a flavor with the checkpoint's vocabulary
    (the trainer rounds the tokenizer's up): the model's first tensor is its embedding [V, d]."""
    if hf_config is not None:
        if spec.hf is None:
            raise ValueError(f"model {spec.name} reads no config.json (its ModelSpec.hf is None)")
        if hf_config.name == "config.json":
            return hf.folder_args(spec, str(hf_config.parent))
        with tempfile.TemporaryDirectory() as tmp:
            shutil.copy(hf_config, Path(tmp) / "config.json")
            return hf.folder_args(spec, tmp)
    args = spec.flavors[flavor]
    first = next(iter(build_on_meta(lambda: spec.build(args)).state_dict()))
    return dataclasses.replace(args, vocab_size=source.entries()[first][0][0])


def to_hf(
    dcp_dir: Path,
    out: Path,
    flavor: str | None,
    hf_config: Path | None,
    dtype: str | None,
    max_shard_size: int,
) -> None:
    """A DCP folder (to-dcp's, or a checkpoint without its run's config) -> HF folder, streamed."""
    if dtype == "released":
        raise ValueError(
            "--dtype released writes the format of a run's base folder: give the run's --config (model.hf_path "
            "a release-format folder), or write a folder in the release format with to-release"
        )
    if (flavor is None) == (hf_config is None):
        raise ValueError(
            "to-hf needs --config (the run's TOML: the model, and the tokenizer files to export), or for a "
            "DCP folder exactly one of --flavor or --hf-config"
        )
    source = DcpSource(dcp_dir, "model.")
    entries = source.entries()
    # The family whose model fits the entries: its flavor, or the one reading the config.json.
    spec = args = None
    for name in MODEL_NAMES:
        candidate = get_model_spec(name)
        if candidate.hf is None or (flavor is not None and flavor not in candidate.flavors):
            continue
        try:
            cand_args = _dcp_args(candidate, source, flavor, hf_config)
        except (ValueError, KeyError):
            continue
        first = next(iter(build_on_meta(lambda c=candidate, a=cand_args: c.build(a)).state_dict()))
        if first in entries:
            spec, args = candidate, cand_args
            break
    if spec is None:
        raise ValueError(
            f"{dcp_dir}: no model family with "
            + (f"flavor {flavor!r}" if flavor else f"the config {hf_config}")
            + " fits its entries"
        )
    expected = build_on_meta(lambda: spec.build(args)).state_dict()
    # A checkpoint from before the experts were stacked holds one entry per expert instead.
    legacy = any(PER_EXPERT_PARAM.search(k) for k in entries)
    missing = [
        f"model.{k}"
        for k in expected
        if k not in entries and not (legacy and re.search(r"experts\.w[123]$", k))
    ]
    if missing:
        raise ValueError(f"{dcp_dir} lacks {len(missing)} tensors of this architecture, e.g. {missing[:5]}")
    shapes = [
        f"model.{k}: checkpoint {entries[k][0]} vs {tuple(v.shape)}"
        for k, v in expected.items()
        if k in entries and entries[k][0] != tuple(v.shape)
    ]
    if shapes:
        raise ValueError(f"{dcp_dir} does not have this architecture's shapes: " + "; ".join(shapes[:5]))
    check_merge_dtype(dtype, lora=False)
    hf.export(
        spec, source, args, out, getattr(torch, dtype) if dtype else None, max_shard_size=max_shard_size
    )
    files = sorted(p.name for p in out.iterdir() if p.suffix == ".safetensors")
    print(
        f"wrote {out}: config.json + {len(files)} safetensors file(s)"
        + (" (from per-expert entries)" if legacy else "")
    )


_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w[123])\.weight$")


def _stack_per_expert(state: dict[str, Any]) -> dict[str, Any]:
    """`<layer>.ffn.experts.<e>.w1.weight` entries (the layout before stacking) -> `<layer>.ffn.experts.w1`
    [E, out, in] stacks (shapes too: meta tensors stack); other entries pass unchanged."""
    out: dict[str, Any] = {}
    per_expert: dict[str, dict[int, Any]] = {}
    for key, value in state.items():
        m = _PER_EXPERT.match(key)
        if m is None:
            out[key] = value
        else:
            per_expert.setdefault(f"{m.group(1)}.{m.group(3)}", {})[int(m.group(2))] = value
    for key, by_id in per_expert.items():
        assert sorted(by_id) == list(range(len(by_id))), (key, sorted(by_id))
        out[key] = torch.stack([by_id[e] for e in sorted(by_id)])
    return out


_EXPERT_OPTIM = re.compile(r"^(state|param_groups)\.(.*\.ffn\.experts)\.(\d+)\.(w[123])\.weight\.(\w+)$")


def _stack_optimizer(flat: dict[str, Any]) -> dict[str, Any]:
    """Flattened optimizer state (`state.<fqn>.<key>`, `param_groups.<fqn>.<key>`) of per-expert
    parameters -> that of the stacks: tensors per expert stacked, the rest (step counts, group
    settings) the same for every expert of a layer and kept once."""
    out: dict[str, Any] = {}
    groups: dict[str, dict[int, Any]] = {}
    for key, value in flat.items():
        m = _EXPERT_OPTIM.match(key)
        if m is None:
            out[key] = value
            continue
        kind, prefix, e, name, field = m.groups()
        groups.setdefault(f"{kind}.{prefix}.{name}.{field}", {})[int(e)] = value
    for key, by_id in groups.items():
        values = [by_id[e] for e in sorted(by_id)]
        assert sorted(by_id) == list(range(len(values))), (key, sorted(by_id))
        if isinstance(values[0], torch.Tensor) and values[0].dim() > 0:
            out[key] = torch.stack(values)
            continue
        same = all(
            torch.equal(v, values[0]) if isinstance(v, torch.Tensor) else v == values[0] for v in values
        )
        if not same:
            raise ValueError(f"{key}: the experts differ ({values[:4]} ...); expected one value for a layer")
        out[key] = values[0]
    return out


def stack_checkpoint(src: Path, out: Path) -> None:
    """A trainer checkpoint folder (step-N) with one tensor per routed expert -> the same state with
    [E, out, in] stacks, written by one process with its meta.json (DCP reshards it on load)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not (src / META_FILE).is_file() or not (src / ".metadata").is_file():
        raise ValueError(f"{src}: not a trainer checkpoint folder (expected {META_FILE} and .metadata)")
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    meta = json.loads((src / META_FILE).read_text())
    params = meta["fingerprint"]["params"]
    if not any(PER_EXPERT_PARAM.search(n) for n in params):
        raise ValueError(f"{src}: no per-expert parameters; it is already in the stacked layout")
    with warnings.catch_warnings():  # one process, no process group: intended
        warnings.simplefilter("ignore")
        state: dict[str, Any] = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(src))
    state["model"] = _stack_per_expert(state["model"])
    state["optimizer"] = _stack_optimizer(state["optimizer"])
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    shapes = _stack_per_expert({k: torch.empty(v, device="meta") for k, v in params.items()})  # names, shapes
    fingerprint = meta["fingerprint"] | {"params": {k: list(v.shape) for k, v in shapes.items()}}
    write_meta(out, meta["step"], meta["world_size"], fingerprint)
    print(f"wrote {out}: step {meta['step']}, {len(state['model'])} model tensors (experts stacked)")


def to_release(hf_dir: Path, out: Path, block: str, max_shard_size: int) -> None:
    """Any HF folder -> the family's release format (FP8 / packed FP4, models/hf/released.py)."""
    rows_cols = parse_block(block)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    encoder = write_release(*hf_family(hf_dir), hf_dir, out, rows_cols, max_shard_size)
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    print(f"wrote {out} in the release format (FP8 blocks {block}, FP4 experts): {size / 1e6:.1f} MB")
    for line in encoder.report():
        print(line)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-dcp", help="HF folder -> DCP folder")
    a.add_argument("src", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--flavor", default=None, help="fail unless config.json matches this flavor")
    b = sub.add_parser("to-hf", help="trainer checkpoint or DCP folder -> HF folder")
    b.add_argument(
        "src", type=Path, help="RUN/checkpoint/step-N, a run folder (its newest step) or a DCP folder"
    )
    b.add_argument("out", type=Path)
    b.add_argument("--config", default=None, help="the run's TOML (a path or a name in train_configs/)")
    b.add_argument("--flavor", default=None, help="without --config: the flavor of a DCP folder")
    b.add_argument("--hf-config", type=Path, default=None, help="without --config: an HF config.json")
    b.add_argument("--dtype", default=None, help="float32, bfloat16 (default: as stored) or released")
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_SIZE,
        help="largest safetensors file (bytes, or 5GB / 500MB / 2GiB; default 5GB as transformers)",
    )
    d = sub.add_parser("to-peft", help="a LoRA run's checkpoint -> PEFT adapter folder")
    d.add_argument("src", type=Path, help="RUN/checkpoint/step-N or a run folder (its newest step)")
    d.add_argument("out", type=Path)
    d.add_argument("--config", required=True, help="the run's TOML (a path or a name in train_configs/)")
    d.add_argument("--dtype", default="float32", help="float32 (default) or bfloat16")
    r = sub.add_parser("to-release", help="HF folder -> the family's release format (FP8 / packed FP4)")
    r.add_argument("src", type=Path, help="an HF folder (config.json + *.safetensors)")
    r.add_argument("out", type=Path)
    r.add_argument(
        "--fp8-block",
        default="128x128",
        help="FP8 scale block ROWSxCOLS (default the release's 128x128; 16x16 lets a tiny model's TP cuts fall on blocks)",
    )
    r.add_argument("--max-shard-size", type=parse_size, default=DEFAULT_MAX_SHARD_SIZE)
    c = sub.add_parser("stack-experts", help="trainer checkpoint, per-expert layout -> stacked experts")
    c.add_argument("src", type=Path)
    c.add_argument("out", type=Path)
    opts, overrides = p.parse_known_args(argv)
    if overrides and not (opts.cmd in ("to-hf", "to-peft") and opts.config):
        p.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides need --config)")
    try:
        if opts.cmd == "to-dcp":
            to_dcp(opts.src, opts.out, opts.flavor)
        elif opts.cmd == "to-release":
            to_release(opts.src, opts.out, opts.fp8_block, opts.max_shard_size)
        elif opts.cmd == "stack-experts":
            stack_checkpoint(opts.src, opts.out)
        elif opts.cmd == "to-peft":
            to_peft(opts.src, opts.out, opts.config, overrides, opts.dtype)
        elif opts.config is not None:
            if opts.flavor or opts.hf_config:
                raise ValueError(
                    "to-hf --config reads the model from the run's config: drop --flavor / --hf-config"
                )
            run_to_hf(opts.src, opts.out, opts.config, overrides, opts.dtype, opts.max_shard_size)
        else:
            to_hf(opts.src, opts.out, opts.flavor, opts.hf_config, opts.dtype, opts.max_shard_size)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("safetensors", "transformers"):
            raise
        print(f"error: convert_hf.py needs {HF_EXTRA} ({e})", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:  # NotExportable too
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
