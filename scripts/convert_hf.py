"""Convert weights between a Hugging Face folder and a DCP checkpoint folder (needs the `hf` extra:
./scripts/setup_env.sh hf).

    # a trainer checkpoint -> HF folder with the run's tokenizer, loadable by transformers'
    # AutoModelForCausalLM / AutoTokenizer (dsv4: DeepseekV4ForCausalLM, llama: LlamaForCausalLM)
    .venv/bin/python scripts/convert_hf.py to-hf RUN_OR_CHECKPOINT OUT_DIR --config dsv4_flash_thd.toml [--dtype bfloat16]

    # HF (config.json + *.safetensors) -> DCP folder holding the trainer's "model" entries (dsv4)
    .venv/bin/python scripts/convert_hf.py to-dcp HF_DIR OUT_DIR [--flavor tiny]

    # a to-dcp folder (or a dsv4 checkpoint without its run's config) -> HF weights and config.json only
    .venv/bin/python scripts/convert_hf.py to-hf DCP_DIR OUT_DIR (--flavor tiny | --hf-config config.json)

With --config (the run's TOML, a path or a name in train_configs/, plus `--section.field value` overrides
as for the trainer) `to-hf` reads a trainer checkpoint of any parallel layout: `RUN/checkpoint/step-N`, or
a run folder / checkpoint folder for its newest step (titan_thd/inference/loading.py checks the
checkpoint's model fingerprint against the config). The export then holds config.json (with the
tokenizer's bos / eos / pad ids), model.safetensors, tokenizer.json, tokenizer_config.json (with the
chat template) and generation_config.json, so `generate` stops at the end of an assistant turn
(titan_thd/models/hf_tokenizer.py).

    # a trainer checkpoint written before the routed experts were stacked (one tensor per expert)
    # -> the same checkpoint with [E, out, in] stacks (model and optimizer state; resumable)
    .venv/bin/python scripts/convert_hf.py stack-experts outputs/x/checkpoint/step-60 NEW/step-60

The DCP state dict has the trainer's layout (`{"model": {fqn: tensor}}`, so keys `model.<fqn>`),
written by one process; DCP reshards it when a multi-rank job loads it. The HF side uses
`titan_thd.models.dsv4.hf_interop` (the one place that maps names). `to-dcp` reads DeepSeek's published
FP8 / packed-FP4 checkpoints too: their weights are dequantised to float32 (docs/dsv4.md §17.1). For `to-hf` the architecture
comes from the flavor (its vocabulary size is taken from the checkpoint's embedding, since the
trainer rounds the tokenizer's up to a multiple of 64) or from an HF config.json; `to-dcp` copies
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
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from titan_thd.components.checkpoint import META_FILE, PER_EXPERT_PARAM, write_meta
from titan_thd.inference.loading import config_argv, load_model, one_line
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors, load_hf
from titan_thd.models.dsv4.hf_interop import args_from_hf_config, split_experts, stack_experts

HF_EXTRA = "the hf extra (safetensors, transformers): install it with ./scripts/setup_env.sh hf"


def to_dcp(hf_dir: Path, out: Path, flavor: str | None) -> None:
    model, args = load_hf(hf_dir, flavor)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"{out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():  # DCP warns that no process group exists: one writer is intended
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, storage_writer=dcp.FileSystemWriter(out))
    shutil.copy(hf_dir / "config.json", out / "config.json")
    print(f"wrote {out}: {len(model.state_dict())} model tensors, args {args.architecture()}")


def run_to_hf(src: Path, out: Path, config: str, overrides: list[str], dtype: str | None) -> None:
    """A trainer checkpoint with its run's config -> HF folder with the tokenizer files."""
    from titan_thd.models.llama import hf_interop as llama_hf

    loaded = load_model(config_argv(config) + overrides, src)
    cfg, model = loaded.cfg, loaded.model
    source = None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
    kwargs = {"tokenizer": loaded.tokenizer, "tokenizer_source": source, "context": loaded.context}
    torch_dtype = getattr(torch, dtype) if dtype else None
    if cfg.model.name == "dsv4":
        export_hf(model, model.args, out, torch_dtype, **kwargs)
    else:
        llama_hf.export_hf(model, out, torch_dtype, **kwargs)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out} from {loaded.source}: {files}")


