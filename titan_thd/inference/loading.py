"""A trained model in one process, for generation and evaluation: the run's config, tokenizer and weights.

    loaded = load_model(["--job.config_file", "train_configs/dsv4_flash_thd.toml"], "outputs/x/checkpoint/step-40")

Where the weights come from (the first that applies):
- `checkpoint`: a trainer checkpoint `RUN/checkpoint/step-N`, a checkpoint folder (its newest complete
  step), or a run folder (`job.dump_folder`; the newest step of its `checkpoint.folder`). A checkpoint
  of ANY parallel layout loads, since DCP reshards it into this one process (data, context, tensor,
  pipeline or expert parallel). It must come from the model the config describes: the checkpoint's
  fingerprint (model, flavor, every parameter's name and shape) is compared and every difference named;
  its files are verified against their CRC-32s (components/checkpoint.py). A LoRA run's checkpoint holds
  its adapters only: the model is built with them (Run.build_model), the base drawn from the seed and
  read from `model.hf_path` as the trainer did, then the adapters read; the checkpoint must come from
  the config's lora.* and base (titan_thd/export/checkpoint.py `open_checkpoint`);
- `model.hf_path` of the config (or a `--model.hf_path` override): a Hugging Face folder;
- `untrained`: the seeded initialisation the trainer would start from (a baseline).

The config is read as the trainer reads it (`--job.config_file` + overrides) and checked the same way,
for one process: the parallel degrees are reset (a checkpoint of any layout loads into one process),
training-only switches (compile, validation, checkpoint saving) are off. The model is built in the
training dtype (so the checkpoint's tensors load as saved), then cast to `dtype` for inference.
The tokenizer and chat template are the run's `data.tokenizer` / `data.chat_template`; the context is
training.tokens_per_microbatch, the longest document the model was trained on.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from titan_thd.components.checkpoint import read_model
from titan_thd.config import Config, Parallelism, load_config
from titan_thd.data import deepseek_chat
from titan_thd.data.chat_template import encode_prompt
from titan_thd.data.tokenizer import END_OF_TURN, Tokenizer
from titan_thd.export.checkpoint import open_checkpoint
from titan_thd.inference.generate import Completion, generate
from titan_thd.lora.targets import trained_keys
from titan_thd.models.hf.base import init_base
from titan_thd.models.spec import ModelSpec, as_dtype
from titan_thd.parallel.distributed import parse_device
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.startup import resolve_run

CONFIG_DIR = Path(__file__).resolve().parents[2] / "train_configs"


@dataclass
class Loaded:
    model: nn.Module
    """The whole model, on `device`, in eval mode."""
    tokenizer: Tokenizer
    cfg: Config
    spec: ModelSpec
    device: torch.device
    context: int
    """Most tokens a sequence may hold (training.tokens_per_microbatch)."""
    source: str
    """Where the weights came from (for the log line)."""

    @property
    def stop_ids(self) -> set[int]:
        return stop_ids(self.tokenizer)

    def chat_prompt(self, messages: list[dict]) -> list[int]:
        """Ids asking for the next assistant turn of `messages` in the run's chat template."""
        return encode_prompt(self.tokenizer, messages)

    def generate(self, prompts: list[list[int]], max_new_tokens: int, **kwargs) -> list[Completion]:
        """generate.generate with this run's spec (its decoder), stop ids, tokenizer vocabulary, context
        and device."""
        kwargs = {"stop_ids": self.stop_ids, "vocab_size": self.tokenizer.vocab_size, **kwargs}
        return generate(
            self.model,
            prompts,
            spec=self.spec,
            max_new_tokens=max_new_tokens,
            context=self.context,
            device=self.device,
            **kwargs,
        )


def stop_ids(tokenizer: Tokenizer) -> set[int]:
    """The ids that end an assistant turn: `<|end|>` (simple template) or DeepSeek's end of sentence,
    and the tokenizer's eos."""
    end = deepseek_chat.EOS if tokenizer.chat_format == "deepseek" else END_OF_TURN
    return {tokenizer.special_id(end), tokenizer.eos_id}


def config_argv(config: str) -> list[str]:
    """`--job.config_file PATH` for `config`: a path, a name in train_configs/ (as run_train.sh), or a
    path relative to the checkout (`train_configs/X.toml` from another working directory)."""
    for candidate in (Path(config), CONFIG_DIR / config, CONFIG_DIR.parent / config):
        if candidate.is_file():
            return ["--job.config_file", str(candidate)]
    names = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.toml")))
    raise ValueError(f"--config {config!r}: no such file (nor train_configs/{config}); available: {names}")


def inference_config(argv: list[str]) -> Config:
    """The run's config for one process: parallel degrees reset, training-only switches off. A new
    Config (new sections where they differ): nothing writes the loaded one."""
    cfg = load_config(argv)
    return dataclasses.replace(
        cfg,
        parallelism=Parallelism(),
        validation=dataclasses.replace(cfg.validation, enable=False),
        training=dataclasses.replace(cfg.training, compile=False),
        comm=dataclasses.replace(cfg.comm, mode="default"),
    )


def load_model(
    argv: list[str],
    checkpoint: str | Path | None = None,
    *,
    untrained: bool = False,
    device: str | torch.device = "cpu",
    dtype: str = "float32",
) -> Loaded:
    """The model, tokenizer and config of a run (see the module docstring); ValueError on bad input."""
    device = parse_device(device)  # before anything loads: --device cuda on a CPU-only machine is one line
    cfg = inference_config(argv)
    run = resolve_run(cfg, 1)
    spec, tokenizer = run.spec, run.tokenizer
    if checkpoint is None and not cfg.model.hf_path and not untrained:
        raise ValueError(
            "no weights: give --checkpoint (RUN/checkpoint/step-N, or a run folder), --model.hf_path "
            "(a Hugging Face folder), or --untrained for the seeded initialisation"
        )
    # A checkpoint of another model is refused before anything is built (LoRA: adapters of these lora.*,
    # trained on this base).
    opened = open_checkpoint(run, checkpoint) if checkpoint is not None else None
    # A LoRA run's model carries its adapters (Run.build_model); its base is drawn from the seed and read
    # from model.hf_path (the folder start-up opened), as the trainer's was, in the master dtype the
    # trainer drew it in.
    model = build_on_meta(run.build_model).to(run.precision.master).to_empty(device="cpu")
    folder = run.hf if opened is None or run.lora is not None else None  # a whole-model checkpoint: all of it
    init_base(model, folder, cfg.training.seed)  # the trainer's initialisation (what --untrained evaluates)
    if opened is not None:
        read_model(
            model, opened.step_dir, opened.fingerprint, keys=() if run.lora is None else trained_keys(model)
        )
        base = f" (LoRA adapters on {cfg.model.hf_path or 'the seeded base'})" if run.lora else ""
        source = f"checkpoint {opened.step_dir}{base}"
    elif cfg.model.hf_path:
        source = f"Hugging Face folder {cfg.model.hf_path}"
    else:
        source = f"untrained (seed {cfg.training.seed})"
    model = model.to(device=device, dtype=as_dtype(dtype)).eval()
    return Loaded(
        model, tokenizer, cfg, spec, device, cfg.training.tokens_per_microbatch, f"{run.model_label} {source}"
    )
