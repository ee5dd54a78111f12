"""Precision side by side: float32, mixed bf16 (float32 master, bf16 compute) and pure bf16 on the
recipes, on the machine at hand.

Each round trains every variant for `--steps` steps of the recipe (same seed, same data: the losses
compare step by step), one after the other, `--rounds` times (A B C A B C: load on a shared machine
hits all variants alike). Per variant the table shows the median over the steps after `--skip` of
every round: tokens/s (real tokens), step time and its split (time/forward_backward, time/comm,
time/optimizer, time/data from metrics.jsonl), the loss of the last step and the largest relative
difference of its per-step losses from the float32 run's. The header names the CPU and whether
bf16 matmuls are native or emulated (components/hardware.py).

    .venv/bin/python benchmarks/bench_precision.py --json /tmp/bench_precision.json
    .venv/bin/python benchmarks/bench_precision.py --recipes dsv4_flash_thd.toml --steps 8 --avx2
    (--avx2: imitate an AVX2-only CPU, where oneDNN emulates bf16: ATEN_CPU_CAPABILITY=avx2 ...)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {
    "float32": ["--training.dtype", "float32", "--training.mixed_precision_param", "float32"],
    "mixed bf16": ["--training.dtype", "float32", "--training.mixed_precision_param", "bfloat16"],
    "pure bf16": ["--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16"],
}
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PHASES = ("forward_backward", "comm", "optimizer", "data")


def run(
    recipe: str, variant: str, steps: int, threads: int, env_extra: dict, folder: Path, extra: list[str]
) -> list[dict]:
    args = [
        sys.executable, "-m", "titan_thd.train", "--job.config_file", str(ROOT / "train_configs" / recipe),
        "--training.steps", str(steps), "--job.dump_folder", str(folder), "--metrics.enable_tensorboard", "false",
        "--metrics.log_freq", str(steps), *extra, *VARIANTS[variant],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **env_extra}
    out = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{recipe} {variant} failed:\n{out.stderr[-3000:]}")
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def median(records: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in records if key in r)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", nargs="+", default=["debug_dense_thd.toml", "dsv4_flash_thd.toml"])
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2, help="first steps of every run left out (start-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of the training process")
    ap.add_argument("--avx2", action="store_true", help="imitate an AVX2-only CPU (bf16 emulated)")
    ap.add_argument("--json", default="", help="write the report here")
    ap.add_argument(
        "--set", default="", help="config overrides for every run, e.g. '--training.global_batch_size 4'"
    )
    opts = ap.parse_args(argv)

    import torch

    from titan_thd.components import hardware

    env_extra = AVX2_ENV if opts.avx2 else {}
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; from titan_thd.components import hardware as h; "
         "print(h.detect(torch.device('cpu')).describe())"],
        cwd=ROOT, env={**os.environ, **env_extra}, capture_output=True, text=True, check=True,
    )  # fmt: skip
    machine = probe.stdout.strip()
    print(f"# {machine}; torch {torch.__version__}; {opts.threads} threads; {hardware.cpu_model_name()}")
    report = {
        "machine": machine,
        "cpu": hardware.cpu_model_name(),
        "avx2_emulation": opts.avx2,
        "overrides": opts.set,
        "rows": [],
    }
    for recipe in opts.recipes:
        records: dict[str, list[list[dict]]] = {v: [] for v in opts.variants}
        with tempfile.TemporaryDirectory() as tmp:
            for r in range(opts.rounds):
                for v in opts.variants:
                    folder = Path(tmp) / f"{v.replace(' ', '_')}_{r}"
                    records[v].append(
                        run(recipe, v, opts.steps, opts.threads, env_extra, folder, opts.set.split())
                    )
        reference = records.get("float32", [None])[0]
        print(
            f"\n{recipe} {opts.set}, {opts.steps} steps x {opts.rounds} rounds (medians of steps > {opts.skip})"
        )
        head = f"{'variant':<11} {'tokens/s':>9} {'step s':>7} " + " ".join(f"{p:>16}" for p in PHASES)
        print(head + f" {'last loss':>9} {'max |dloss|/loss vs fp32':>24}")
        for v in opts.variants:
            steady = [rec for run_ in records[v] for rec in run_ if rec["step"] > opts.skip]
            losses = records[v][0]
            drift = (
                max(abs(a["loss"] - b["loss"]) / abs(b["loss"]) for a, b in zip(losses, reference))
                if reference is not None
                else float("nan")
            )
            row = {
                "recipe": recipe,
                "variant": v,
                "tokens_per_s": median(steady, "tps"),
                "step_time_s": median(steady, "step_time"),
                **{f"time/{p}": median(steady, f"time/{p}") for p in PHASES},
                "last_loss": losses[-1]["loss"],
                "losses": [rec["loss"] for rec in losses],
                "max_rel_loss_diff_vs_float32": drift,
            }
            report["rows"].append(row)
            phases = " ".join(f"{row[f'time/{p}']:>16.3f}" for p in PHASES)
            print(
                f"{v:<11} {row['tokens_per_s']:>9.0f} {row['step_time_s']:>7.2f} {phases} "
                f"{row['last_loss']:>9.4f} {drift:>24.2e}"
            )
    if opts.json:
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
