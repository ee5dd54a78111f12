"""A LoRA run's frozen base kept as released (`--lora.base_dtype released`, models/packed_weight.py) against
the same base dequantised into float32 on load (`master`, the default): peak RSS, time to the first
step, step time and bytes read per rank, and the losses of both, on one process and on 4 ranks.

    .venv/bin/python benchmarks/bench_resident.py --json /tmp/resident.json
    .venv/bin/python benchmarks/bench_resident.py --layouts np1 --steps 4 --compute float32

The base: a dsv4 model whose parameters are mostly routed experts, as in Flash (`--dim`, `--experts`,
`--expert-width`, `--layers`; the defaults give 264M parameters, 95% of them in experts), drawn
from `--seed` and written once in DeepSeek's V4 release format to a temporary folder: the attention,
shared-expert, compressor and indexer matrices as FP8 e4m3 with power-of-two 128 x 128 block scales
(`<m>.scale`, float8_e8m0fnu), the routed experts one tensor per expert as packed FP4 e2m1 (int8
[out, in / 2], low nibble first) with 1 x 32 e8m0 scales, several safetensors files and their index,
config.json with DeepSeek's `compress_ratios` and `quantization_config`; embedding, head, router,
norms and mHC stay float32, as released. The quantiser is the export's (models/hf/quant.py `encode`,
vectorised: tests/models/dsv4/_release.py's per-block loop takes minutes at this size);
models/dsv4/hf_dequant.py reads it back.

Each run is the dsv4_flash_lora.toml recipe on that folder (its chat SFT documents, same seed and
steps), LoRA rank 16 on attention and routed experts, AdamW, float32 master weights, compute in
`--compute` (`--training.mixed_precision_param`), no compile: per layout (np1: one process; fsdp4:
4 ranks, FSDP 4; ep4: 4 ranks, EP 4 over FSDP 4) master then released. A warm-up step first fills
the data cache (and the activation measurements' cache, where the memory plan measures) that every
timed run then reads, so that time to the first step is the model's start-up, not tokenising. Both
bases read the same stored bytes (master dequantises them on load); released replicates what FSDP
would shard. A run that fails is a row of the table with its first error line; the others go on.

Each rank runs under a probe (this file with `--probe`) that records, per rank: VmHWM before the
first step and at the end (peak RSS), seconds from the launch (python or torchrun) to the end of the
first step, each step's seconds and loss, the seconds spent in `PackedWeight.dense` (the per-use
dequantisation) per step, and the trainer's "loaded N tensors, read X of the folder's Y MB" line.
Step time: the median of the steps after the first. The ranks share the machine's cores (`OMP_NUM_THREADS` = `--threads` / ranks, at least 1), as
on a CPU box. On a machine shared with other work pass `--threads 1`: a process with 2 OMP threads
whose second core is busy elsewhere waits at every parallel region (here one 7M-parameter step took
0.6 to 30 s with 2 threads as the other work came and went).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_thd.components.hardware import cpu_model_name  # noqa: E402
from titan_thd.models.hf.quant import Format, encode, stored  # noqa: E402

RECIPE = ROOT / "train_configs" / "dsv4_flash_lora.toml"
TARGETS = "attention,experts"
LAYOUTS = {  # name: (processes, extra flags)
    "np1": (1, []),
    "fsdp4": (4, []),
    "ep4": (4, ["--parallelism.expert_parallel_degree", "4"]),
}
LOADED = re.compile(r"loaded (\d+) tensors, read ([\d.]+) of the folder's ([\d.]+) MB")
# run_train.sh's allocator settings (TITAN_THD_MALLOC=reuse on one process, glibc's on several): the
# RSS of a run here is the RSS of the same run launched by it.
REUSE = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "1099511627776"}


# ============================================================================ the release-format folder
def quantize_fp8(w: torch.Tensor, bm: int = 128, bn: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes [O, I], power-of-two scale grid [ceil(O / bm), ceil(I / bn)] as float8_e8m0fnu):
    the export's encoder (models/hf/quant.py `encode`)."""
    codes, exps = encode(w, Format("fp8", (bm, bn), 1))
    return stored(codes, exps, torch.float8_e4m3fn, torch.float8_e8m0fnu)


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 codes int8 [O, I / 2], two per byte low nibble first; e8m0 scales [O, I / 32])."""
    codes, exps = encode(w, Format("fp4", (1, 32), 1))
    return stored(codes, exps, torch.int8, torch.float8_e8m0fnu)


def model_args(opts):
    """The benchmark's dsv4 architecture: the tiny flavor at `--dim` with many wide routed experts."""
    import dataclasses

    from titan_thd.data.tokenizer import build_tokenizer
    from titan_thd.models.dsv4 import flavors

    vocab = -(-build_tokenizer("byte").vocab_size // 64) * 64  # what the trainer gives the recipe
    layers = ("sliding", "csa", "hca", "csa", "hca", "csa")[: opts.layers]
    return dataclasses.replace(
        flavors["tiny"], vocab_size=vocab, dim=opts.dim, layer_types=layers, n_hash_layers=1,
        n_experts=opts.experts, n_activated_experts=2, moe_inter_dim=opts.expert_width,
        q_lora_rank=256, o_lora_rank=128,
    )  # fmt: skip


def release_config(args) -> dict:
    """config.json in DeepSeek's spelling: compress_ratios (the main layers', then the MTP layer's 0)
    instead of transformers' layer_types, and the release's quantization_config."""
    from titan_thd.models.dsv4.hf_config import hf_config_from_args

    cfg = hf_config_from_args(args)
    del cfg["layer_types"], cfg["compress_rates"]
    ratio = {"sliding": 0, "csa": args.csa_ratio, "hca": args.hca_ratio}
    cfg["compress_ratios"] = [ratio[t] for t in args.layer_types] + [0]
    cfg["compress_rate_csa"], cfg["compress_rate_hca"] = args.csa_ratio, args.hca_ratio
    cfg["quantization_config"] = {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"
    }  # fmt: skip
    return cfg


def write_release(opts, out: Path) -> dict:
    """The seeded model in the release format under `out`; what it holds."""
    from titan_thd.models.dsv4 import build_dsv4
    from titan_thd.models.dsv4.hf_names import reference_items
    from titan_thd.models.hf.write import ShardedWriter

    args = model_args(opts)
    torch.manual_seed(opts.seed)
    model = build_dsv4(args)
    out.mkdir(parents=True)
    writer = ShardedWriter(out, opts.shard_mb * 10**6)
    params, experts = sum(p.numel() for p in model.parameters()), 0
    for ours, value in model.state_dict().items():
        for key, w in reference_items(ours, value.detach()):  # an expert stack one expert at a time
            linear = key.endswith(".weight") and w.dim() == 2 and not key.endswith("ffn.gate.weight")
            if not linear or key in ("embed.weight", "head.weight"):
                writer.add(key, w.contiguous())
            elif ".experts." in key:
                experts += w.numel()
                packed, scale = quantize_fp4(w)
                writer.add(key, packed)
                writer.add(key.removesuffix("weight") + "scale", scale)
            else:
                codes, grid = quantize_fp8(w)
                writer.add(key, codes)
                writer.add(key.removesuffix("weight") + "scale", grid)
    files = writer.close()
    (out / "config.json").write_text(json.dumps(release_config(args)))
    size = sum(f.stat().st_size for f in files)
    return {"params": params, "expert_params": experts, "files": len(files), "folder_mb": size / 1e6}


# ============================================================================ one rank (the probe)
def vm_hwm_gib() -> float:
    """This process's peak resident set (VmHWM), GiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 2**30
    raise RuntimeError("no VmHWM in /proc/self/status")


def probe(argv: list[str]) -> int:
    """Run the trainer (`titan_thd.train.main(argv)`) with its steps and its dequantisation timed;
    each rank writes `$BENCH_OUT/rank<r>.json` (module doc)."""
    import titan_thd.train as tr
    from titan_thd.models import packed_weight

    launched = float(os.environ["BENCH_LAUNCH"])
    rank = int(os.environ.get("RANK", "0"))
    rec: dict = {"rank": rank, "step_s": [], "loss": [], "dequant_s": []}
    dequant = [0.0]

    class Loaded(logging.Handler):  # this rank's own load line (torchrun mixes the ranks' output)
        def emit(self, record: logging.LogRecord) -> None:
            m = LOADED.search(record.getMessage())
            if m:
                rec["tensors"], rec["read_mb"], rec["folder_mb"] = int(m[1]), float(m[2]), float(m[3])

    logging.getLogger("titan_thd").addHandler(Loaded())
    dense = packed_weight.PackedWeight.dense

    def timed_dense(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return dense(self, *a, **k)
        finally:
            dequant[0] += time.perf_counter() - t0

    packed_weight.PackedWeight.dense = timed_dense
    step = tr.Trainer.train_step

    def timed_step(self, *a, **k):
        if not rec["step_s"]:
            rec["startup_rss_gib"] = vm_hwm_gib()
        d0, t0 = dequant[0], time.perf_counter()
        out = step(self, *a, **k)
        rec["step_s"].append(time.perf_counter() - t0)
        rec["dequant_s"].append(dequant[0] - d0)
        rec["loss"].append(float(out["loss"]))
        if len(rec["step_s"]) == 1:
            rec["first_step_end_s"] = time.time() - launched
        return out

    tr.Trainer.train_step = timed_step
    code = tr.main(argv)
    rec["peak_rss_gib"] = vm_hwm_gib()
    (Path(os.environ["BENCH_OUT"]) / f"rank{rank}.json").write_text(json.dumps(rec))
    return code


# ============================================================================ one run
def trainer_args(opts, folder: Path, mode: str, dump: Path, steps: int) -> list[str]:
    return [
        "--job.config_file", str(RECIPE), "--model.hf_path", str(folder), "--job.dump_folder", str(dump),
        "--lora.targets", TARGETS, "--lora.rank", "16", "--lora.base_dtype", mode,
        "--training.steps", str(steps), "--training.compile", "false",
        "--training.mixed_precision_param", opts.compute, "--data.cache_dir", str(dump.parent / "data"),
        "--metrics.enable_tensorboard", "false", "--metrics.overwrite", "true",
        "--metrics.peak_tflops", "1",  # MFU's peak is not measured: not part of what is compared
    ]  # fmt: skip


def run(opts, folder: Path, mode: str, layout: str, tmp: Path, steps: int) -> dict:
    """One run under the probe: its `summary`, or {"error": the first error line} when it failed."""
    procs, extra = LAYOUTS[layout]
    dump = tmp / f"{layout}-{mode}-{time.monotonic_ns()}"
    out = dump / "probe"
    out.mkdir(parents=True)
    me = [str(Path(__file__).resolve()), "--probe"]
    if procs > 1:
        me = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *me]
    env = os.environ | {
        "OMP_NUM_THREADS": str(max(1, opts.threads // procs)),
        "TITAN_THD_CACHE": str(tmp / "cache"),
        "BENCH_OUT": str(out),
        "BENCH_LAUNCH": repr(time.time()),
    }
    env |= REUSE if procs == 1 else {}
    argv = [sys.executable, *me, *trainer_args(opts, folder, mode, dump, steps), *extra]
    proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    got = sorted((json.loads(p.read_text()) for p in out.glob("rank*.json")), key=lambda r: r["rank"])
    shutil.rmtree(dump)
    if proc.returncode or len(got) != procs:  # reported in the table; the other runs go on
        text = proc.stdout + proc.stderr
        print(f"{layout} {mode}: exit {proc.returncode}\n{text[-3000:]}", file=sys.stderr, flush=True)
        errors = [x for x in text.splitlines() if "Error" in x] or text.splitlines()[-1:]
        return {"error": errors[0].strip()[:300]}
    return summary(got)


def summary(ranks: list[dict]) -> dict:
    per = [
        {
            "startup_rss_gib": r["startup_rss_gib"],
            "peak_rss_gib": r["peak_rss_gib"],
            "first_step_end_s": r["first_step_end_s"],
            "step_s": statistics.median(r["step_s"][1:] or r["step_s"]),  # a 1-step run: that step
            "dequant_s": statistics.median(r["dequant_s"][1:] or r["dequant_s"]),
            "read_mb": r["read_mb"],
        }
        for r in ranks
    ]
    return {"ranks": per, "loss": ranks[0]["loss"], "folder_mb": ranks[0]["folder_mb"]}


# ============================================================================ main
def machine() -> str:
    flags = next(
        (set(x.split(":", 1)[1].split()) for x in open("/proc/cpuinfo") if x.startswith("flags")), set()
    )
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in flags]
    return (
        f"{cpu_model_name()}, {os.cpu_count()} CPUs, {', '.join(isa) or 'no AVX-512 / AMX'}"
        f"{'' if any(f.startswith('amx') for f in flags) else ', no AMX'}; torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )


def rel_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b, strict=True))


def report(opts, runs: dict[str, dict]) -> None:
    """The per-rank table, released / master per layout, and the losses against the first run's."""
    print(
        f"\nLoRA rank 16 on {TARGETS}, AdamW, float32 master, {opts.compute} compute, {opts.steps} steps of "
        "dsv4_flash_lora.toml's documents; per rank: peak RSS (VmHWM) before the first step / at the end, "
        "seconds from launch to the end of step 1, median step s (steps 2+) and the dequantisation s in "
        "it, MB read from the folder"
    )
    print(
        "| layout | base | rank | start-up RSS GiB | peak RSS GiB | to step 1 s | step s | dequant s | read MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name, r in runs.items():
        layout, mode = name.split()
        if "error" in r:
            print(f"| {layout} | {mode} | all | failed: {r['error']} | | | | | |")
            continue
        for i, k in enumerate(r["ranks"]):
            print(
                f"| {layout} | {mode} | {i} | {k['startup_rss_gib']:.2f} | {k['peak_rss_gib']:.2f} | "
                f"{k['first_step_end_s']:.1f} | {k['step_s']:.2f} | {k['dequant_s']:.2f} | {k['read_mb']:.1f} |"
            )
    print("\nreleased / master (the largest rank's figures; loss: max relative difference over the steps)")
    print("| layout | start-up RSS | peak RSS | to step 1 | step time | read MB | loss rel. diff |")
    print("|---|---|---|---|---|---|---|")
    for layout in opts.layouts.split(","):
        m, r = runs[f"{layout} master"], runs[f"{layout} released"]
        if "error" in m or "error" in r:
            print(f"| {layout} | a run failed | | | | | |")
            continue
        cells = [
            f"{max(x[key] for x in r['ranks']) / max(x[key] for x in m['ranks']):.2f}"
            for key in ("startup_rss_gib", "peak_rss_gib", "first_step_end_s", "step_s", "read_mb")
        ]
        print(f"| {layout} | {' | '.join(cells)} | {rel_diff(r['loss'], m['loss']):.1e} |")
    ok = {name: r for name, r in runs.items() if "error" not in r}
    if ok:
        first, base = next(iter(ok.items()))
        print(f"\nlosses per step on {first}: " + ", ".join(f"{v:.6f}" for v in base["loss"]))
        for name, r in ok.items():
            print(f"  {name:<16} max relative difference to it {rel_diff(r['loss'], base['loss']):.1e}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        from titan_thd import exits

        exits.run_main(lambda: probe(sys.argv[2:]))  # ends with os._exit, as the trainer's entry does
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layouts", default="np1,fsdp4,ep4", help=f"of {', '.join(LAYOUTS)}")
    p.add_argument("--steps", type=int, default=5, help="steps per run (the first is not in the median)")
    p.add_argument("--compute", default="bfloat16", help="training.mixed_precision_param (or float32)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="per run: threads // processes per rank (>= 1)",
    )
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--layers", type=int, default=4, help="main layers, up to 6 (+ the MTP layer)")
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--expert-width", dest="expert_width", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard-mb", dest="shard_mb", type=int, default=50, help="bytes per safetensors file")
    p.add_argument("--json", default="")
    opts = p.parse_args()
    result: dict = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "opts": vars(opts)}
    print(result["machine"], flush=True)
    runs: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        result["folder"] = write_release(opts, tmp / "release")
        f = result["folder"]
        print(
            f"release folder: {f['params'] / 1e6:.0f}M parameters ({f['expert_params'] / 1e6:.0f}M in routed "
            f"experts), {f['files']} files, {f['folder_mb']:.0f} MB, written in {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
        run(opts, tmp / "release", "master", "np1", tmp, 1)  # the warm-up: fills the caches
        for layout in opts.layouts.split(","):
            for mode in ("master", "released"):
                t0 = time.perf_counter()
                runs[f"{layout} {mode}"] = run(opts, tmp / "release", mode, layout, tmp, opts.steps)
                print(f"{layout} {mode}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    result["runs"] = runs
    report(opts, runs)
    print(f"\n{result['machine']}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
