"""Peak memory of `scripts/convert_hf.py to-dcp` against the model's size, this tree beside another
revision (`--before REF`, unpacked with `git archive`), on one HF folder of a dsv4 model.

    .venv/bin/python benchmarks/bench_to_dcp.py --before 5b3e788 [--dim 1024 --experts 32 --width 1024]

The model (the tiny flavor widened: --dim, --experts routed experts of --width) is drawn once and
written as an HF folder in bfloat16 (models/hf/export.py); each side converts it to a DCP folder in a
subprocess whose peak RSS (VmHWM, `/usr/bin/time -f %M`) is printed with the float32 model bytes it
writes, and the ratio of the two sides. The DCP folders of the two sides hold the same tensors
(checked for a sample of keys: what the folder provides is read, bitwise).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_thd.models import get_model_spec  # noqa: E402
from titan_thd.models.hf.export import export  # noqa: E402


def cpu_name() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def unpack(ref: str, into: Path) -> Path:
    """`git archive ref` unpacked under `into`."""
    into.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref], capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def convert(tree: Path, src: Path, out: Path) -> tuple[float, float]:
    """(peak RSS in GiB, seconds) of `to-dcp src out` run from `tree`."""
    cmd = ["/usr/bin/time", "-f", "%M", sys.executable, str(tree / "scripts" / "convert_hf.py")]
    env = os.environ | {"PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    done = subprocess.run([*cmd, "to-dcp", str(src), str(out)], capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - t0
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: to-dcp failed:\n{done.stdout}\n{done.stderr}")
    return int(done.stderr.strip().splitlines()[-1]) / 2**20, seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True, help="the git revision to compare with (git archive)")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--width", type=int, default=1024)
    opts = p.parse_args()
    spec = get_model_spec("dsv4")
    args = dataclasses.replace(
        spec.flavors["tiny"], dim=opts.dim, n_experts=opts.experts, moe_inter_dim=opts.width
    )
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        torch.manual_seed(0)
        model = spec.build(args)
        n = sum(t.numel() for t in model.state_dict().values())
        src = export(spec, model, args, tmp / "hf", torch.bfloat16)
        del model
        print(f"{cpu_name()}, torch {torch.__version__}; dsv4 tiny widened: {n / 1e6:.0f}M values, "
              f"{4 * n / 2**30:.2f} GiB in float32; HF folder in bfloat16")  # fmt: skip
        sides = {"before": unpack(opts.before, tmp / "before"), "after": ROOT}
        rows = {}
        for name, tree in sides.items():
            rows[name] = convert(tree, src, tmp / f"dcp_{name}")
            print(f"{name:>6}: peak RSS {rows[name][0]:.2f} GiB ({rows[name][0] / (4 * n / 2**30):.2f} x the "
                  f"float32 model), {rows[name][1]:.1f} s")  # fmt: skip
        print(f"after / before: peak RSS {rows['after'][0] / rows['before'][0]:.2f}")
        import torch.distributed.checkpoint as dcp

        keys = ["model.layers.0.attn.wq_a.weight", "model.layers.1.ffn.experts.w1", "model.embed.weight"]
        got = {}
        for name in sides:
            meta = dcp.FileSystemReader(tmp / f"dcp_{name}").read_metadata().state_dict_metadata
            state = {k: torch.empty(meta[k].size, dtype=meta[k].properties.dtype) for k in keys}
            dcp.load(state, storage_reader=dcp.FileSystemReader(tmp / f"dcp_{name}"), no_dist=True)
            got[name] = state
        assert all(torch.equal(got["before"][k], got["after"][k]) for k in keys), "the two sides differ"
        print(f"sampled tensors bitwise equal on both sides: {', '.join(keys)}")


if __name__ == "__main__":
    main()
