"""titan_thd's dsv4 vs transformers' DeepseekV4ForCausalLM (eager): forward+backward real tokens/s.

    .venv/bin/python benchmarks/bench_dsv4_vs_hf.py --json /tmp/dsv4_vs_hf.json      (needs the `hf` extra)

Both sides run the same weights (titan_thd builds the model, `export_hf` writes it, both load that
directory) on the same documents, in `--dtype` (float32 or bfloat16, parameters and compute alike):
- titan_thd: the documents of a microbatch (up to T tokens) packed into one THD stream that ends
  after its last document, as the trainer packs them (data.trim_padding), training mode, one backward;
- transformers: the same documents one at a time ([1, L], no padding, the obvious alternative since
  its model is not document-aware), training mode, one backward per document.
`--work lm` (the default) makes the work equal: both sides compute the LM cross-entropy only
(titan_thd with mtp_loss_weight = indexer_loss_coeff = 0; transformers has neither term).
`--work full` gives titan_thd its training losses (LM + MTP + the indexer KL), more work than
transformers does: the table then says so. A step is forward + backward (no optimizer).
Configurations: `tiny` (vocab 320, the byte tokenizer size) and `wide` (d = 1024, three layers:
sliding, CSA, HCA); document-length distributions: `short` (chat-like, lognormal median ~300) and
`long` (~4k). Every (configuration, distribution, side) runs in its own process, so that its peak
RSS (ru_maxrss) is its own; `--rounds` alternates the processes and keeps each one's fastest round
(on a shared machine other load only ever adds time).

Counted on each side, after its timed steps: the FLOPs of a step (torch's FlopCounterMode, with a
formula for `_grouped_mm`), so MFU = those FLOPs / step time / the matmul peak measured here (a
large matmul in `--dtype` at the same thread count); the matmul share of the step (torch.profiler:
self CPU time of the matrix-product ops over all ops); and with `--breakdown` the forward+backward
time, FLOPs and MFU of every module kind (attention, MoE, mHC; titan_thd also each block, the MTP
block and the LM head), replayed on the inputs captured during one step. The main LM losses of the
two sides are compared (mean per trained token). `--compile` adds the side `compiled`: titan_thd
with training.compile (regional torch.compile, docs/dsv4.md §18); its first step, which compiles
(cold: an empty inductor cache), is reported as `compiled_first_step_s` (the warm-up keeps it out
of the timed steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode, register_flop_formula

# A `--before` child imports titan_thd from the older checkout it names (--code-root).
_ROOT = Path(__file__).resolve().parents[1]
if "--code-root" in sys.argv:
    _ROOT = Path(sys.argv[sys.argv.index("--code-root") + 1]).resolve()
sys.path.insert(0, str(_ROOT))

from titan_thd.data.batch_meta import BatchMeta  # noqa: E402
from titan_thd.data.packed_batch import IGNORE_INDEX  # noqa: E402
from titan_thd.data.packer import pack_microbatch  # noqa: E402
from titan_thd.data.rows import RowRule  # noqa: E402
from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors, flops_per_step, load_hf  # noqa: E402

VOCAB = 320
CONFIGS = {
    "tiny": dataclasses.replace(flavors["tiny"], vocab_size=VOCAB),
    "wide": dataclasses.replace(
        flavors["tiny"],
        vocab_size=VOCAB,
        dim=1024,
        layer_types=("sliding", "csa", "hca"),
        n_hash_layers=1,
        n_heads=16,
        q_lora_rank=512,
        o_groups=4,
        o_lora_rank=256,
        moe_inter_dim=1024,
    ),
}
DISTS = {
    # name: (median length, lognormal sigma, min, max); max <= the T of the distribution
    "short": (300, 0.6, 16, 2048),
    "long": (4000, 0.3, 1024, 8192),
}
MALLOC = {
    # run_train.sh's TITAN_THD_MALLOC: freed blocks stay in the heap instead of going back to the OS
    # (glibc unmaps every block over 32 MiB and the next step faults its pages in again)
    "reuse": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "system": {},
}
SIDES = ("titan_thd", "hf", "before", "compiled")
MATMUL_OPS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm", "aten::_grouped_mm", "aten::addbmm"}
"""Matrix-product ops of a profile (the matmul share of a step)."""


@register_flop_formula(torch.ops.aten._grouped_mm)
def _grouped_mm_flops(a_shape, b_shape, *args, **kwargs) -> int:
    """[N, K] x [G, K, O] (rows grouped) or [O, N] x [N, I] (a weight gradient): 2 N K O."""
    if len(a_shape) == 2 and len(b_shape) == 3:
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    assert len(a_shape) == len(b_shape) == 2, (a_shape, b_shape)
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,wide", help=f"comma list of {sorted(CONFIGS)}")
    p.add_argument("--dists", default="short,long", help=f"comma list of {sorted(DISTS)}")
    p.add_argument("--short-tokens", type=int, default=2048, help="T of a `short` microbatch")
    # 8192 puts transformers' eager `[1, H, L, L]` scores of a ~4k document past 24 GiB at `tiny`.
    p.add_argument("--long-tokens", type=int, default=4096, help="T of a `long` microbatch")
    p.add_argument("--warmup", type=int, default=1, help="microbatches run before timing")
    p.add_argument("--steps", type=int, default=2, help="timed microbatches")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each side; the best counts")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--breakdown", action="store_true", help="per-module fwd+bwd times of titan_thd")
    p.add_argument("--json", default="", help="write all figures to this file")
    p.add_argument("--compile", action="store_true", help="also run titan_thd with training.compile")
    p.add_argument(
        "--work", choices=("lm", "full"), default="lm", help="lm: equal losses; full: ours adds MTP + KL"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--malloc",
        choices=tuple(MALLOC),
        default="reuse",
        help="glibc's allocator on every side alike: reuse (run_train.sh's default) or system",
    )
    p.add_argument(
        "--before",
        default="",
        help="also run titan_thd from this older checkout (e.g. `git worktree add DIR <commit>`), side by side",
    )
    # child process mode
    p.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--config", help=argparse.SUPPRESS)
    p.add_argument("--dist", help=argparse.SUPPRESS)
    p.add_argument("--weights", help=argparse.SUPPRESS)
    p.add_argument("--code-root", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# ============================================================================ data
@dataclasses.dataclass
class Document:
    input_ids: np.ndarray
    target_mask: np.ndarray


def tokens_of(opts: argparse.Namespace, dist: str) -> int:
    return opts.short_tokens if dist == "short" else opts.long_tokens


def microbatches(opts: argparse.Namespace, dist: str) -> list[list[Document]]:
    """warmup + steps microbatches of seeded lognormal documents, filled in order up to T tokens."""
    median, sigma, lo, hi = DISTS[dist]
    T = tokens_of(opts, dist)
    rng = np.random.default_rng(opts.seed)
    batches: list[list[Document]] = [[]]
    while len(batches) <= opts.warmup + opts.steps:
        n = int(np.clip(rng.lognormal(np.log(median), sigma), lo, min(hi, T)))
        if sum(len(d.input_ids) for d in batches[-1]) + n > T:
            batches.append([])
        batches[-1].append(Document(rng.integers(0, VOCAB, n), np.arange(n) > 0))
    return batches[:-1]


# ============================================================================ one side (child)
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _pack(docs: list[Document], T: int):
    """The documents in one stream without tail padding, as the trainer packs them (data.trim_padding)."""
    try:
        return pack_microbatch(docs, T, 1, 0, rule=RowRule(T, 1, 1, False))
    except TypeError:  # a --before checkout older than data.trim_padding: its T rows
        return pack_microbatch(docs, T, 1, 0)


def _ours_step(model, batch, meta) -> tuple[torch.Tensor, float, int]:
    meta.labels_full, meta.loss_mask_full = batch.labels, batch.loss_mask
    out = model(batch.tokens, meta)
    labels = torch.where(batch.loss_mask.bool(), batch.labels, IGNORE_INDEX)
    lm = F.cross_entropy(out.logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (lm + sum(out.aux_losses.values())).backward()
    return lm, float(lm), int((labels != IGNORE_INDEX).sum())


def _step(model, mb, ours: bool):
    return _ours_step(model, *mb) if ours else _hf_step(model, mb)


def _hf_step(model, docs: list[Document]) -> tuple[None, float, int]:
    total, n = 0.0, 0
    for d in docs:
        ids = torch.as_tensor(d.input_ids, dtype=torch.long)[None]
        logits = model(input_ids=ids).logits[0, :-1]
        loss = F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum")
        loss.backward()
        total, n = total + float(loss), n + ids.shape[1] - 1
    return None, total, n


def _kinds(ours: bool) -> dict[type, str]:
    """Module class -> kind of the per-module breakdown (leaf kinds, then whole blocks)."""
    if ours:
        from titan_thd.models.dsv4.attention import Attention
        from titan_thd.models.dsv4.block import Block
        from titan_thd.models.dsv4.mhc import HyperConnection, HyperHead
        from titan_thd.models.dsv4.moe import MoE
        from titan_thd.models.dsv4.mtp import MTPBlock

        return {
            Attention: "attention",
            MoE: "moe",
            HyperConnection: "mhc",
            HyperHead: "mhc",
            Block: "block",
            MTPBlock: "mtp_block",
            torch.nn.Linear: "head",
        }
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    return {
        m.DeepseekV4Attention: "attention",
        m.DeepseekV4SparseMoeBlock: "moe",
        m.DeepseekV4HyperConnection: "mhc",
        m.DeepseekV4HyperHead: "mhc",
        m.DeepseekV4DecoderLayer: "block",
        torch.nn.Linear: "head",
    }


def breakdown(model, mb, ours: bool, repeats: int = 2) -> dict[str, dict[str, float]]:
    """{kind: {"s": seconds, "flops": FLOPs, "calls": n}} of forward+backward per module kind,
    replayed on the inputs captured during one step ("head": the LM head only; "block": every
    decoder block, `mtp_block` the MTP block, each as a whole, nested kinds included)."""
    kinds = _kinds(ours)
    head = model.head if ours else model.lm_head
    captured = []

    def hook(mod, args, kwargs):
        if not isinstance(mod, torch.nn.Linear) or mod is head:
            captured.append((mod, args, kwargs))

    handles = [
        m.register_forward_pre_hook(hook, with_kwargs=True) for m in model.modules() if type(m) in kinds
    ]
    model.zero_grad(set_to_none=True)
    _step(model, mb, ours)
    for h in handles:
        h.remove()
    total = {k: {"s": 0.0, "flops": 0, "calls": 0} for k in sorted(set(kinds.values()))}

    def detached(a):
        if isinstance(a, torch.Tensor) and a.is_floating_point():
            return a.detach().requires_grad_(a.requires_grad)
        if isinstance(a, (tuple, list)):
            return type(a)(detached(x) for x in a)
        if isinstance(a, dict):
            return {k: detached(v) for k, v in a.items()}
        return a

    def fwd_bwd(mod, args, kwargs):
        out = mod(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, tuple) else (out,)) if isinstance(o, torch.Tensor)]
        sum(o.float().square().mean() for o in outs if o.requires_grad).backward()

    for mod, args, kwargs in captured:
        args = tuple(detached(a) for a in args)
        # transformers' layers append to a cache even in training: replay each call without one
        kwargs = {k: None if k == "cache" else detached(v) for k, v in kwargs.items()}
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fwd_bwd(mod, args, kwargs)
            best = min(best, time.perf_counter() - t0)
        with FlopCounterMode(display=False) as counter:
            fwd_bwd(mod, args, kwargs)
        kind = total[kinds[type(mod)]]
        kind["s"] += best
        kind["flops"] += counter.get_total_flops()
        kind["calls"] += 1
    model.zero_grad(set_to_none=True)
    return total


def count_flops(model, mb, ours: bool) -> int:
    """FLOPs of one forward+backward step (FlopCounterMode)."""
    with FlopCounterMode(display=False) as counter:
        _step(model, mb, ours)
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def matmul_share(model, mb, ours: bool) -> float:
    """Self CPU time of the matrix products over that of all ops, one profiled step."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, mb, ours)
    model.zero_grad(set_to_none=True)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    return sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS) / max(total, 1)


