"""Crash safety of the trainer, measured: faults injected into real runs of both recipes.

    .venv/bin/python dev/fault_injection.py                  # full counts, a table at the end
    .venv/bin/python dev/fault_injection.py --ngpu 2 --kills 10 --save-kills 10 --json out.json

For each recipe (debug_dense_thd.toml, dsv4_flash_thd.toml with the micro flavor, both shrunk to
a few short steps with a checkpoint every `--interval` steps) one uninterrupted reference run,
then:
- SIGKILL at a random moment: the whole process group (torchrun and every rank) is killed at a
  random time within a random step, and the run is resumed; again and again in one folder until
  the run completes (a chain), then in a fresh folder until `--kills` kills;
- SIGKILL during a save: killed at a random moment while a `step-N.tmp-*` folder exists (a save
  in progress, with a complete checkpoint before it), resumed, `--save-kills` times;
- a damaged file of the newest checkpoint (a bit flip or a truncation of a shard, a zeroed DCP
  index, a torn meta.json): the resume must stop with an error naming the folder and the file,
  change nothing, and resume from the checkpoint before it once the folder is moved away;
- a NaN loss, an Inf gradient (on one rank only when --ngpu > 1) and a huge learning rate: the
  run must stop naming the step, before the optimizer step, with the last good checkpoint
  intact (a resume continues bitwise);
- a full disk during a save (the writer of one rank fails with ENOSPC): the run must exit with
  an error naming the checkpoint and errno, keep the previous checkpoints, leave no tmp folder.

After every kill the next run must resume from the newest complete checkpoint, and every record
it writes must equal the reference run's, bit for bit (loss, grad_norm, lr, aux losses, token
counts); metrics.jsonl must hold exactly one whole JSON line per step 1..N; at the end of each
chain TensorBoard (read with tensorboard's EventAccumulator) must hold one value per step.

The NaN / Inf / ENOSPC faults are test-only monkeypatches applied by this script's worker mode,
    python dev/fault_injection.py --worker FAULT [trainer arguments]
FAULT = nan_loss:STEP, inf_grad:STEP[:RANK] or enospc:STEP[:RANK]; the product has no fault hooks.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fault_harness import (  # noqa: E402
    RECIPES,
    Harness,
    Recipe,
    Run,
    compare,
    compare_tb,
    complete_steps,
    digest,
    read_metrics,
    resumed_from,
    tmp_dirs,
    wait_for,
    worker,
)


# ============================================================================ scenarios
@dataclass
class Context:
    h: Harness
    recipe: Recipe
    ref: dict[int, dict]
    step_period: float
    save_time: float
    rng: random.Random
    keep: bool = False
    trials: list[dict] = field(default_factory=list)

    def finish(self, dump: Path) -> None:
        """Drop a judged folder's checkpoints (~80 MB each), unless asked to keep everything."""
        if not self.keep:
            shutil.rmtree(dump / "checkpoint", ignore_errors=True)

    def dump(self, case: str) -> Path:
        base = self.h.workdir / self.recipe.name
        base.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{case}-", dir=base))

    def record(self, **trial: Any) -> dict:
        trial = {"recipe": self.recipe.name, **trial}
        self.trials.append(trial)
        status = "ok " if trial["ok"] else "BAD"
        print(f"  [{status}] {self.recipe.name} {trial['case']}: {trial.get('what', '')}", flush=True)
        for p in trial.get("problems", []):
            print(f"        {p}", flush=True)
        return trial


def reference(h: Harness, recipe: Recipe) -> tuple[dict[int, dict], float, float]:
    dump = h.workdir / recipe.name / "reference"
    shutil.rmtree(dump, ignore_errors=True)
    run = h.launch(recipe, dump)
    rc = run.wait(h.timeout)
    records, problems = read_metrics(dump)
    if rc != 0 or problems or [r["step"] for r in records] != list(range(1, recipe.steps + 1)):
        raise RuntimeError(f"reference run of {recipe.name} failed (rc {rc}):\n{run.text()[-3000:]}")
    saves = [float(x) for x in re.findall(r"checkpoint: saved step \d+ .* in ([\d.]+) s", run.text())]
    period = (records[-1]["wall_time"] - records[0]["wall_time"]) / max(1, len(records) - 1)
    return {r["step"]: r for r in records}, period, sum(saves) / len(saves)


