"""Time to the first step, and where start-up's seconds go, as a new user's run pays them: tokenising
(a fresh data cache), the memory plan (its activation measurement), building and filling the model,
the process group, the MFU peak, and the first step; before vs after side by side.

    .venv/bin/python benchmarks/bench_startup.py                        # this tree, every cell
    .venv/bin/python benchmarks/bench_startup.py --before HEAD~3 --json /tmp/startup.json
    .venv/bin/python benchmarks/bench_startup.py --recipes debug_dense_thd.toml --dtypes bfloat16 \
        --procs 2 --isa avx2 --before 019b4b8                          # the 2-process bf16 run that timed out

Cells: recipe x compute dtype (float32, `--training.mixed_precision_param bfloat16`) x processes (1:
one python process; 2: the preflight process, then torchrun, as run_train.sh launches them) x ISA
(native; avx2: ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2, a CPU
without native bf16 matmul). Each run is one step; the trainer runs under a probe (this file with
`--probe`) that times its start-up functions on rank 0. `--before REF` times `git archive REF` in
the same session, before and after each cell in turn (on a shared machine, compare the ratios).

`--dry-run` times instead the Flash dry run of docs/results.md §14 (`COMM_MODE=fake NGPU=8`, cp 8,
ep 8, 65,536 tokens per microbatch, `full` recomputation; `--dry-run-args` adds or replaces flags):
seconds to its header and to its answer, with the activation cache empty and then filled. Its
`--before` side fills every rank's shards of a 24 GiB machine's worth and more: run it only where
they fit.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PHASES = [  # (label, module attribute path in titan_thd.train's namespace)
    ("resolve_run", "resolve_run"),
    ("preflight", "preflight"),
    ("process_group", "dist_utils.init_distributed"),
    ("memory_plan", "plan_memory"),
    ("tokenise", "build_stores"),
    ("build", "build"),
    ("optimizers", "build_optimizers"),
    ("mfu_peak", "peak_tflops_per_rank"),
    ("barriers", "dist_utils.barrier"),
    ("header", "Trainer._log_header"),
]


def probe(argv: list[str]) -> int:
    """Run the trainer (`titan_thd.train.main(argv)`) with its start-up functions timed; rank 0
    prints one `startup-probe {json}` line on stderr: seconds per phase and to the first step's end."""
    t0 = time.perf_counter()
    import titan_thd.train as tr

    times: dict[str, float] = {"import": time.perf_counter() - t0}

    def timed(label, f):
        @functools.wraps(f)
        def g(*a, **k):
            start = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                times[label] = times.get(label, 0.0) + time.perf_counter() - start

        return g

    for label, path in PHASES:
        *owner, name = path.split(".")
        obj = functools.reduce(getattr, owner, tr)
        if hasattr(obj, name):
            setattr(obj, name, timed(label, getattr(obj, name)))
    step = tr.Trainer.train_step

    def first_step(self, *a, **k):
        start = time.perf_counter()
        out = step(self, *a, **k)
        if "first_step" not in times:
            times["first_step"] = time.perf_counter() - start
            times["first_step_end"] = time.time()  # epoch seconds: the bench subtracts its launch
        return out

    tr.Trainer.train_step = first_step
    code = tr.main(argv)
    if os.environ.get("RANK", "0") == "0":
        print("startup-probe " + json.dumps({k: round(v, 2) for k, v in times.items()}), file=sys.stderr)
    return code


