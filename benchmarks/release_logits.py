"""transformers' logits of HF folders compared in pairs: a model written in the release's format
(`convert_hf.py to-hf --dtype released` / `to-release`) against the bfloat16 export of the same
weights (docs/results.md §19).

    .venv/bin/python benchmarks/release_logits.py RELEASED BF16 [RELEASED2 BF16_2 ...]

Each folder is loaded by `AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)` (a
folder with a quantization_config is dequantised on a CPU; bfloat16 weights are widened), so the
compute is float32 and the figures measure the weights. The documents: `--docs` sequences of
`--length` tokens drawn from `--seed` among the first 256 ids (the byte tokenizer's). Printed per
pair: max |a - b| and RMS(a - b) / RMS(b) over every document's logits, and RMS(b).
"""

from __future__ import annotations

import argparse
import sys

import torch


def logits(path: str, docs: list[torch.Tensor]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.cat([model(d[None]).logits[0].flatten() for d in docs]).double()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="+", help="pairs: a folder, then the one it is compared with")
    p.add_argument("--docs", type=int, default=4)
    p.add_argument("--length", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    opts = p.parse_args()
    if len(opts.folders) % 2:
        p.error("folders come in pairs (RELEASED BF16 ...)")
    g = torch.Generator().manual_seed(opts.seed)
    docs = [torch.randint(0, 256, (opts.length,), generator=g) for _ in range(opts.docs)]
    print(f"{opts.docs} documents of {opts.length} tokens, float32 compute")
    for a, b in zip(opts.folders[0::2], opts.folders[1::2], strict=True):
        x, y = logits(a, docs), logits(b, docs)
        rms = y.square().mean().sqrt().item()
        rel = ((x - y).square().mean().sqrt() / rms).item()
        print(
            f"{a} vs {b}: max abs {(x - y).abs().max().item():.3e}, RMS rel {rel:.3e} (RMS of logits {rms:.3f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
