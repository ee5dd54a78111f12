"""`convert_hf.py to-hf --dtype released`: a run whose base is a release folder (FP8 / packed FP4,
docs/dsv4.md §17) written back in that folder's own format (models/hf/released.py), and for a LoRA
run the fraction of each target's update the re-encoding keeps (docs/lora.md §7).

    encoder, extra = release_encoder(run, source)     # source: MergedExport (LoRA) or DcpExport
    hf.export(spec, source, args, out, encode=encoder, config_extra=extra)
    print("\\n".join(encoder.report()))
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_thd.models.hf.released import ReleaseEncoder, Survival, folder_plan
from titan_thd.run import Run


def lora_targets(run: Run, keys) -> dict[str, str]:
    """{our key of an adapted tensor: its LoRA target (`attention.wq_a`, `experts.w13`, ...)}."""
    assert run.lora is not None
    by_path = {
        f"{t.module}.{p}": name
        for name in run.lora.targets
        for t in [run.lora.family.targets[name]]
        for p in t.params
    }
    out = {}
    for key in keys:
        inside = key.split(".", 2)[2] if key.startswith("layers.") else key
        if inside in by_path:
            out[key] = by_path[inside]
    return out


def release_encoder(run: Run, source) -> tuple[ReleaseEncoder, dict]:
    """(the export's `encode` hook writing the run's base folder's format, config.json's additions);
    ValueError when the run's base (model.hf_path) is not a release-format folder."""
    base = run.cfg.model.hf_path
    if not base:
        raise ValueError(
            "--dtype released writes the format of the run's base folder, and this run has none (model.hf_path "
            "is empty: its base was drawn from the seed); use --dtype bfloat16 or float32"
        )
    plan, quantization = folder_plan(base)
    survival = None
    pairs = getattr(source, "pairs", None)  # a LoRA run's MergedExport: the adapted tensors
    if pairs is not None:
        survival = Survival(base, lora_targets(run, pairs))
    config = json.loads((Path(base) / "config.json").read_text())
    extra = {"quantization_config": quantization} | {
        k: config[k] for k in ("dtype", "torch_dtype") if k in config
    }
    return ReleaseEncoder(plan, survival), extra