def cell(tree: Path, recipe: str, dtype: str, procs: int, isa: str, folder: Path) -> dict:
    """One run of `tree`'s trainer: rank 0's seconds per phase, `preflight_process` (2 ranks) and
    `total`, from the launch to the end of the first step (wall)."""
    args = ["--job.config_file", str(tree / "train_configs" / recipe), "--training.steps", "1"]
    args += ["--job.dump_folder", str(folder), "--metrics.enable_tensorboard", "false"]
    args += ["--training.mixed_precision_param", dtype]
    env = os.environ | {"PYTHONPATH": str(tree), "NGPU": str(procs)} | (AVX2 if isa == "avx2" else {})
    py, me = sys.executable, [str(Path(__file__).resolve()), "--probe"]
    launched, result = time.time(), {}
    if procs > 1:  # run_train.sh: the preflight process (tokenises into the run's cache), then torchrun
        preflight = [py, "-m", "titan_thd.train", *args, "--job.preflight", "true"]
        pre = subprocess.run(preflight, cwd=tree, env=env, capture_output=True, text=True, check=False)
        if pre.returncode:
            return {"error": pre.stderr[-2000:]}
        result["preflight_process"] = round(time.time() - launched, 2)
        launch = [py, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}", *me, *args]
    else:
        launch = [py, *me, *args]
    proc = subprocess.run(launch, cwd=tree, env=env, capture_output=True, text=True, check=False)
    line = next((x for x in proc.stderr.splitlines() if x.startswith("startup-probe ")), None)
    if proc.returncode or line is None or "first_step_end" not in line:
        return result | {
            "error": (proc.stdout + proc.stderr)[-2000:],
            "wall": round(time.time() - launched, 1),
        }
    result |= json.loads(line.removeprefix("startup-probe "))
    result["total"] = round(result.pop("first_step_end") - launched, 2)
    return result


def export(ref: str, tmp: Path) -> Path:
    """`git archive ref` unpacked under `tmp`: the code timed as `before`."""
    before = tmp / "before"
    before.mkdir()
    archive = subprocess.run(["git", "archive", ref], cwd=ROOT, capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(before)], input=archive.stdout, check=True)
    return before


DRY_RUN = ["--job.config_file", "train_configs/dsv4_flash_thd.toml", "--model.flavor", "flash"]
DRY_RUN += ["--parallelism.context_parallel_degree", "8", "--parallelism.expert_parallel_degree", "8"]
DRY_RUN += ["--training.tokens_per_microbatch", "65536", "--activation_checkpoint.mode", "full"]


def dry_run(tree: Path, extra: list[str], cache: Path, folder: Path) -> dict:
    """Seconds from the launch of a fake-process-group dry run (8 ranks) to its header's world line
    (`header`) and to its exit (`answer`), and its CPU seconds."""
    args = [
        *DRY_RUN,
        *extra,
        "--comm.mode",
        "fake",
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(folder),
    ]
    env = os.environ | {"PYTHONPATH": str(tree), "NGPU": "8", "TITAN_THD_CACHE": str(cache)}
    start, header = time.time(), None
    with subprocess.Popen([sys.executable, "-m", "titan_thd.train", *args], cwd=tree, env=env, text=True,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) as proc:  # fmt: skip
        tail = []
        for line in proc.stderr:
            if header is None and "(fake process group)" in line:
                header = time.time() - start
            tail = [*tail[-30:], line]
        code = proc.wait()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {
        "header": None if header is None else round(header, 1),
        "answer": round(time.time() - start, 1),
        "cpu_children": usage.ru_utime + usage.ru_stime,
    }
    return out | ({"error": "".join(tail)[-2000:]} if code else {})