def _after_run(ctx: Context, dump: Path, expect_from: int, run: Run) -> list[str]:
    """What is wrong after a (killed or finished) run that should have resumed from step-`expect_from`."""
    problems = []
    got = resumed_from(run.text())
    want = str(dump / "checkpoint" / f"step-{expect_from}") if expect_from else ""
    if got != want:
        problems.append(f"resumed from {got!r}, expected {want or 'a fresh start'!r}")
    records, torn = read_metrics(dump)
    return problems + torn + compare(records, ctx.ref)


KILL_CASES = {"random": "SIGKILL at a random moment", "save": "SIGKILL during a save"}


def kill_chains(ctx: Context, plan: list[str]) -> None:
    """SIGKILLs of the kinds in `plan` ("random": at a random moment of a random step, "save": at a
    random moment of a save that has a complete checkpoint before it), each followed by a resume
    in the same folder (which may be killed again). A chain ends when a run completes; the next
    starts in a fresh folder."""
    r, plan, attempts = ctx.recipe, list(plan), 0
    limit = 3 * len(plan) + 3  # kills, counting those meant for a save that landed after it
    while plan and attempts < limit:
        dump, pending = ctx.dump("kill"), None
        while True:
            start = complete_steps(dump)
            resume = start[-1] if start else 0
            leftovers = {p.name for p in tmp_dirs(dump)}  # of the killed run: not this run's save
            run = ctx.h.launch(r, dump)
            kind = plan[0] if plan else None
            # The kill point is drawn uniformly over the whole run (a step before the last, or a
            # save with a complete checkpoint before it); one at or before the resume point
            # means no kill: this run completes the chain, the next kill starts a fresh one.
            target = None
            if kind == "save":
                target = ctx.rng.choice(r.saves[1:])
                folder = dump / "checkpoint"

                def saving(target=target, folder=folder, leftovers=leftovers):
                    names = set(os.listdir(folder)) - leftovers if folder.is_dir() else ()
                    return any(p.startswith(f"step-{target}.tmp-") for p in names)

                if target <= resume:
                    target = None
                elif wait_for(saving, run, 0.002, ctx.h.timeout):
                    time.sleep(ctx.rng.uniform(0, ctx.save_time))
            elif kind == "random":
                # After the console line of the step: the kill lands in the next step, a save or
                # a metrics write, never after the end of the run.
                target = ctx.rng.randint(1, r.steps - 1)
                line = re.compile(rf"step +{target} +loss")
                if target <= resume:
                    target = None
                elif wait_for(lambda line=line, run=run: line.search(run.text()), run, 0.01, ctx.h.timeout):
                    time.sleep(ctx.rng.uniform(0, ctx.step_period))
            finished = target is None or run.proc.poll() is not None
            survivors = []
            if finished:
                rc = run.wait(ctx.h.timeout)
            else:
                survivors = run.kill()
            problems = _after_run(ctx, dump, resume, run)
            if pending is not None:  # the previous kill is judged by this run
                pending["problems"] += problems
                ctx.record(**pending, ok=not pending["problems"])
                pending = None
            if finished:
                if rc != 0:
                    ctx.record(
                        case="chain end", ok=False, what=f"run exited {rc}", problems=[run.text()[-2000:]]
                    )
                    break
                records, _ = read_metrics(dump)
                chain = compare(records, ctx.ref, upto=r.steps) + compare_tb(dump, ctx.ref)
                what = f"{dump.name}: metrics.jsonl and TensorBoard vs the reference"
                ctx.record(case="chain end", ok=not chain, what=what, problems=chain)
                break
            attempts += 1
            tmps = [p for p in tmp_dirs(dump) if p.name not in leftovers]
            in_save = bool(tmps) and target not in complete_steps(dump)
            case = KILL_CASES[kind]
            if kind == "random" or in_save:
                plan.pop(0)
            else:  # meant for a save, landed after it: judged as such, and tried again
                case = "SIGKILL just after a save"
            contents = sorted(p.name for p in tmps[0].iterdir()) if tmps else []
            saving_step = tmps[0].name.split(".")[0] if tmps else ""
            records, torn = read_metrics(dump)
            newest = complete_steps(dump)
            pending = {
                "case": case,
                "what": f"killed after step {records[-1]['step'] if records else 0}"
                + (f" in the save of {saving_step} ({', '.join(contents) or 'empty'})" if tmps else "")
                + f"; newest complete: step-{newest[-1] if newest else 0}",
                "in_save": bool(tmps),
                "save_files": contents,
                "problems": [f"after the kill: {t}" for t in torn]
                + ([f"processes {survivors} outlived the kill of their launcher"] if survivors else []),
            }
        ctx.finish(dump)


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


