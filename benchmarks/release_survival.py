"""What a merge into the release's format keeps of a low-rank update, by the update's size
(docs/lora.md §7, docs/results.md §19).

    .venv/bin/python benchmarks/release_survival.py RELEASE_FOLDER [--rank 16] [--sizes 1e-1,1e-2,1e-3]

For every FP8 and packed-FP4 weight of a release-format folder (W as the loader decodes it) and each
relative size r: a random rank-`--rank` update dW = B @ A (Gaussian A and B drawn from `--seed`)
scaled to ||dW|| = r ||W||, merged in float32 and re-encoded as `to-hf --dtype released` does
(models/hf/quant.py `encode`). Printed per format, summed over its tensors: the norm ratio
||Q(W + dW) - Q(W)|| / ||dW|| and the part along the update <Q(W + dW) - Q(W), dW> / ||dW||^2 (1: kept,
0: lost), and the re-encoding's error against the float32 merge, ||Q(W + dW) - (W + dW)|| / ||dW||.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources  # noqa: E402
from titan_thd.models.hf.io import SafetensorsFolder  # noqa: E402
from titan_thd.models.hf.quant import decoded, encode  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--sizes", default="1e-1,3e-2,1e-2,3e-3,1e-3,1e-4")
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    config = json.loads((opts.folder / "config.json").read_text())
    folder = SafetensorsFolder(opts.folder)
    sources, _ = quantized_sources(folder.tensors, check_quantization_config(config, str(opts.folder)))
    weights = {}
    for name, q in sources.items():
        weights[name] = (q.format, q.read(folder, tuple(slice(0, n) for n in q.shape)))
    counts = {k: sum(f.kind == k for f, _ in weights.values()) for k in ("fp8", "fp4")}
    print(f"{opts.folder}: {counts['fp8']} FP8 and {counts['fp4']} FP4 weights, rank-{opts.rank} updates")
    print(
        "| ||dW|| / ||W|| | FP8 norm ratio | FP8 along dW | FP8 error / ||dW|| | FP4 norm ratio | FP4 along dW | FP4 error / ||dW|| |"
    )
    print("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(opts.seed)
    for r in (float(x) for x in opts.sizes.split(",")):
        sums = {k: [0.0, 0.0, 0.0, 0.0] for k in ("fp8", "fp4")}
        for fmt, w in weights.values():
            rows, cols = w.shape
            dw = torch.randn(rows, opts.rank, generator=g) @ torch.randn(opts.rank, cols, generator=g)
            dw *= r * w.norm() / dw.norm()
            merged = w + dw
            q = decoded(*encode(merged, fmt), fmt).double()
            kept, d = q - w.double(), (merged.double() - w.double())
            s = sums[fmt.kind]
            s[0] += float(kept.square().sum())
            s[1] += float(d.square().sum())
            s[2] += float((kept * d).sum())
            s[3] += float((q - merged.double()).square().sum())
        cells = []
        for k in ("fp8", "fp4"):
            kept, upd, along, err = sums[k]
            cells += [f"{(kept / upd) ** 0.5:.3f}", f"{along / upd:.3f}", f"{(err / upd) ** 0.5:.3g}"]
        print(f"| {r:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