def run_side(opts: argparse.Namespace) -> dict:
    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    docs_per_mb = microbatches(opts, opts.dist)
    T = tokens_of(opts, opts.dist)
    ours = opts.side != "hf"
    dtype = getattr(torch, opts.dtype)
    if ours:
        model, args = load_hf(opts.weights)
        if opts.work == "lm":  # the losses transformers computes: no MTP, no indexer KL
            model.args = dataclasses.replace(args, mtp_loss_weight=0.0, indexer_loss_coeff=0.0)
        model.to(dtype)
        if opts.side == "compiled":
            from titan_thd.models.dsv4 import spec

            spec.compile.apply(model)
        inputs = [_pack(docs, T) for docs in docs_per_mb]
        inputs = [(b, BatchMeta.from_batch(b)) for b in inputs]
    else:
        import transformers

        model = transformers.DeepseekV4ForCausalLM.from_pretrained(opts.weights, dtype=dtype)
        inputs = docs_per_mb
    model.train()
    setup_mb = rss_mb()
    elapsed, cpu, real_tokens, losses, first_s = 0.0, 0.0, 0, [], 0.0
    for i, mb in enumerate(inputs):
        t0, c0 = time.perf_counter(), time.process_time()
        _, loss, n = _step(model, mb, ours)
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        model.zero_grad(set_to_none=True)
        losses.append(loss / n)
        if i == 0:
            first_s = dt
        if i >= opts.warmup:
            elapsed += dt
            cpu += dc
            real_tokens += sum(len(d.input_ids) for d in docs_per_mb[i])
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {
        "side": opts.side,
        "tokens_per_s": real_tokens / elapsed,
        "seconds_per_step": elapsed / opts.steps,
        # Process CPU time: with --threads 1 on a loaded machine, the work itself (time slicing excluded).
        "cpu_tokens_per_s": real_tokens / cpu,
        "first_step_s": first_s,
        "real_tokens": real_tokens,
        "peak_mb": peak_mb,
        "peak_over_setup_kb_per_token": (peak_mb - setup_mb) * 1024 / (real_tokens / opts.steps),
        "losses": losses,
        "doc_lengths": [[len(d.input_ids) for d in docs] for docs in docs_per_mb[opts.warmup :]],
    }
    timed = inputs[opts.warmup :]
    out["flops_per_step"] = sum(count_flops(model, mb, ours) for mb in timed) / len(timed)
    out["matmul_share"] = matmul_share(model, timed[-1], ours)
    if opts.breakdown:
        out["breakdown"] = breakdown(model, timed[-1], ours)
    return out


