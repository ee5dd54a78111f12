"""titan_thd's dense `llama` vs an installed torchtitan's llama3 `debugmodel`: one training step
(forward, cross-entropy, backward, AdamW step) at the same settings, side by side.

    .venv/bin/python benchmarks/bench_llama_vs_torchtitan.py [--dtype float32,bfloat16] [--compile] \
        [--pairs 11] [--threads 2] [--json /tmp/llama_vs_torchtitan.json]

torchtitan is not a dependency of titan_thd: install it into a virtualenv of your own to run this
(torchtitan 0.3.0 imports triton, spmd-types, tyro and einops; e.g. `pip install --no-deps
torchtitan spmd-types einops triton` and `pip install tyro`, keeping the CPU torch). Without it the
script says so and exits 0.

Equal settings: torchtitan's debugmodel dimensions on both sides (d 256, 6 layers, 16 heads of
16, SwiGLU 768, vocabulary 2048, RoPE theta 5e5), the same token ids, `--seqs` rows of `--seq-len`
tokens, each row one document (so causal attention over a row is exactly per-document attention),
float32 or bfloat16 parameters and compute, the same AdamW settings. titan_thd runs the rows packed
as one THD microbatch (its varlen attention); torchtitan runs [B, L] with its attention module's
core swapped for causal `scaled_dot_product_attention` (torchtitan 0.3.0's own `flex` and `varlen`
cores have no CPU backward), the rest of its model as it ships. `--compile`: titan_thd with
training.compile's regional compile (models/compile.py) and torchtitan with each transformer block
under torch.compile (what its `compile.enable` does). The sides alternate `--pairs` times; the
table gives median step times and the median of the per-pair ratios (a shared machine adds noise to
both alike), in wall time and in process CPU time (with `--threads 1` the work itself, whatever
other jobs time-slice the cores). `outside ops` is the step time minus the time of the top-level aten ops of one
profiled step: the framework's own Python per step.

`--docs N` replaces the rows by N documents of lognormal lengths (`--mean-len`, at most
`--microbatch-tokens`), the workload the project is for. Both sides see every document whole, with
attention inside it only, and take one optimizer step on the mean loss over every real token,
accumulated over microbatches of at most `--microbatch-tokens` tokens: titan_thd packs the
documents (first fit, in their order) into THD microbatches with no padding; torchtitan, which needs
[B, L] rows for exact per-document attention on a CPU, gets its best padded batching: documents
sorted by length, each microbatch B documents padded to its longest, B x L <= the same budget
(padding rows are labelled -100). The table gives both sides' real and padded token counts.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.data.batch_meta import BatchMeta  # noqa: E402
from titan_thd.models.llama import spec as llama_spec  # noqa: E402
from titan_thd.models.llama.args import LlamaArgs  # noqa: E402
from titan_thd.models.llama.model import build_llama  # noqa: E402

DIMS = {"dim": 256, "n_layers": 6, "n_heads": 16, "ffn_hidden_dim": 768, "vocab_size": 2048}


class _CausalSDPA(nn.Module):
    """torchtitan's inner-attention interface ([B, L, N, H] in and out) as causal SDPA."""

    def forward(self, q, k, v, *, attention_masks=None, scale=None, enable_gqa=False, **kwargs):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale
        )
        return out.transpose(1, 2)


def build_torchtitan(dtype: torch.dtype, compile_: bool):
    from torchtitan.models.llama3 import model_registry

    model = model_registry("debugmodel", attn_backend="flex").model.build()
    model.init_weights()
    for layer in model.layers.values():
        layer.attention.inner_attention = _CausalSDPA()
        if compile_:
            layer.compile()
    # Floating tensors only: its RoPE table is complex (Module.to would drop the imaginary part).
    return model._apply(lambda t: t.to(dtype) if t.is_floating_point() else t).train()


def build_ours(dtype: torch.dtype, compile_: bool):
    model = build_llama(LlamaArgs(**DIMS, n_kv_heads=16, rope_theta=500000.0)).to(dtype).train()
    if compile_:
        llama_spec.compile.apply(model)
    return model


