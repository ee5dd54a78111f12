"""Activation recomputation: what each mode keeps, what it costs, per model, on this machine.

For every mode (none, full, each selective region alone, all regions together) of both models, one
process, eager, float32 by default:

  saved/tok/layer  bytes autograd keeps per token and layer from the forward to the backward (the
                   saved-tensor count of memory/activations.py on one document of T tokens,
                   averaged over the layers), and as a fraction of `none`
  step             forward + backward + AdamW step on a packed microbatch of T tokens (lognormal
                   documents), median of --reps, relative to `none`: the recompute overhead; the
                   modes run interleaved in every repetition, so a busy machine slows them alike
  peak             peak bytes of live tensors over one step (memory/live.py):
                   parameters, gradients, optimizer state, activations, temporaries

  .venv/bin/python benchmarks/bench_memory.py --json /tmp/bench_memory.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import ActivationCheckpoint
from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.packer import pack_microbatch
from titan_thd.memory import activations
from titan_thd.memory.live import LiveBytes
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.parallel.parallel_dims import ParallelDims

FLAVORS = {"llama": "debug", "dsv4": "tiny"}


def modes(name: str) -> dict[str, ActivationCheckpoint]:
    regions = tuple(get_model_spec(name).ac_regions)
    return {
        "none": ActivationCheckpoint(),
        "full": ActivationCheckpoint(mode="full"),
        **{r: ActivationCheckpoint(mode="selective", regions=(r,)) for r in regions},
        "all regions": ActivationCheckpoint(mode="selective", regions=regions),
    }


class _Doc:
    def __init__(self, ids: np.ndarray):
        self.input_ids, self.target_mask = ids, np.arange(len(ids)) > 0


def microbatch(vocab: int, tokens: int, seed: int = 0):
    """Lognormal documents (mean tokens / 4) packed into one microbatch of `tokens` rows."""
    rng = np.random.default_rng(seed)
    docs, used = [], 0
    while True:
        n = int(np.clip(rng.lognormal(np.log(tokens / 4), 1.0), 8, tokens))
        if used + n > tokens:
            break
        docs.append(_Doc(rng.integers(0, vocab, n)))
        used += n
    batch = pack_microbatch(docs or [_Doc(rng.integers(0, vocab, tokens))], tokens, 1, 0)
    return batch, BatchMeta.from_batch(batch)


def build(name: str, args, ac: ActivationCheckpoint, dtype: torch.dtype):
    spec = get_model_spec(name)
    torch.manual_seed(0)
    model = spec.build(args).to(dtype).train()
    one = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    model = spec.parallelize(model, one, ac=ac)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def step(model, optimizer, batch, meta) -> None:
    out = model(batch.tokens, meta)
    loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask) + sum(out.aux_losses.values())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def bench_model(name: str, tokens: int, reps: int, dtype: torch.dtype) -> list[dict]:
    spec, args = get_model_spec(name), get_model_args(name, FLAVORS[name])
    batch, meta = microbatch(args.vocab_size, tokens)
    rows = []
    for mode, ac in modes(name).items():
        prepare = activations.recomputation(spec, ac)
        saved = activations.measure(spec, args, tokens, dtype, prepare)
        per_layer = sum(saved.layers.values()) / len(saved.layers) / tokens
        rows.append({"model": name, "flavor": FLAVORS[name], "mode": mode, "tokens": tokens,
                     "saved_bytes_per_token_layer": per_layer, "peak_bytes": 0, "step_s": []})  # fmt: skip
    for rep in range(reps):  # interleaved: every mode sees the same machine load; one model alive at a time
        for row, ac in zip(rows, modes(name).values()):
            model, optimizer = build(name, args, ac, dtype)
            step(model, optimizer, batch, meta)  # warm-up; the AdamW state exists from here on
            if rep == 0:
                state = [*model.parameters(), *model.buffers(), *_optimizer_state(optimizer)]
                with LiveBytes(state) as live:
                    step(model, optimizer, batch, meta)
                row["peak_bytes"] = live.peak
            t0 = time.perf_counter()
            step(model, optimizer, batch, meta)
            row["step_s"].append(time.perf_counter() - t0)
            del model, optimizer
    base = rows[0]
    for row in rows:
        row["step_s"] = statistics.median(row["step_s"])
    for row in rows:
        row["saved_vs_none"] = row["saved_bytes_per_token_layer"] / base["saved_bytes_per_token_layer"]
        row["step_vs_none"] = row["step_s"] / base["step_s"]
        row["peak_vs_none"] = row["peak_bytes"] / base["peak_bytes"]
    return rows


def _optimizer_state(optimizer) -> list[torch.Tensor]:
    return [t for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor)]


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if "Model name" in line)
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="llama,dsv4")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64", "bfloat16"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    rows = [r for name in a.models.split(",") for r in bench_model(name, a.tokens, a.reps, dtype)]
    cpu = cpu_name()
    print(f"{cpu}, {a.threads} thread(s), torch {torch.__version__}, {a.dtype}, T = {a.tokens}")
    print(f"{'model':<14} {'mode':<13} {'saved KiB/tok/layer':>20} {'vs none':>8} {'step s':>8} "
          f"{'vs none':>8} {'peak MiB':>9} {'vs none':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['model'] + ' ' + r['flavor']:<14} {r['mode']:<13} {r['saved_bytes_per_token_layer'] / 1024:>20.2f} "
            f"{r['saved_vs_none']:>8.3f} {r['step_s']:>8.3f} {r['step_vs_none']:>8.2f} "
            f"{r['peak_bytes'] / 2**20:>9.1f} {r['peak_vs_none']:>8.3f}"
        )
    if a.json:
        meta = {"cpu": cpu, "threads": a.threads, "torch": torch.__version__, "dtype": a.dtype}
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
