"""LoRA: step time and peak RSS against full fine-tuning, and against `peft` on transformers' DeepseekV4.

    .venv/bin/python benchmarks/bench_lora.py --json /tmp/lora.json        (needs the `hf` extra: peft)

Part 1, the trainer (`python -m titan_thd.train` / run_train.sh, one process and NGPU=2 FSDP): the dsv4
recipe's model and documents (`--flavor`, chat SFT, packed microbatches), full fine-tuning (AdamW on every
weight) against LoRA (rank 16 on attention + shared expert + every routed expert, AdamW on the adapters),
each run in its own processes so that its peak RSS per rank (the trainer's `max RSS` line) is its own;
the median step time of the steps after the first two. `--rounds` alternates the runs and keeps each
one's fastest median (other load on a shared machine only ever adds time).

Part 2, the peer a user would pick: one LoRA training step (forward, backward, AdamW on the adapters)
on the same documents and the same adapters (ours exported with `lora/peft.py`, loaded by
`peft.PeftModel.from_pretrained(..., is_trainable=True)`): titan_thd packs the documents into one THD
stream; transformers + peft runs them one at a time ([1, L], no padding: its model is not
document-aware). Both compute the LM cross-entropy only (titan_thd's MTP and indexer losses off), in
float32; the first step's losses are compared. Each side runs in its own process, alternated `--rounds`
times, fastest median kept.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from titan_thd.components.hardware import cpu_model_name  # noqa: E402
from titan_thd.data.batch_meta import BatchMeta  # noqa: E402
from titan_thd.data.packed_batch import IGNORE_INDEX  # noqa: E402
from titan_thd.data.packer import pack_microbatch  # noqa: E402
from titan_thd.data.rows import RowRule  # noqa: E402
from titan_thd.data.sample import Sample  # noqa: E402

TARGETS = "attention,shared_expert,experts"
RSS = re.compile(r"(start-up: max RSS|peak memory \(max RSS\)) per rank: [\d., ]+ GiB \(largest ([\d.]+)\)")


# ============================================================================ part 1: the trainer
def trainer_run(opts, mode: str, ngpu: int, dump: Path) -> dict:
    args = [
        "--config", "dsv4_flash_thd.toml", "--model.flavor", opts.flavor, "--training.steps", str(opts.steps),
        "--optimizer.name", "adamw", "--job.dump_folder", str(dump), "--metrics.overwrite", "true",
        "--training.compile", "false", "--metrics.enable_tensorboard", "false",
    ]  # fmt: skip
    if mode == "lora":
        args += ["--lora.enable", "true", "--lora.rank", "16", "--lora.targets", TARGETS]
    env = os.environ | {"NGPU": str(ngpu), "OMP_NUM_THREADS": str(max(1, opts.threads // ngpu))}
    out = subprocess.run(
        [str(ROOT / "run_train.sh"), *args], env=env, capture_output=True, text=True, cwd=ROOT, check=False
    )
    if out.returncode:
        raise SystemExit(f"{mode} on {ngpu}: exit {out.returncode}\n{out.stdout[-3000:]}{out.stderr[-3000:]}")
    records = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in records if r["step"] > 2]
    rss = dict(RSS.findall(out.stdout + out.stderr))  # the largest rank's, at start-up and at the end
    return {
        "step_s": statistics.median(times),
        "startup_rss_gib": float(rss["start-up: max RSS"]),
        "max_rss_gib": float(rss["peak memory (max RSS)"]),
        "final_loss": records[-1]["loss"],
    }


# ============================================================================ part 2: vs peft (children)
def documents(opts) -> list[Sample]:
    rng = np.random.default_rng(0)
    docs, total = [], 0
    while True:
        n = int(np.clip(rng.lognormal(np.log(300), 0.8), 16, 1024))
        if total + n > opts.tokens:
            return docs
        ids = rng.integers(0, 256, n)
        docs.append(Sample(ids, np.arange(n) > 0))
        total += n


def side(opts) -> dict:
    """One process: `opts.side` (ours / peft) on the folder `opts.weights` with adapters `opts.adapter`."""
    import peft
    import transformers

    from titan_thd.lora.targets import attach, resolve_lora
    from titan_thd.models import get_model_spec
    from titan_thd.models.dsv4 import load_hf

    torch.set_num_threads(opts.threads)
    docs = documents(opts)
    if opts.side == "ours":
        model, args = load_hf(opts.weights)
        model.args = args.__class__(**{**args.__dict__, "mtp_loss_weight": 0.0, "indexer_loss_coeff": 0.0})
        plan = resolve_lora(TARGETS.split(","), 16, 32.0, False, get_model_spec("dsv4").lora, model, "dsv4")
        attach(model, plan)
        saved = torch.load(Path(opts.adapter) / "ours.pt")
        model.load_state_dict(saved, strict=False)
        T = sum(len(d.input_ids) for d in docs)
        batch = pack_microbatch(docs, T, 1, 0, rule=RowRule(T, 1, 1, False))
        meta = BatchMeta.from_batch(batch)

        def step() -> float:
            out = model(batch.tokens, meta)
            labels = torch.where(batch.loss_mask.bool(), batch.labels, IGNORE_INDEX)
            loss = F.cross_entropy(out.logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
            loss.backward()
            return float(loss)
    else:
        base = transformers.DeepseekV4ForCausalLM.from_pretrained(opts.weights, dtype=torch.float32)
        model = peft.PeftModel.from_pretrained(base, opts.adapter, is_trainable=True)

        def step() -> float:
            total = 0.0
            for d in docs:
                ids = torch.as_tensor(d.input_ids, dtype=torch.long)[None]
                logits = model(input_ids=ids).logits[0, :-1]
                loss = F.cross_entropy(logits, ids[0, 1:], reduction="sum")
                loss.backward()
                total += float(loss)
            return total

    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    times, losses = [], []
    for _ in range(opts.warmup + opts.steps):
        t0 = time.perf_counter()
        losses.append(step())
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - t0)
    return {
        "step_s": statistics.median(times[opts.warmup :]),
        "first_loss": losses[0],
        "trained_params": sum(p.numel() for p in trained),
        "tokens": sum(len(d.input_ids) for d in docs),
    }


def _write_peft(out: Path, tensors: dict, config: dict) -> Path:
    """The PEFT folder of whole adapter tensors (the package streams its export from a checkpoint:
    titan_thd/export/adapters.py; here the adapters are in memory already)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def prepare_peer(opts, tmp: Path) -> tuple[Path, Path]:
    """The base folder (the flavor's seeded model, exported) and the adapters, in both formats."""
    from titan_thd.lora.peft import adapter_config, peft_tensors
    from titan_thd.lora.targets import attach, init_adapters, is_adapter, resolve_lora
    from titan_thd.models import get_model_spec
    from titan_thd.models.dsv4 import build_dsv4, export_hf, flavors

    spec = get_model_spec("dsv4")
    torch.manual_seed(0)
    model = build_dsv4(flavors[opts.flavor])
    weights = export_hf(model, model.args, tmp / "base")
    plan = resolve_lora(TARGETS.split(","), 16, 32.0, False, spec.lora, model, "dsv4")
    adapted = copy.deepcopy(model)
    attach(adapted, plan)
    init_adapters(adapted, 1)
    with torch.no_grad():  # a trained adapter: B away from zero
        for n, p in adapted.named_parameters():
            if ".lora_B" in n:
                p.normal_(0, 0.02)
    adapters = {n: p.detach() for n, p in adapted.named_parameters() if is_adapter(n)}
    blocks = [f"layers.{i}" for i in adapted.layers]
    out = _write_peft(
        tmp / "adapter",
        peft_tensors(adapters, plan, blocks, spec.hf.hf_module),
        adapter_config(plan, spec.hf.hf_module, str(weights)),
    )
    torch.save(adapters, out / "ours.pt")
    return weights, out