DAMAGE = {  # kind: (what, file of the newest checkpoint, what is done to its bytes)
    "flip": ("a bit flip in", "__0_0.distcp", lambda b: _flip(b, len(b) // 2)),
    "truncate": ("half of", "__0_0.distcp", lambda b: b[: len(b) // 2]),
    "zero": ("zeros over", ".metadata", lambda b: bytes(len(b))),
    "tear": ("40 bytes of", "meta.json", lambda b: b[:40]),
    "flip1": ("a bit flip in", "__1_0.distcp", lambda b: _flip(b, 100)),
}


def damaged_checkpoint(ctx: Context, kind: str, recover: bool = True) -> None:
    """Copy the reference's two newest checkpoints, damage one file of the newest, resume."""
    r = ctx.recipe
    dump = ctx.dump("damaged")
    src = ctx.h.workdir / r.name / "reference"
    newest, previous = r.saves[-1], r.saves[-2]
    for s in (previous, newest):
        shutil.copytree(src / "checkpoint" / f"step-{s}", dump / "checkpoint" / f"step-{s}")
    shutil.copy(src / "metrics.jsonl", dump / "metrics.jsonl")
    shutil.copytree(src / "tb", dump / "tb")
    folder = dump / "checkpoint" / f"step-{newest}"
    what, name, damage = DAMAGE[kind]
    (folder / name).write_bytes(damage((folder / name).read_bytes()))
    before, metrics = digest(folder), (dump / "metrics.jsonl").read_bytes()
    run = ctx.h.launch(r, dump)
    rc = run.wait(ctx.h.timeout)
    log, problems = run.text(), []
    if rc == 0 or rc is None:
        problems.append(f"exit status {rc}, expected an error")
    if f"checkpoint {folder} is damaged" not in log or name not in log:
        problems.append("no error naming the folder and the file: " + log[-1500:])
    if "nothing to resume" in log or "resumed from" in log:
        problems.append("it loaded something or started afresh")
    if not folder.is_dir() or digest(folder) != before or (dump / "metrics.jsonl").read_bytes() != metrics:
        problems.append("the damaged folder or metrics.jsonl changed")
    message = next((line for line in log.splitlines() if "is damaged" in line), "")
    if recover and not problems:  # what the message says to do
        moved = folder.with_name(folder.name + ".damaged")
        os.rename(folder, moved)
        run = ctx.h.launch(r, dump)
        rc = run.wait(ctx.h.timeout)
        problems += [f"after moving it away: exit {rc}"] if rc != 0 else []
        problems += _after_run(ctx, dump, previous, run)
        problems += compare(read_metrics(dump)[0], ctx.ref, upto=r.steps) + compare_tb(dump, ctx.ref)
        if digest(moved) != before:
            problems.append("the damaged folder changed after the resume")
    what = f"{what} {name}: {message.strip()[:200]}"
    ctx.record(case="damaged checkpoint file", ok=not problems, what=what, kind=kind, problems=problems)
    ctx.finish(dump)


def bad_step(
    ctx: Context,
    fault: str | None,
    rank: int | None = None,
    extra: tuple[str, ...] = (),
    recover: bool = True,
) -> None:
    """`fault` (nan_loss, inf_grad) at a random step after the first checkpoint, on `rank` (None:
    every rank); or no fault and `extra` config that diverges."""
    r = ctx.recipe
    dump = ctx.dump("nonfinite")
    step = ctx.rng.randint(r.saves[0] + 1, r.steps)
    spec = f"{fault}:{step}" + ("" if rank is None else f":{rank}") if fault else None
    run = ctx.h.launch(r, dump, fault=spec, extra=extra)
    rc = run.wait(ctx.h.timeout)
    log, problems = run.text(), []
    m = re.search(r"step (\d+): not finite: ([^.]*)", log)
    if rc in (0, None) or m is None:
        problems.append(f"exit status {rc}, message {m and m.group(0)!r}: " + log[-1500:])
    else:
        step = int(m.group(1))
    kept = complete_steps(dump)
    if kept != [s for s in r.saves if s < step] and fault is not None:
        problems.append(f"checkpoints {kept}, expected the saves before step {step}")
    if not kept or kept[-1] >= step or tmp_dirs(dump):
        problems.append(f"checkpoints {kept}, tmp folders {tmp_dirs(dump)}")
    records, torn = read_metrics(dump)
    if fault is not None:
        problems += torn + compare(records, ctx.ref, upto=step - 1)
    if recover and fault is not None and not problems:  # the last good checkpoint continues bitwise
        run = ctx.h.launch(r, dump)
        rc = run.wait(ctx.h.timeout)
        problems += [f"resume: exit {rc}"] if rc != 0 else []
        problems += _after_run(ctx, dump, kept[-1], run)
        problems += compare(read_metrics(dump)[0], ctx.ref, upto=r.steps)
    name = (fault + ("" if rank is None else f" on rank {rank}")) if fault else " ".join(extra)
    what = f"{name} at step {step}: " + (m.group(0)[:120] if m else "no message")
    ctx.record(case="NaN/Inf loss or gradient", ok=not problems, what=what, fault=name, problems=problems)
    ctx.finish(dump)


def full_disk(ctx: Context, rank: int, recover: bool = True) -> None:
    r = ctx.recipe
    dump = ctx.dump("full-disk")
    step = ctx.rng.choice(r.saves[1:])
    run = ctx.h.launch(r, dump, fault=f"enospc:{step}:{rank}")
    rc = run.wait(ctx.h.timeout)
    log, problems = run.text(), []
    # The errno shows when DCP writes tensor bytes; a failing torch.save of an object (a rank's
    # first file item) reports the serializer's "unexpected pos" instead, with the free space.
    want = f"saving step {step} to {dump / 'checkpoint' / f'step-{step}'} failed: rank {rank}: "
    if rc in (0, None) or want not in log:
        problems.append(f"exit status {rc}, no message {want!r}: " + log[-1500:])
    kept = complete_steps(dump)
    if kept != [s for s in r.saves if s < step] or tmp_dirs(dump):
        problems.append(f"checkpoints {kept}, tmp folders {tmp_dirs(dump)}")
    records, torn = read_metrics(dump)
    problems += torn + compare(records, ctx.ref, upto=step)
    if recover and not problems:
        run = ctx.h.launch(r, dump)
        rc = run.wait(ctx.h.timeout)
        problems += [f"resume: exit {rc}"] if rc != 0 else []
        problems += _after_run(ctx, dump, kept[-1], run) + compare(
            read_metrics(dump)[0], ctx.ref, upto=r.steps
        )
    message = next((line for line in log.splitlines() if want in line), "")
    what = f"ENOSPC on rank {rank} in the save of step {step}: {message.strip()[:200]}"
    ctx.record(case="full disk during a save", ok=not problems, what=what, rank=rank, problems=problems)
    ctx.finish(dump)


def run_recipe(h: Harness, recipe: Recipe, args: argparse.Namespace, rng: random.Random) -> list[dict]:
    print(
        f"{recipe.name}: reference run ({recipe.steps} steps, checkpoint every {recipe.interval})", flush=True
    )
    ref, period, save_time = reference(h, recipe)
    ctx = Context(h, recipe, ref, period, save_time, rng, keep=args.workdir is not None)
    print(f"{recipe.name}: {period:.2f} s per step, {save_time:.2f} s per save", flush=True)
    cases = args.cases.split(",")
    if "kill" in cases:
        kill_chains(ctx, ["random"] * args.kills)
    if "save-kill" in cases:
        kill_chains(ctx, ["save"] * args.save_kills)
    if "mixed" in cases:  # one of each in one chain (the short version for tests)
        kill_chains(ctx, ["random", "save"])
    if "damage" in cases:
        kinds = [k for k in args.damage.split(",") if k != "flip1" or h.ngpu > 1]
        for kind in kinds:
            damaged_checkpoint(ctx, kind, recover=args.recover)
    if "nan" in cases:
        bad_step(ctx, "nan_loss", recover=args.recover)
    if "inf" in cases:  # on the last rank only: every rank must stop
        bad_step(ctx, "inf_grad", rank=h.ngpu - 1, recover=args.recover)
    if "lr" in cases:
        bad_step(ctx, None, extra=("--optimizer.lr", "1e30", "--checkpoint.interval", "1"), recover=False)
    if "enospc" in cases:
        for rank in sorted({0, h.ngpu - 1}):
            full_disk(ctx, rank, recover=args.recover)
    return ctx.trials


CASES = ("kill", "save-kill", "mixed", "damage", "nan", "inf", "lr", "enospc")


# ============================================================================ report
def table(trials: list[dict]) -> list[dict]:
    rows = []
    for recipe in dict.fromkeys(t["recipe"] for t in trials):
        for case in dict.fromkeys(t["case"] for t in trials if t["recipe"] == recipe):
            sel = [t for t in trials if t["recipe"] == recipe and t["case"] == case]
            rows.append({"recipe": recipe, "case": case, "trials": len(sel), "ok": sum(t["ok"] for t in sel)})
    return rows


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        return worker(argv[1], argv[2:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--recipes", default="dense,dsv4", help="comma-separated: dense, dsv4")
    p.add_argument("--ngpu", type=int, default=2, help="processes per run (DP degree)")
    p.add_argument("--kills", type=int, default=10, help="SIGKILLs at a random moment, per recipe")
    p.add_argument("--save-kills", type=int, default=10, help="SIGKILLs during a save, per recipe")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--interval", type=int, default=2)
    p.add_argument(
        "--damage", default=",".join(DAMAGE), help="comma-separated damage kinds (flip1: NGPU > 1)"
    )
    default = ",".join(c for c in CASES if c != "mixed")
    p.add_argument("--cases", default=default, help=f"comma-separated, of {', '.join(CASES)}")
    p.add_argument("--no-recover", dest="recover", action="store_false", help="skip the resumes after faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", type=Path, default=None, help="kept (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None, help="write the counts and every trial here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    rng = random.Random(args.seed)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="fault_injection-"))
    h = Harness(workdir, args.ngpu)
    trials = []
    for name in args.recipes.split(","):
        recipe = RECIPES[name]
        recipe.steps, recipe.interval = args.steps, args.interval
        trials += run_recipe(h, recipe, args, rng)
    rows = table(trials)
    wall = time.perf_counter() - start
    print(f"\n{'recipe':<7} {'case':<40} {'trials':>6} {'ok':>4}")
    for row in rows:
        print(f"{row['recipe']:<7} {row['case']:<40} {row['trials']:>6} {row['ok']:>4}")
    print(f"{h.runs} trainer runs, NGPU={args.ngpu}, {wall:.0f} s")
    if args.json:
        args.json.write_text(
            json.dumps(
                {"argv": argv, "ngpu": args.ngpu, "wall_s": wall, "rows": rows, "trials": trials}, indent=1
            )
        )
    if args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0 if all(t["ok"] for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
