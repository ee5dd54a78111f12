"""Long documents on this machine: the chunked loss and offloaded block inputs, one dsv4 step each.

One process, eager, the dsv4 `tiny` flavor with the release's vocabulary (129,280: the logits are
[T, 129,280]), `full` recomputation, float32 by default, one packed microbatch of T tokens (lognormal
documents). Each configuration runs in a process of its own (its max RSS is its own):

  full logits      today's loss: F.cross_entropy on the [T, V] logits
  chunked          loss.chunked, --chunk rows per chunk (components/chunked_loss.py)
  chunked+offload  the same with activation_checkpoint.offload (on a CPU host and device memory are
                   one: the figure is the copies' cost, not a saving)

  peak live    peak bytes of live tensors over one step (memory/live.py): parameters, gradients,
               AdamW state, activations, the loss's temporaries
  max RSS      the process's peak resident set (getrusage), start-up and warm-up step included
  step         forward + backward + AdamW step, median of --reps after a warm-up step

  .venv/bin/python benchmarks/bench_long.py --tokens 8192 --json /tmp/bench_long.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_memory import _optimizer_state, cpu_name, microbatch
from titan_thd.components.loss import cross_entropy_sum
from titan_thd.config import ActivationCheckpoint
from titan_thd.memory.live import LiveBytes
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.parallel.parallel_dims import ParallelDims

CONFIGS = {"full logits": (0, False), "chunked": (1, False), "chunked+offload": (1, True)}
"""name -> (chunked, offload)."""
VOCAB = 129_280


def one(name: str, tokens: int, chunk: int, reps: int, dtype: torch.dtype) -> dict:
    """One configuration in this process: peak live bytes, max RSS, median step seconds."""
    chunked, offload = CONFIGS[name]
    spec = get_model_spec("dsv4")
    args = dataclasses.replace(get_model_args("dsv4", "tiny"), vocab_size=VOCAB)
    batch, meta = microbatch(VOCAB, tokens)
    torch.manual_seed(0)
    model = spec.build(args).to(dtype).train()
    dims = ParallelDims(pp=1, dp_shard=1, cp=1, tp=1, world_size=1)
    model = spec.parallelize(model, dims, ac=ActivationCheckpoint(mode="full", offload=offload))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    kwargs = {"loss_chunk": chunk} if chunked else {}

    def step() -> None:
        out = model(batch.tokens, meta, **kwargs)
        loss = cross_entropy_sum(out.logits, batch.labels, batch.loss_mask) + sum(out.aux_losses.values())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: the AdamW state exists from here on
    state = [*model.parameters(), *model.buffers(), *_optimizer_state(optimizer)]
    with LiveBytes(state) as live:
        step()
    seconds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - t0)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"config": name, "peak_live": live.peak, "max_rss": rss, "step_s": statistics.median(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child process: one configuration
    parser.add_argument("--json", type=Path)
    a = parser.parse_args()
    torch.set_num_threads(a.threads)
    if a.one:
        print(json.dumps(one(a.one, a.tokens, a.chunk, a.reps, getattr(torch, a.dtype))))
        return
    rows = []
    for name in a.configs.split(","):
        argv = [sys.executable, __file__, "--one", name, "--tokens", str(a.tokens), "--chunk", str(a.chunk)]
        argv += ["--reps", str(a.reps), "--dtype", a.dtype, "--threads", str(a.threads)]
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    cpu, base = cpu_name(), rows[0]
    print(f"{cpu}, {a.threads} thread(s), torch {torch.__version__}, {a.dtype}, dsv4 tiny, V = {VOCAB:,}, "
          f"T = {a.tokens}, chunk {a.chunk}, full recomputation")  # fmt: skip
    print(
        f"{'config':<16} {'peak live GiB':>14} {'vs first':>9} {'max RSS GiB':>12} {'step s':>8} {'vs first':>9}"
    )
    for r in rows:
        print(
            f"{r['config']:<16} {r['peak_live'] / 2**30:>14.2f} {r['peak_live'] / base['peak_live']:>9.3f} "
            f"{r['max_rss'] / 2**30:>12.2f} {r['step_s']:>8.2f} {r['step_s'] / base['step_s']:>9.3f}"
        )
    if a.json:
        meta = {"cpu": cpu, "threads": a.threads, "torch": torch.__version__, "dtype": a.dtype}
        meta |= {"tokens": a.tokens, "chunk": a.chunk, "vocab": VOCAB, "flavor": "tiny"}
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
