"""Peak RSS per rank at start-up and after one step, for 1, 2 and 4 ranks, on a model whose state
dominates memory: what building on the meta device and allocating only this rank's shards buys.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_startup_memory.py            # 1, 2, 4 ranks
    .venv/bin/python benchmarks/bench_startup_memory.py --ranks 4 --experts 64       # the 823M model

Each run is `./run_train.sh` (torchrun, gloo, FSDP over the ranks) for one step of the dsv4 recipe at
`--model.args.dim 512 --model.args.n_experts E --model.args.moe_inter_dim 1024`, AdamW, 512 tokens per
microbatch. The trainer logs every rank's max RSS after start-up (model built and loaded, no step
yet) and at the end; the header logs the memory plan's state per rank and its start-up estimate.
The table adds the bound the start-up must stay under: the 1-rank state / N + the process (the RSS
of a 1-rank start-up less its parameters) + one unsharded FSDP unit.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def run(ranks: int, experts: int, folder: Path) -> dict[str, float]:
    cmd = [
        "./run_train.sh",
        "--config",
        "dsv4_flash_thd.toml",
        *(
            "--model.args.dim",
            "512",
            "--model.args.n_experts",
            str(experts),
            "--model.args.moe_inter_dim",
            "1024",
        ),
        *(
            "--optimizer.name",
            "adamw",
            "--training.tokens_per_microbatch",
            "512",
            "--training.compile",
            "false",
        ),
        *("--training.global_batch_size", str(max(4, ranks)), "--training.steps", "1"),
        *("--metrics.peak_tflops", "1", "--job.dump_folder", str(folder)),
    ]
    env = os.environ | {"NGPU": str(ranks), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    if proc.returncode:
        sys.exit(f"{ranks} rank(s) failed (exit {proc.returncode}):\n{out[-3000:]}")

    def gib(pattern: str) -> float:
        m = re.search(pattern, out)
        assert m, (pattern, out[-2000:])
        return float(m.group(1))

    def mib_or_gib(pattern: str) -> float:
        m = re.search(pattern + r" ([\d.]+) (MiB|GiB)", out)
        assert m, (pattern, out[-2000:])
        return float(m.group(1)) / (1024 if m.group(2) == "MiB" else 1)

    return {
        "params": float(re.search(r"model dsv4/\w+: ([\d,]+) parameters", out).group(1).replace(",", "")),
        "state": gib(r"estimated memory per rank: .* = ([\d.]+) GiB"),
        "startup_plan": mib_or_gib(r"start-up peak per rank"),
        "unit": gib(r"largest unsharded FSDP unit ([\d.]+) GiB") if "largest unsharded" in out else 0.0,
        "startup_rss": gib(r"start-up: max RSS per rank: .*\(largest ([\d.]+)\)"),
        "step_rss": gib(r"\] [\d:]+ peak memory \(max RSS\) per rank: .*\(largest ([\d.]+)\)"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2,4", help="comma list of rank counts")
    p.add_argument("--experts", type=int, default=32, help="routed experts (32: 420M parameters; 64: 823M)")
    opts = p.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for n in (int(x) for x in opts.ranks.split(",")):
            rows[n] = run(n, opts.experts, Path(tmp) / f"n{n}")
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if "model name" in line), "?")
    first = rows[min(rows)]
    print(f"dsv4, {first['params']:,.0f} parameters, AdamW, float32; {cpu}")
    print(
        "| ranks | state / rank (plan) | start-up (plan) | start-up max RSS | bound | after 1 step max RSS |"
    )
    print("|---|---|---|---|---|---|")
    one = rows.get(1)
    # The process: a 1-rank start-up less its parameters (a quarter of the AdamW float32 state: 4 of 16 B).
    process = one["startup_rss"] - one["state"] / 4 if one else 0.0
    for n, r in rows.items():
        bound = one["state"] / n + process + r["unit"] if one else float("nan")
        print(
            f"| {n} | {r['state']:.2f} GiB | {r['startup_plan']:.2f} GiB | {r['startup_rss']:.2f} GiB | "
            f"{bound:.2f} GiB | {r['step_rss']:.2f} GiB |"
        )


if __name__ == "__main__":
    main()