def steps(side: str, model, tokens_BL: torch.Tensor):
    """A step function: forward, mean cross-entropy of the next token, backward, AdamW, zero_grad."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    B, L = tokens_BL.shape
    labels_BL = torch.cat([tokens_BL[:, 1:], torch.full((B, 1), -100)], dim=1)
    if side == "torchtitan":
        positions = torch.arange(L).repeat(B, 1)

        def step() -> float:
            logits = model(tokens_BL, positions, None)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels_BL.flatten(), ignore_index=-100)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        return step
    cu = torch.arange(B + 1, dtype=torch.int32) * L
    tokens_T, labels_T = tokens_BL.flatten(), labels_BL.flatten()

    def step() -> float:
        meta = BatchMeta(cu, cu, L, B, torch.arange(L).repeat(B), None)
        logits = model(tokens_T, meta).logits
        loss = F.cross_entropy(logits.float(), labels_T, ignore_index=-100)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def make_docs(n: int, mean_len: int, max_len: int, seed: int = 0) -> list[torch.Tensor]:
    """n documents of lognormal lengths (sigma 1, median mean_len / e^0.5), 16 to max_len tokens."""
    g = torch.Generator().manual_seed(seed)
    mu = torch.log(torch.tensor(float(mean_len))) - 0.5
    lengths = (torch.randn(n, generator=g) + mu).exp().round().clamp(16, max_len).long()
    return [torch.randint(0, DIMS["vocab_size"], (int(L),), generator=g) for L in lengths]


def doc_labels(doc: torch.Tensor) -> torch.Tensor:
    return torch.cat([doc[1:], torch.full((1,), -100)])


def first_fit(docs: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """titan_thd's microbatches: documents in their order, each into the first one it fits."""
    bins: list[list[torch.Tensor]] = []
    room: list[int] = []
    for d in docs:
        i = next((i for i, r in enumerate(room) if r >= d.numel()), None)
        if i is None:
            bins.append([])
            room.append(budget)
            i = len(bins) - 1
        bins[i].append(d)
        room[i] -= d.numel()
    return bins


def length_buckets(docs: list[torch.Tensor], budget: int) -> list[list[torch.Tensor]]:
    """torchtitan's microbatches: sorted by length, B documents padded to the longest, B x L <= budget."""
    out: list[list[torch.Tensor]] = []
    for d in sorted(docs, key=lambda d: -d.numel()):
        if out and (len(out[-1]) + 1) * out[-1][0].numel() <= budget:
            out[-1].append(d)
        else:
            out.append([d])
    return out