# ============================================================================ main
def matmul_peak_gflops(
    threads: int, dtype: torch.dtype = torch.float32, n: int = 2048, repeats: int = 5
) -> float:
    """Best GEMM rate of this machine in `dtype` at this thread count (GFLOP/s)."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _exit_reason(returncode: int) -> str:
    if returncode >= 0:
        return f"exit status {returncode}"
    import signal

    name = signal.Signals(-returncode).name
    oom = " (most likely the out-of-memory killer: try a smaller --long-tokens)" if name == "SIGKILL" else ""
    return f"killed by {name}{oom}"


def main() -> None:
    opts = parse_args()
    if opts.side:
        print(json.dumps(run_side(opts)))
        return
    configs, dists = opts.configs.split(","), opts.dists.split(",")
    for name, table in (("--configs", configs), ("--dists", dists)):
        allowed = CONFIGS if table is configs else DISTS
        bad = [c for c in table if c not in allowed]
        if bad:
            sys.exit(f"{name}: unknown {bad}; expected a comma list of {sorted(allowed)}")
    try:
        import transformers  # noqa: F401
    except ImportError:
        sys.exit("transformers is missing: install the `hf` extra (./scripts/setup_env.sh test,hf)")

    sides = [s for s in SIDES if s in ("titan_thd", "hf") or (s == "before" and opts.before)]
    sides += ["compiled"] if opts.compile else []
    peaks = []
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        weights = {}
        for c in configs:
            torch.manual_seed(opts.seed)
            weights[c] = str(export_hf(build_dsv4(CONFIGS[c]), CONFIGS[c], Path(tmp) / c))
        for _ in range(opts.rounds):
            peaks.append(matmul_peak_gflops(opts.threads, getattr(torch, opts.dtype)))
            for c in configs:
                for d in dists:
                    for side in sides:
                        cmd = [sys.executable, __file__, *sys.argv[1:], "--side", side]
                        cmd += ["--config", c, "--dist", d, "--weights", weights[c]]
                        if side == "before":
                            cmd += ["--code-root", opts.before]
                        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
                        env |= MALLOC[opts.malloc]
                        if side == "compiled":  # a cold compile every time: the first step a user pays
                            env["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(dir=tmp)
                        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
                        if proc.returncode:
                            sys.exit(f"{c}/{d}/{side} failed: {_exit_reason(proc.returncode)}\n{proc.stderr}")
                        r = json.loads(proc.stdout.strip().splitlines()[-1])
                        key = f"{c}/{d}/{side}"
                        if key not in results or r["tokens_per_s"] > results[key]["tokens_per_s"]:
                            results[key] = r
    peak = max(peaks)
    rows = []
    for c in configs:
        for d in dists:
            ours, hf = results[f"{c}/{d}/titan_thd"], results[f"{c}/{d}/hf"]
            before = results.get(f"{c}/{d}/before")
            comp = results.get(f"{c}/{d}/compiled")
            steps = len(ours["doc_lengths"])
            row = {
                "config": c,
                "dist": d,
                "T": tokens_of(opts, d),
                "docs_per_step": sum(len(mb) for mb in ours["doc_lengths"]) / steps,
                "real_tokens_per_step": ours["real_tokens"] / steps,
                # the analytic count of titan_thd's training work (models/dsv4/flops.py), for reference
                "model_flops_per_step": flops_per_step(
                    CONFIGS[c], [n for mb in ours["doc_lengths"] for n in mb]
                )
                / steps,
                "loss_max_rel_diff": max(abs(a - b) / abs(b) for a, b in zip(ours["losses"], hf["losses"])),
                "ours_vs_hf": ours["tokens_per_s"] / hf["tokens_per_s"],
                "ours_vs_hf_cpu": ours["cpu_tokens_per_s"] / hf["cpu_tokens_per_s"],
            }
            for name, r in (("ours", ours), ("hf", hf), ("before", before), ("compiled", comp)):
                if r is None:
                    continue
                row[f"{name}_tokens_per_s"] = r["tokens_per_s"]
                row[f"{name}_cpu_tokens_per_s"] = r["cpu_tokens_per_s"]
                row[f"{name}_first_step_s"] = r["first_step_s"]
                row[f"{name}_peak_mb"] = r["peak_mb"]
                row[f"{name}_kb_per_token"] = r["peak_over_setup_kb_per_token"]
                if "flops_per_step" in r:  # counted on this side's own step (FlopCounterMode)
                    row[f"{name}_flops_per_step"] = r["flops_per_step"]
                    row[f"{name}_mfu"] = r["flops_per_step"] / r["seconds_per_step"] / (peak * 1e9)
                    row[f"{name}_matmul_share"] = r["matmul_share"]
                if "breakdown" in r:
                    row[f"{name}_breakdown"] = {
                        k: v | {"mfu": v["flops"] / v["s"] / (peak * 1e9) if v["s"] else 0.0}
                        for k, v in r["breakdown"].items()
                    }
            if before is not None:
                row["ours_vs_before"] = ours["tokens_per_s"] / before["tokens_per_s"]
                row["before_vs_hf"] = before["tokens_per_s"] / hf["tokens_per_s"]
                row["ours_vs_before_cpu"] = ours["cpu_tokens_per_s"] / before["cpu_tokens_per_s"]
            if comp is not None:
                row["compiled_vs_ours"] = comp["tokens_per_s"] / ours["tokens_per_s"]
                row["compiled_vs_ours_cpu"] = comp["cpu_tokens_per_s"] / ours["cpu_tokens_per_s"]
                row["compiled_vs_hf"] = comp["tokens_per_s"] / hf["tokens_per_s"]
                row["compiled_loss_max_rel_diff"] = max(
                    abs(a - b) / abs(b) for a, b in zip(comp["losses"], ours["losses"])
                )
            rows.append(row)
    cpu = cpu_name()
    work = "LM cross-entropy" if opts.work == "lm" else "LM + MTP + indexer KL (MORE work than transformers)"
    print(
        f"dsv4 titan_thd vs transformers {_hf_version()} DeepseekV4ForCausalLM eager; {opts.dtype} fwd+bwd, "
        f"{opts.threads} threads, CPU {cpu!r}, torch {torch.__version__}, {opts.steps} timed steps after "
        f"{opts.warmup} warm-up, best of {opts.rounds} alternating rounds; glibc malloc {opts.malloc!r} on "
        f"both sides; {opts.dtype} matmul peak "
        f"{peak:.0f} GFLOP/s; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores\n"
        f"  titan_thd computes: one packed THD microbatch per step, {work}\n"
        f"  transformers computes: the same documents one at a time ([1, L]), LM cross-entropy"
    )
    names = [n for n in ("ours", "compiled", "before", "hf") if f"{n}_tokens_per_s" in rows[0]]
    head = ["config", "dist", "T", "real tok"]
    head += [f"{n} tok/s" for n in names] + ["ours/hf"] + (["ours/before"] if "before" in names else [])
    head += ["cpu ours/hf"] + (["cpu ours/bef"] if "before" in names else [])
    head += ["cpu comp/ours", "comp 1st s"] if "compiled" in names else []
    flops_names = [n for n in names if f"{n}_flops_per_step" in rows[0]]
    head += [f"{n} GFLOP" for n in flops_names] + [f"{n} MFU" for n in flops_names]
    head += [f"{n} mm %" for n in flops_names]
    head += [f"{n} KB/tok" for n in names] + ["loss rel"]
    print("".join(f"{h:>13}" for h in head))
    for r in rows:
        cells = [r["config"], r["dist"], r["T"], f"{r['real_tokens_per_step']:.0f}"]
        cells += [f"{r[f'{n}_tokens_per_s']:.0f}" for n in names] + [f"{r['ours_vs_hf']:.2f}x"]
        cells += [f"{r['ours_vs_before']:.2f}x"] if "before" in names else []
        cells += [f"{r['ours_vs_hf_cpu']:.2f}x"] + (
            [f"{r['ours_vs_before_cpu']:.2f}x"] if "before" in names else []
        )
        if "compiled" in names:
            cells += [f"{r['compiled_vs_ours_cpu']:.2f}x", f"{r['compiled_first_step_s']:.0f}"]
        cells += [f"{r[f'{n}_flops_per_step'] / 1e9:.1f}" for n in flops_names]
        cells += [f"{r[f'{n}_mfu']:.1%}" for n in flops_names]
        cells += [f"{r[f'{n}_matmul_share']:.0%}" for n in flops_names]
        cells += [f"{r[f'{n}_kb_per_token']:.1f}" for n in names] + [f"{r['loss_max_rel_diff']:.1e}"]
        print("".join(f"{c:>13}" for c in cells))
        for n in names:
            if f"{n}_breakdown" in r:
                parts = ", ".join(
                    f"{k} {v['s']:.3f} s {v['flops'] / 1e9:.1f} GFLOP MFU {v['mfu']:.0%} (x{v['calls']})"
                    for k, v in r[f"{n}_breakdown"].items()
                )
                print(f"    {n} fwd+bwd by module, replayed: {parts}")
    if opts.json:
        report = {
            "cpu": cpu,
            "threads": opts.threads,
            "dtype": opts.dtype,
            "work": opts.work,
            "malloc": opts.malloc,
        }
        report |= {"transformers": _hf_version(), "torch": torch.__version__, "matmul_peak_gflops": peak}
        report |= {"rows": rows, "raw": results}
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
