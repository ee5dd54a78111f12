"""Steps 2 and 4 of the check: attention kernels and full-width layers on the device.

2. The dense model's attention through Transformer Engine (`model.args.attention_backend = "te"`)
   against the pure PyTorch path, forward and backward, on the same packed documents in bf16. Bound:
   both are compared with the PyTorch path in float32; TE's error may be at most twice the PyTorch bf16
   path's own error plus one bf16 rounding of the largest value (two kernels that each round to bf16).
4. One DeepSeek-V4-Flash-width layer of each type (sliding, CSA, HCA) in bf16, forward + backward at
   8K tokens (one document): each layer's forward / backward time and the memory its forward leaves
   allocated (torch.cuda.memory_allocated after - before: what autograd saved, and its output) against
   the activation estimate per layer (memory/activations.py, the figure the run header plans with).
   Flash's widths, counts and windows; 8 routed experts instead of 256 (experts are weights: a token's
   activations depend on the 6 it is routed to, not on the count) and a 4K vocabulary (the head is not
   a layer). On the CPU: the same layers with every width / 32 at 128 tokens (time only).
"""

from __future__ import annotations

import dataclasses
import time

import torch

from titan_thd.check.steps import Context, Outcome, Step

U_BF16 = 2.0**-8


def _documents(T: int, device: torch.device):
    from titan_thd.data.batch_meta import BatchMeta
    from titan_thd.data.packed_batch import PackedBatch

    lens = [T // 4 + 3, T // 8 - 5, T // 2 - 7, T - (T // 4 + 3) - (T // 8 - 5) - (T // 2 - 7)]
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lens])
    batch = PackedBatch(
        cu_seqlens=cu, cu_seqlens_padded=cu, max_seqlen=max(lens), num_docs=len(lens), position_ids=positions
    )
    return BatchMeta.from_batch(batch, device=device)