def dry_runs(opts: argparse.Namespace, trees: dict[str, Path], tmp: Path) -> dict:
    rows, extra = {}, opts.dry_run_args.split()
    for name, tree in trees.items():
        cache = tmp / f"cache-{name}"
        for fill in ("cold", "warm"):
            before_cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
            got = dry_run(tree, extra, cache, tmp / f"dry-{name}-{fill}")
            got["cpu"] = round(got.pop("cpu_children") - before_cpu.ru_utime - before_cpu.ru_stime, 1)
            rows[f"{name} {fill}"] = got
            print(json.dumps({f"{name} {fill}": got})[:600], file=sys.stderr, flush=True)
    return rows


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        from titan_thd import exits

        # as the trainer's entry ends (os._exit): a finished multi-rank run can otherwise hit the gloo
        # shutdown race at interpreter exit (exits.py) and end in SIGABRT after its last step
        exits.run_main(lambda: probe(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="debug_dense_thd.toml,dsv4_flash_thd.toml")
    p.add_argument("--dtypes", default="float32,bfloat16", help="training.mixed_precision_param values")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--isa", default="native,avx2")
    p.add_argument("--before", default="", help="a git ref to time beside this tree (git archive)")
    p.add_argument("--after", default=str(ROOT), help="the tree timed as `after` (default: this one)")
    p.add_argument(
        "--repeat", type=int, default=1, help="runs per cell and side (the median, of two the faster)"
    )
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--dry-run", action="store_true", help="time the Flash dry run instead (module doc)")
    p.add_argument("--dry-run-args", default="", help="flags added to the dry run's")
    opts = p.parse_args()
    cpu = next((x.split(":", 1)[1].strip() for x in open("/proc/cpuinfo") if "model name" in x), "?")
    if opts.dry_run:
        with tempfile.TemporaryDirectory() as tmp:
            trees = {"after": Path(opts.after)}
            if opts.before:
                trees = {"before": export(opts.before, Path(tmp)), **trees}
            rows = dry_runs(opts, trees, Path(tmp))
        print(f"Flash dry run, 8 fake ranks (seconds from launch, wall; cpu: process CPU s); {cpu}")
        print("| tree, activation cache | header | answer | cpu |\n|---|---|---|---|")
        for name, r in rows.items():
            print(
                f"| {name} | {r['header']} | {r['answer']}{' (error)' if 'error' in r else ''} | {r['cpu']} |"
            )
        if opts.json:
            Path(opts.json).write_text(json.dumps({"cpu": cpu, "dry_run": rows}, indent=2) + "\n")
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"after": Path(opts.after)}
        if opts.before:
            trees = {"before": export(opts.before, Path(tmp)), "after": Path(opts.after)}
        n = 0
        for recipe in opts.recipes.split(","):
            for dtype in opts.dtypes.split(","):
                for procs in (int(x) for x in opts.procs.split(",")):
                    for isa in opts.isa.split(","):
                        row = {"recipe": recipe, "dtype": dtype, "procs": procs, "isa": isa}
                        runs: dict[str, list[dict]] = {name: [] for name in trees}
                        for _ in range(opts.repeat):  # the sides alternate
                            for name, tree in trees.items():
                                n += 1
                                got = cell(tree, recipe, dtype, procs, isa, Path(tmp) / f"run{n}")
                                runs[name].append(got)
                                print(json.dumps({name: got} | row), file=sys.stderr, flush=True)
                        for name, got in runs.items():  # the median run by its total
                            ok = sorted((r for r in got if "total" in r), key=lambda r: r["total"])
                            row[name] = ok[(len(ok) - 1) // 2] if ok else got[-1]
                            row[name]["totals"] = [r.get("total") for r in got]
                        rows.append(row)
    print(f"time to the first step (launch to the end of step 1, wall s); {cpu}, {os.cpu_count()} CPUs")
    names = list(trees)
    print(
        "| recipe | compute | procs | ISA | "
        + " | ".join(names)
        + " | "
        + " | ".join(f"phases over 1 s ({k})" for k in names)
        + " |"
    )
    print("|---|---|---|---|" + "---|" * 2 * len(names))
    for r in rows:
        figures = [r[k].get("total", float("nan")) if "error" not in r[k] else "error" for k in names]
        cells = " | ".join(f"{f:.1f}" if isinstance(f, float) else f for f in figures)
        phases = " | ".join(
            ", ".join(
                f"{k} {v:.0f}" for k, v in r[t].items() if isinstance(v, float) and v >= 1 and k != "total"
            )
            for t in names
        )
        print(f"| {r['recipe']} | {r['dtype']} | {r['procs']} | {r['isa']} | {cells} | {phases} |")
    if opts.json:
        Path(opts.json).write_text(json.dumps({"cpu": cpu, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