def at_least_fp32(logits: torch.Tensor) -> torch.Tensor:
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def doc_steps(side: str, model, docs: list[torch.Tensor], budget: int):
    """One step over every document (gradient accumulation), mean loss over all real tokens."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    n_real = sum(d.numel() - 1 for d in docs)
    if side == "torchtitan":
        batches = []
        for group in length_buckets(docs, budget):
            L = group[0].numel()
            tok = torch.zeros(len(group), L, dtype=torch.long)
            lab = torch.full((len(group), L), -100)
            for b, d in enumerate(group):
                tok[b, : d.numel()] = d
                lab[b, : d.numel()] = doc_labels(d)
            batches.append((tok, lab, torch.arange(L).repeat(len(group), 1)))

        def fwd_bwd(tok, lab, pos) -> float:
            logits = model(tok, pos, None)
            loss = F.cross_entropy(
                at_least_fp32(logits.flatten(0, 1)), lab.flatten(), ignore_index=-100, reduction="sum"
            )
            (loss / n_real).backward()
            return float(loss.detach())

    else:
        batches = []
        for group in first_fit(docs, budget):
            lengths = torch.tensor([d.numel() for d in group])
            cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
            pos = torch.cat([torch.arange(int(L)) for L in lengths])
            batches.append(
                (torch.cat(group), torch.cat([doc_labels(d) for d in group]), cu, int(lengths.max()), pos)
            )

        def fwd_bwd(tok, lab, cu, max_len, pos) -> float:
            meta = BatchMeta(cu, cu, max_len, cu.numel() - 1, pos, None)
            logits = model(tok, meta).logits
            loss = F.cross_entropy(at_least_fp32(logits), lab, ignore_index=-100, reduction="sum")
            (loss / n_real).backward()
            return float(loss.detach())

    rows = sum(b[0].numel() for b in batches)

    def step() -> float:
        total = sum(fwd_bwd(*b) for b in batches)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / n_real

    step.shape = {"microbatches": len(batches), "tokens_computed": rows, "real_tokens": n_real + len(docs)}
    return step


def outside_ops_s(step) -> float:
    """Step time minus the time of its top-level aten ops (one profiled step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        step()
        wall = time.perf_counter() - t0

    def outermost(e) -> bool:  # an aten op not inside another (the backward's sit under autograd nodes)
        p = e.cpu_parent
        while p is not None:
            if p.name.startswith("aten::"):
                return False
            p = p.cpu_parent
        return True

    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::") and outermost(e)]
    # The backward runs on autograd's own thread: its ops' time adds to the step's, not beside it.
    return max(0.0, wall - sum(e.cpu_time_total for e in top) / 1e6)


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="float32", help="comma list of float32, bfloat16")
    p.add_argument("--compile", action="store_true", help="also both sides compiled")
    p.add_argument("--pairs", type=int, default=11)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seqs", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--docs", type=int, default=0, help="N variable-length documents instead of the rows")
    p.add_argument("--mean-len", type=int, default=300, help="--docs: mean document length")
    p.add_argument("--microbatch-tokens", type=int, default=2048, help="--docs: tokens per microbatch")
    p.add_argument("--json", default="")
    opts = p.parse_args()
    try:
        import torchtitan
    except ImportError:
        print("bench_llama_vs_torchtitan: torchtitan is not installed; nothing to compare (see --help)")
        return 0
    torch.set_num_threads(opts.threads)
    tokens = torch.randint(
        0, DIMS["vocab_size"], (opts.seqs, opts.seq_len), generator=torch.Generator().manual_seed(0)
    )
    docs = make_docs(opts.docs, opts.mean_len, opts.microbatch_tokens) if opts.docs else []
    rows = []
    for dtype_name in opts.dtype.split(","):
        dtype = getattr(torch, dtype_name)
        for compile_ in (False, True) if opts.compile else (False,):
            torch.manual_seed(0)
            sides = {
                "titan_thd": build_ours(dtype, compile_),
                "torchtitan": build_torchtitan(dtype, compile_),
            }
            params = {k: sum(q.numel() for q in m.parameters()) for k, m in sides.items()}
            if docs:
                fns = {k: doc_steps(k, m, docs, opts.microbatch_tokens) for k, m in sides.items()}
            else:
                fns = {k: steps(k, m, tokens) for k, m in sides.items()}
            first = {}
            for k, fn in fns.items():  # warm-up (the compile, when compiled)
                t0 = time.perf_counter()
                fn()
                first[k] = time.perf_counter() - t0
                fn()
            times: dict[str, list[float]] = {k: [] for k in fns}
            cpu: dict[str, list[float]] = {k: [] for k in fns}
            losses: dict[str, float] = {}
            for _ in range(opts.pairs):
                for k, fn in fns.items():
                    t0, c0 = time.perf_counter(), time.process_time()
                    losses[k] = fn()
                    times[k].append(time.perf_counter() - t0)
                    cpu[k].append(time.process_time() - c0)
            ratios = [b / a for a, b in zip(times["titan_thd"], times["torchtitan"])]
            cpu_ratios = [b / a for a, b in zip(cpu["titan_thd"], cpu["torchtitan"])]
            row = {
                "dtype": dtype_name,
                "compiled": compile_,
                "params": params,
                "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                "outside_ops_s": {k: outside_ops_s(fn) for k, fn in fns.items()},
                "first_step_s": first,
                "last_loss": losses,
                "speedup": statistics.median(ratios),
                "speedup_range": [min(ratios), max(ratios)],
                # process CPU time: the work itself when other jobs time-slice the cores (--threads 1)
                "median_step_cpu_s": {k: statistics.median(v) for k, v in cpu.items()},
                "cpu_speedup": statistics.median(cpu_ratios),
                "cpu_speedup_range": [min(cpu_ratios), max(cpu_ratios)],
                "shape": {k: getattr(fn, "shape", None) for k, fn in fns.items()},
            }
            rows.append(row)
    work = (
        f"{opts.docs} documents (mean {opts.mean_len} tokens) per step in microbatches of <= "
        f"{opts.microbatch_tokens} tokens"
        if docs
        else f"{opts.seqs} x {opts.seq_len} tokens per step"
    )
    print(
        f"titan_thd llama vs torchtitan {torchtitan.__version__} llama3 debugmodel; {work}, {opts.threads} threads, CPU {cpu_name()!r}, torch {torch.__version__}; "
        f"median of {opts.pairs} alternating pairs"
    )
    for r in rows:
        m, o = r["median_step_s"], r["outside_ops_s"]
        lo, hi = r["speedup_range"]
        print(
            f"{r['dtype']:>9} {'compiled' if r['compiled'] else 'eager':>8}: titan_thd {m['titan_thd'] * 1e3:.0f} ms, "
            f"torchtitan {m['torchtitan'] * 1e3:.0f} ms per step -> titan_thd {r['speedup']:.2f}x ({lo:.2f}-{hi:.2f}); "
            f"CPU time {r['cpu_speedup']:.2f}x ({r['cpu_speedup_range'][0]:.2f}-{r['cpu_speedup_range'][1]:.2f}); "
            f"outside ops {o['titan_thd'] * 1e3:.0f} / {o['torchtitan'] * 1e3:.0f} ms; params "
            f"{r['params']['titan_thd']:,} / {r['params']['torchtitan']:,}; first step "
            f"{r['first_step_s']['titan_thd']:.1f} / {r['first_step_s']['torchtitan']:.1f} s"
        )
        if docs:
            sh = r["shape"]
            print(
                "           tokens computed per step (real {real}): titan_thd {a:,} in {na} packed microbatches, "
                "torchtitan {b:,} in {nb} padded ones ({pad:.1f} % padding); last losses {la:.6f} / {lb:.6f}".format(
                    real=sh["titan_thd"]["real_tokens"],
                    a=sh["titan_thd"]["tokens_computed"],
                    na=sh["titan_thd"]["microbatches"],
                    b=sh["torchtitan"]["tokens_computed"],
                    nb=sh["torchtitan"]["microbatches"],
                    pad=100 * (1 - sh["torchtitan"]["real_tokens"] / sh["torchtitan"]["tokens_computed"]),
                    la=r["last_loss"]["titan_thd"],
                    lb=r["last_loss"]["torchtitan"],
                )
            )
    if opts.json:
        report = {
            "cpu": cpu_name(),
            "torch": torch.__version__,
            "torchtitan": torchtitan.__version__,
            "rows": rows,
        }
        Path(opts.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