def te_attention(ctx: Context) -> Outcome:
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or TE's RuntimeError without a usable CUDA
        return Outcome("SKIP", f"Transformer Engine not importable ({type(e).__name__})", {"error": str(e)})
    from titan_thd.ops.te_attention import TEAttention
    from titan_thd.ops.varlen_attention import VarlenAttention

    T, H, K, D = 8192, 16, 4, 128
    meta = _documents(T, ctx.device)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    q, k, v, dout = (torch.randn(T, n, D, device=ctx.device, generator=g) for n in (H, K, K, H))

    def run(module, dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = module(*leaves, meta)
        out.backward(dout.to(dtype))
        return [out.float(), *(t.grad.float() for t in leaves)]

    native = VarlenAttention().to(ctx.device)
    ref = run(native, torch.float32)
    plain = run(native, torch.bfloat16)
    te = run(TEAttention(H, K, D).to(ctx.device), torch.bfloat16)
    names, worst, details = ["out", "dq", "dk", "dv"], 0.0, {}
    for name, r, p, t in zip(names, ref, plain, te, strict=True):
        scale = r.abs().max().item()
        err_plain, err_te = (p - r).abs().max().item(), (t - r).abs().max().item()
        bound = 2 * err_plain + U_BF16 * scale
        details[name] = {"err_te": err_te, "err_native_bf16": err_plain, "bound": bound}
        worst = max(worst, err_te / bound)
    ok = worst <= 1.0
    return Outcome(
        "PASS" if ok else "FAIL", f"TE vs native, fwd+bwd: worst error {worst:.2f} of its bound", details
    )


def flash_layers(ctx: Context) -> tuple:
    from titan_thd.models import get_model_spec

    spec = get_model_spec("dsv4")
    args = dataclasses.replace(
        spec.flavors["flash"],
        layer_types=("sliding", "csa", "hca"),
        n_hash_layers=0,
        n_experts=8,
        mtp_layers=0,
        vocab_size=4096,
    )
    if not ctx.gpu:
        args, _ = spec.narrow(args, 32)
    return spec, args, 8192 if ctx.gpu else 128


def layer_rows(ctx: Context) -> dict:
    """Every layer's forward / backward seconds and forward-allocated bytes, and the estimate (memoised)."""
    if "layers" in ctx.memo:
        return ctx.memo["layers"]
    from titan_thd.components.loss import cross_entropy_sum
    from titan_thd.data.batch_meta import BatchMeta
    from titan_thd.data.packer import pack_microbatch
    from titan_thd.data.sample import Sample
    from titan_thd.memory.activations import estimate

    spec, args, tokens = flash_layers(ctx)
    dtype, dev = torch.bfloat16, ctx.device
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    allocated = (lambda: torch.cuda.memory_allocated(dev)) if cuda else (lambda: 0)
    est = estimate(spec, args, tokens, dtype)
    with torch.device("meta"):
        model = spec.build(args)
    model = model.to_empty(device=dev)
    model.init_weights(0)
    model = model.to(dtype).train()
    g = torch.Generator().manual_seed(0)
    doc = Sample(
        torch.randint(0, args.vocab_size, (tokens,), generator=g).numpy(), (torch.arange(tokens) > 0).numpy()
    )
    batch = pack_microbatch([doc], tokens, 1, 0)
    meta = BatchMeta.from_batch(batch, device=dev)
    rows = {key: {} for key in model.layers}
    marks: dict[str, float] = {}

    def pre(key):
        def hook(module, inputs):
            sync()
            marks["t"], marks["m"] = time.perf_counter(), allocated()
            h = inputs[0]
            if h.requires_grad:  # its gradient arrives when this layer's backward is done
                h.register_hook(lambda grad: rows[key].update(bwd_end=(sync(), time.perf_counter())[1]))

        return hook

    def post(key):
        def hook(module, inputs, out):
            sync()
            rows[key].update(fwd_s=time.perf_counter() - marks["t"], saved_bytes=allocated() - marks["m"])
            out[0].register_hook(lambda grad: rows[key].update(bwd_start=(sync(), time.perf_counter())[1]))

        return hook

    for key, layer in model.layers.items():
        layer.register_forward_pre_hook(pre(key))
        layer.register_forward_hook(post(key))
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    base = allocated()
    out = model(batch.tokens.to(dev), meta)
    loss = cross_entropy_sum(out.logits, batch.labels.to(dev), batch.loss_mask.to(dev)) + sum(
        out.aux_losses.values()
    )
    loss.backward()
    sync()
    assert torch.isfinite(loss), loss
    for key, r in rows.items():
        r["bwd_s"] = r.pop("bwd_end") - r.pop("bwd_start")
        r["estimate_bytes"] = est.layers[key] if est is not None else None
    result = {
        "rows": rows,
        "types": dict(zip(model.layers, args.layer_types, strict=True)),
        "tokens": tokens,
        "peak_bytes": torch.cuda.max_memory_allocated(dev) - base if cuda else None,
        "widths": {"dim": args.dim, "head_dim": args.head_dim, "n_heads": args.n_heads},
    }
    ctx.memo["layers"] = result
    return result


def layer_step(kind: str) -> Step:
    def run(ctx: Context) -> Outcome:
        result = layer_rows(ctx)
        key = next(k for k, t in result["types"].items() if t == kind)
        r = result["rows"][key]
        figure = f"{result['tokens']} tokens, d={result['widths']['dim']}: fwd {1e3 * r['fwd_s']:.0f} ms, bwd {1e3 * r['bwd_s']:.0f} ms"
        if not ctx.gpu:
            return Outcome("PASS", figure, r)
        saved, est = r["saved_bytes"], r["estimate_bytes"]
        figure += f"; forward keeps {saved / 2**20:,.0f} MiB vs estimate {est / 2**20:,.0f} MiB ({saved / est:.2f}x)"
        # An estimate below what the layer keeps sends long jobs out of memory; above it only wastes.
        ok = saved <= 1.25 * est + 64 * 2**20
        return Outcome("PASS" if ok else "FAIL", figure, r | {"peak_bytes_all_layers": result["peak_bytes"]})

    return Step(f"4 flash {kind} layer", run, limit_s=(180.0, 30.0))


STEPS = [
    Step("2 llama TE attention", te_attention, needs_cuda=True, limit_s=(60.0, 10.0)),
    layer_step("sliding"),
    layer_step("csa"),
    layer_step("hca"),
]