def to_hf(dcp_dir: Path, out: Path, flavor: str | None, hf_config: Path | None, dtype: str | None) -> None:
    if (flavor is None) == (hf_config is None):
        raise ValueError(
            "to-hf needs --config (the run's TOML: the model, and the tokenizer files to export), or for a "
            "dsv4 DCP folder exactly one of --flavor or --hf-config"
        )
    if not (dcp_dir / ".metadata").is_file():
        raise ValueError(f"{dcp_dir}: not a DCP checkpoint (no .metadata)")
    metadata = dcp.FileSystemReader(dcp_dir).read_metadata().state_dict_metadata
    if "model.embed.weight" not in metadata:
        raise ValueError(f"{dcp_dir}: no model.embed.weight entry; is it a dsv4 checkpoint?")
    if hf_config is not None:
        args = args_from_hf_config(json.loads(hf_config.read_text()), str(hf_config))
    else:
        if flavor not in flavors:
            raise ValueError(f"--flavor {flavor!r}: expected one of {list(flavors)}")
        vocab = metadata["model.embed.weight"].size[0]
        args = dataclasses.replace(flavors[flavor], vocab_size=vocab)
    model = build_dsv4(args)
    # A checkpoint from before the experts were stacked holds one entry per expert: read those.
    legacy = any(PER_EXPERT_PARAM.search(k) for k in metadata)
    state = {"model": split_experts(model.state_dict()) if legacy else model.state_dict()}
    missing = [f"model.{k}" for k in state["model"] if f"model.{k}" not in metadata]
    if missing:
        raise ValueError(f"{dcp_dir} lacks {len(missing)} tensors of this architecture, e.g. {missing[:5]}")
    shapes = [
        f"model.{k}: checkpoint {tuple(metadata[f'model.{k}'].size)} vs {tuple(v.shape)}"
        for k, v in state["model"].items()
        if tuple(metadata[f"model.{k}"].size) != tuple(v.shape)
    ]
    if shapes:
        raise ValueError(f"{dcp_dir} does not have this architecture's shapes: " + "; ".join(shapes[:5]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, storage_reader=dcp.FileSystemReader(dcp_dir))
    model.load_state_dict(stack_experts(state["model"]) if legacy else state["model"])
    export_hf(model, args, out, dtype=getattr(torch, dtype) if dtype else None)
    print(f"wrote {out}: config.json + model.safetensors" + (" (from per-expert entries)" if legacy else ""))


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
    state["model"] = stack_experts(state["model"])
    state["optimizer"] = _stack_optimizer(state["optimizer"])
    out.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    shapes = stack_experts({k: torch.empty(v, device="meta") for k, v in params.items()})  # names, shapes
    fingerprint = meta["fingerprint"] | {"params": {k: list(v.shape) for k, v in shapes.items()}}
    write_meta(out, meta["step"], meta["world_size"], fingerprint)
    print(f"wrote {out}: step {meta['step']}, {len(state['model'])} model tensors (experts stacked)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("to-dcp", help="HF folder -> DCP folder")
    a.add_argument("src", type=Path)
    a.add_argument("out", type=Path)
    a.add_argument("--flavor", default=None, help="fail unless config.json matches this dsv4 flavor")
    b = sub.add_parser("to-hf", help="trainer checkpoint or DCP folder -> HF folder")
    b.add_argument(
        "src", type=Path, help="RUN/checkpoint/step-N, a run folder (its newest step) or a DCP folder"
    )
    b.add_argument("out", type=Path)
    b.add_argument("--config", default=None, help="the run's TOML (a path or a name in train_configs/)")
    b.add_argument("--flavor", default=None, help="without --config: the dsv4 flavor of a DCP folder")
    b.add_argument("--hf-config", type=Path, default=None, help="without --config: an HF config.json (dsv4)")
    b.add_argument("--dtype", default=None, choices=["float32", "bfloat16"])
    c = sub.add_parser("stack-experts", help="trainer checkpoint, per-expert layout -> stacked experts")
    c.add_argument("src", type=Path)
    c.add_argument("out", type=Path)
    opts, overrides = p.parse_known_args(argv)
    if overrides and not (opts.cmd == "to-hf" and opts.config):
        p.error(f"unrecognized arguments: {' '.join(overrides)} (config overrides need to-hf --config)")
    try:
        if opts.cmd == "to-dcp":
            to_dcp(opts.src, opts.out, opts.flavor)
        elif opts.cmd == "stack-experts":
            stack_checkpoint(opts.src, opts.out)
        elif opts.config is not None:
            if opts.flavor or opts.hf_config:
                raise ValueError(
                    "to-hf --config reads the model from the run's config: drop --flavor / --hf-config"
                )
            run_to_hf(opts.src, opts.out, opts.config, overrides, opts.dtype)
        else:
            to_hf(opts.src, opts.out, opts.flavor, opts.hf_config, opts.dtype)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in ("safetensors", "transformers"):
            raise
        print(f"error: convert_hf.py needs {HF_EXTRA} ({e})", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
