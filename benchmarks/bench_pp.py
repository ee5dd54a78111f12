"""Pipeline parallelism: measured vs theoretical bubble, bytes per boundary, peak memory per stage.

For K = 1, pp and 4 pp microbatches per step, pp spawned processes (gloo on CPU, one thread each;
NCCL with one GPU per rank when as many GPUs are visible) run the schedule of
titan_thd/pipeline/ over a llama or dsv4 model split into pp stages (Interleaved1F1B: 2 per rank), on packed mock
microbatches. Per stage and K:
  bubble      measured: 1 - (mean over stages of the time a stage computes) / (the step's wall
              time, the slowest stage's), where a stage computes whenever it is not inside a P2P
              call (transfers on one host are fast, so P2P time is waiting); theoretical:
              (pp - 1) / (K + pp - 1) for GPipe and 1F1B alike (equal stage times, free comms).
  bytes       bytes sent across each boundary per microbatch, counted at the send (forward: the
              activation; backward: its gradient), vs prod(boundary shape) x itemsize.
  memory      the peak of the bytes autograd holds saved for backward (saved-tensor hooks: the
              in-flight microbatches' activations, what 1F1B bounds to pp - stage microbatches)
              and, on CUDA, torch.cuda.max_memory_allocated.

    .venv/bin/python benchmarks/bench_pp.py --json /tmp/bench_pp.json
    .venv/bin/python benchmarks/bench_pp.py --model dsv4 --flavor micro --tokens 256 --json /tmp/bench_pp_dsv4.json

On 2 CPU cores the stages are time-sliced as soon as pp exceeds the cores (or other work runs):
then waiting for a descheduled neighbour shows as bubble too.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from titan_thd.data.batch_meta import BatchMeta
from titan_thd.data.mock import mock_lengths
from titan_thd.data.packer import pack_microbatch
from titan_thd.models import get_model_args, get_model_spec
from titan_thd.parallel.spawn import spawn
from titan_thd.pipeline import schedule as pipeline_schedule
from titan_thd.pipeline import split as pipeline_split


class _Sample:
    def __init__(self, ids: np.ndarray):
        self.input_ids = ids
        self.target_mask = np.arange(len(ids)) > 0


class _Live:
    """Bytes of tensors autograd saved and has not released yet (the peak is what counts)."""

    def __init__(self):
        self.now = self.peak = 0

    def pack(self, t: torch.Tensor):
        n = t.numel() * t.element_size()
        self.now += n
        self.peak = max(self.peak, self.now)
        return _Held(t, n, self)

    @staticmethod
    def unpack(h: _Held) -> torch.Tensor:
        return h.t


class _Held:
    def __init__(self, t, n, live):
        self.t, self.n, self.live = t, n, live

    def __del__(self):
        self.live.now -= self.n


class _TimedSchedule(pipeline_schedule.PipelineSchedule):
    """The schedule with its P2P calls timed and the bytes it sends counted."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.wait_s, self.sent = 0.0, {}

    def _communicate(self, sends, recvs):
        t0 = time.perf_counter()
        for _, consumer, t in sends:
            key = "backward" if consumer.backward else "forward"
            self.sent[key] = self.sent.get(key, 0) + t.numel() * t.element_size()
        out = super()._communicate(sends, recvs)
        self.wait_s += time.perf_counter() - t0
        return out

    def _sum_over_stages(self, sums):  # the step's closing all-reduce waits for the last backward
        t0 = time.perf_counter()
        out = super()._sum_over_stages(sums)
        self.wait_s += time.perf_counter() - t0
        return out


