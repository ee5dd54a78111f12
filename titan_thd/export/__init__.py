"""Exporting a run: the one drawer (scripts/convert_hf.py parses the arguments and prints; everything
it does is here or in the family-generic Hugging Face door it calls, titan_thd/models/hf/).

    commands.py    each subcommand of convert_hf.py: to-hf (a run's checkpoint, or a DCP folder),
                   to-peft, to-dcp, to-release; returns its summary line
    recorded.py    `run_argv`: a run's saved config.toml and recorded base as defaults, the output
                   checked against every input (models/hf/staging.py) before the run is opened
    checkpoint.py  `open_checkpoint`: a trainer checkpoint checked against the run (kind, lora.*,
                   base, fingerprint), the run's model on the meta device; inference opens it so too
    merge.py       `MergedExport`: the base with a LoRA run's adapters folded in, W + s * B @ A
    released.py    `release_encoder`: to-hf --dtype released, the base folder's FP8 / FP4 format
    adapters.py    `write_peft`: a LoRA run's adapters in PEFT's format (the layout: lora/peft.py)
    vllm_adapters.py  `to_vllm`: a dsv4 LoRA run's adapters in the layout vLLM serves (lora/vllm.py)
    stack.py       a checkpoint of per-expert tensors -> stacked experts (stack-experts)

Below it, in titan_thd/models/hf/: `export` (a model or an export's tensors -> an HF folder with the
tokenizer files), write.py (`ModelExport`, `DcpExport`, files of bounded size, `SafetensorsFile`: the
one safetensors writer), base.py (the frozen base from a folder or a seed: `FrozenBase`, `init_base`),
to_dcp.py (a folder -> DCP) and folder.py (`HFFolder`: a folder opened once).
"""