def child(opts, **extra) -> dict:
    argv = [sys.executable, __file__, "--child", json.dumps(vars(opts) | extra)]
    out = subprocess.run(argv, capture_output=True, text=True, check=False)
    if out.returncode:
        raise SystemExit(f"{extra}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--flavor", default="tiny")
    p.add_argument("--steps", type=int, default=8, help="trainer steps per run (the first two are not timed)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=2048, help="part 2: documents per step")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--peer-steps", dest="peer_steps", type=int, default=3)
    p.add_argument("--skip-trainer", action="store_true")
    p.add_argument("--json", default="")
    p.add_argument("--child", default="")
    opts = p.parse_args()
    if opts.child:
        o = argparse.Namespace(**json.loads(opts.child))
        o.steps = o.peer_steps
        print(json.dumps(side(o)))
        return
    result: dict = {
        "cpu": cpu_model_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not opts.skip_trainer:
            best: dict = {}
            for _ in range(opts.rounds):
                for ngpu in (1, 2):
                    for mode in ("full", "lora"):
                        r = trainer_run(opts, mode, ngpu, tmp / f"{mode}{ngpu}")
                        key = f"{mode}_np{ngpu}"
                        if key not in best or r["step_s"] < best[key]["step_s"]:
                            best[key] = r
            result["trainer"] = best
            print(
                f"{'run':<12} {'step s':>8} {'start-up RSS':>13} {'max RSS GiB/rank':>17} {'final loss':>11}"
            )
            for key, r in best.items():
                print(
                    f"{key:<12} {r['step_s']:>8.3f} {r['startup_rss_gib']:>13.2f} {r['max_rss_gib']:>17.2f} "
                    f"{r['final_loss']:>11.4f}"
                )
            for ngpu in (1, 2):
                f, lo = best[f"full_np{ngpu}"], best[f"lora_np{ngpu}"]
                print(
                    f"{ngpu} process(es): LoRA / full step time {lo['step_s'] / f['step_s']:.2f}, "
                    f"max RSS per rank {lo['max_rss_gib'] / f['max_rss_gib']:.2f}"
                )
        weights, adapter = prepare_peer(opts, tmp)
        peer: dict = {}
        for _ in range(opts.rounds):
            for name in ("ours", "peft"):
                r = child(opts, side=name, weights=str(weights), adapter=str(adapter))
                if name not in peer or r["step_s"] < peer[name]["step_s"]:
                    peer[name] = r
        result["peer"] = peer
        o, q = peer["ours"], peer["peft"]
        print(
            f"LoRA step on {o['tokens']} tokens: titan_thd packed {o['step_s']:.3f} s, transformers + peft "
            f"one document at a time {q['step_s']:.3f} s: {q['step_s'] / o['step_s']:.2f}x; trainable "
            f"{o['trained_params']:,} vs {q['trained_params']:,}; first loss {o['first_loss']:.6f} vs "
            f"{q['first_loss']:.6f}"
        )
    print(f"cpu {result['cpu']}, torch {result['torch']}")
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