def microbatches(k: int, T: int, vocab: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    cfg = {
        "mode": "distribution",
        "type": "lognormal",
        "min_seq_len": 16,
        "max_seq_len": T,
        "mean_seq_len": max(16, T // 4),
        "lognormal_sigma": 1.0,
    }
    out, lengths = [], iter(mock_lengths(cfg, 64 * k, seed).tolist())
    for _ in range(k):
        docs, used = [], 0
        while (n := next(lengths)) + used <= T:
            docs.append(_Sample(rng.integers(1, vocab, n)))
            used += n
        out.append(pack_microbatch(docs, T, 1, 0))
    return out


def _stage_bench(rank: int, world_size: int, opts: dict) -> dict:
    torch.set_num_threads(1)
    cuda = opts["cuda"]
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    spec = get_model_spec(opts["model"])
    args = dataclasses.replace(get_model_args(opts["model"], opts["flavor"]), vocab_size=opts["vocab"])
    torch.manual_seed(0)
    model = spec.build(args)
    virtual = 2 if opts["schedule"] == "Interleaved1F1B" else 1
    layers = pipeline_split.stage_layers(args.n_layers, world_size, virtual=virtual)
    tied = spec.pipeline.tied(model)
    model = (
        pipeline_split.split_model(spec.pipeline, model, layers, rank, world_size, tied).to(device).train()
    )
    chunks = pipeline_split.chunk_views(spec.pipeline, model, layers, rank, world_size, tied)
    shape = spec.pipeline.boundary_shape(args, opts["tokens"])
    group = dist.new_group(list(range(world_size)))
    sched = _TimedSchedule(chunks, rank, world_size, group, opts["schedule"], shape, torch.float32, device)
    rows = []
    for k in opts["ks"]:
        mbs = microbatches(k, opts["tokens"], args.vocab_size, seed=k)

        def inputs(mbs=mbs):
            return [
                pipeline_schedule.StageInput(
                    mb.tokens.to(device),
                    BatchMeta.from_batch(mb, device=device),
                    mb.labels.to(device),
                    mb.loss_mask.to(device),
                )
                for mb in mbs
            ]

        n = max(1, sum(int(mb.loss_mask.sum()) for mb in mbs))
        sched.step(inputs(), n)  # warm-up (allocator, kernels)
        live = _Live()
        walls, waits = [], []
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        for _ in range(opts["repeats"]):
            model.zero_grad(set_to_none=True)
            sched.wait_s, sched.sent = 0.0, {}
            step_inputs = inputs()
            dist.barrier(group)
            t0 = time.perf_counter()
            with torch.autograd.graph.saved_tensors_hooks(live.pack, live.unpack):
                sched.step(step_inputs, n)
            if cuda:
                torch.cuda.synchronize(device)
            walls.append(time.perf_counter() - t0)
            waits.append(sched.wait_s)
        best = int(np.argmin(walls))
        rows.append(
            {
                "K": k,
                "wall_s": walls[best],
                "p2p_wait_s": waits[best],
                "bytes_per_microbatch": {key: v // k for key, v in sched.sent.items()},
                "peak_saved_activation_bytes": live.peak,
                "peak_cuda_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
            }
        )
    return {"stage": rank, "layers": layers[rank], "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama", choices=["llama", "dsv4"])
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--schedule", default="1F1B", choices=list(pipeline_schedule.SCHEDULES))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens per microbatch (T)")
    ap.add_argument("--vocab", type=int, default=320)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="", help="write the report here")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= a.pp
    ks = [1, a.pp, 4 * a.pp]
    opts = dict(vars(a), ks=ks, cuda=cuda)
    if cuda:
        raise SystemExit("bench_pp: CUDA runs need torchrun-style NCCL ranks; use the CPU (gloo) path here")
    stages = spawn(_stage_bench, a.pp, opts, timeout=3600)
    args = dataclasses.replace(get_model_args(a.model, a.flavor), vocab_size=a.vocab)
    shape = get_model_spec(a.model).pipeline.boundary_shape(args, a.tokens)
    report = {
        "model": a.model,
        "flavor": a.flavor,
        "pp": a.pp,
        "schedule": a.schedule,
        "tokens_per_microbatch": a.tokens,
        "boundary_shape": list(shape),
        "boundary_bytes_expected": math.prod(shape) * 4,
        "device": "cuda" if cuda else "cpu (gloo)",
        "results": [],
    }
    print(f"{a.model}/{a.flavor}, pp {a.pp}, {a.schedule}, T {a.tokens}, boundary {list(shape)} float32")
    print(f"{'K':>4} {'bubble':>8} {'theory':>8} {'step s':>8}  bytes/mb fwd, bwd  peak saved MiB per stage")
    for i, k in enumerate(ks):
        rows = [s["rows"][i] for s in stages]
        # Idle share of the pipeline's step (the slowest stage's wall): 1 - mean busy / wall.
        wall = max(r["wall_s"] for r in rows)
        bubble = 1.0 - float(np.mean([r["wall_s"] - r["p2p_wait_s"] for r in rows])) / wall
        theory = (a.pp - 1) / (k + a.pp - 1)
        sent = rows[0]["bytes_per_microbatch"]
        peaks = [r["peak_saved_activation_bytes"] / 2**20 for r in rows]
        report["results"].append(
            {"K": k, "bubble_measured": bubble, "bubble_theoretical": theory, "stages": rows}
        )
        print(
            f"{k:>4} {bubble:>8.3f} {theory:>8.3f} {max(r['wall_s'] for r in rows):>8.3f}  "
            f"{sent.get('forward', 0)}, {rows[-1]['bytes_per_microbatch'].get('backward', 0)}  "
            + " ".join(f"{p:.1f}" for p in peaks)
        )
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
