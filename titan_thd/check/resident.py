"""Step 6 of the check: a LoRA base kept as released (models/packed_weight.py) computes on the device what it
computes on the CPU.

Flash-width weights as the release stores them, with random codes and power-of-two scales: an FP8 e4m3
matrix with 128 x 128 scale blocks (wq_b's [H * D, q_lora] at full scale) and a stack of packed FP4
experts with 1 x 32 blocks (w1's [E, F, d]). Forward and input gradient of `base_linear` /
`base_grouped` on the device in float32 and bfloat16, against the same functions on the CPU in float64
(float32 within 1e-5 relative: TF32 is off; bfloat16 within 2^-6, a few roundings of the inputs and
the product). The figure is the time of one forward + backward against a plain matmul with the
dequantised weight held in memory: what per-use dequantisation costs on this device. Without CUDA
(or with `--device cpu`) the same comparison runs on the CPU at a small width, which checks the step.
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from titan_thd.check.steps import Context, Outcome, Step
from titan_thd.models.hf.quant import Format
from titan_thd.models.packed_weight import PackedWeight, base_grouped, base_linear


def _packed(kind: str, shape: tuple[int, ...], g: torch.Generator) -> PackedWeight:
    """A packed weight of random codes (no NaN code) and power-of-two scales 2^-8 .. 2^-4."""
    fmt = Format("fp8", (128, 128), 1) if kind == "fp8" else Format("fp4", (1, 32), 1)
    *lead, rows, cols = shape
    r = PackedWeight(kind, fmt, shape, tuple(slice(0, n) for n in shape))
    if kind == "fp8":
        values = torch.randn(*lead, rows, cols, generator=g) * 64
        r.codes = values.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        r.codes = torch.randint(0, 256, (*lead, rows, cols // 2), generator=g, dtype=torch.uint8)
    r.scale = torch.randint(127 - 8, 127 - 3, fmt.grid_shape(shape), generator=g, dtype=torch.uint8)
    return r


def _on(r: PackedWeight, device: torch.device) -> PackedWeight:
    out = PackedWeight(r.key, r.fmt, r.shape, r.box)
    out.codes, out.scale = r.codes.to(device), r.scale.to(device)
    return out


def _fwd_bwd(fn, x: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.detach().requires_grad_()
    y = fn(x)
    (gx,) = torch.autograd.grad(y, x, dy)
    return y.detach(), gx


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double().cpu() - b).abs().max() / b.abs().max()).item()


def _timed(fn, device: torch.device, repeats: int = 5) -> float:
    fn()  # warm-up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) / repeats


def run(ctx: Context) -> Outcome:
    g = torch.Generator().manual_seed(0)
    # Flash's wq_b and one layer's w1 stack at full scale (CUDA), a small width on the CPU.
    T, dense, experts = (4096, (32768, 1024), (32, 2048, 4096)) if ctx.gpu else (64, (256, 128), (4, 64, 128))
    counts = [T // experts[0]] * experts[0]
    w, e = _packed("fp8", dense, g), _packed("fp4", experts, g)
    cases = {
        "fp8 linear": (w, lambda r: lambda x: base_linear(x, r), (T, dense[1]), (T, dense[0])),
        "fp4 experts": (e, lambda r: lambda x: base_grouped(x, counts, r), (T, experts[2]), (T, experts[1])),
    }
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    rels, times = {}, {}
    try:
        for name, (r, make, x_shape, y_shape) in cases.items():
            x, dy = torch.randn(x_shape, generator=g), torch.randn(y_shape, generator=g)
            ref = _fwd_bwd(make(r), x.double(), dy.double())
            here = _on(r, ctx.device)
            for dtype, bound in ((torch.float32, 1e-5), (torch.bfloat16, 2.0**-6)):
                got = _fwd_bwd(make(here), x.to(ctx.device, dtype), dy.to(ctx.device, dtype))
                rel = max(_rel(got[0], ref[0]), _rel(got[1], ref[1]))
                rels[f"{name} {str(dtype).removeprefix('torch.')}"] = rel
                if rel > bound:
                    return Outcome("FAIL", f"{name} {dtype}: rel {rel:.1e} > {bound:.0e}", {"rel": rels})
            # per-use dequantisation against a matmul with the dequantised weight held (bf16)
            xb = x.to(ctx.device, torch.bfloat16)
            dyb = dy.to(ctx.device, torch.bfloat16)
            held = here.dense(torch.bfloat16)
            plain = (
                (lambda x: F.linear(x, held))
                if held.dim() == 2
                else (lambda x: torch.cat([F.linear(c, held[i]) for i, c in enumerate(x.split(counts))]))
            )
            times[name] = (
                _timed(lambda: _fwd_bwd(make(here), xb, dyb), ctx.device),
                _timed(lambda: _fwd_bwd(plain, xb, dyb), ctx.device),
            )
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    ratio = ", ".join(f"{n} {a / b:.2f}x" for n, (a, b) in times.items())
    worst = max(rels.values())
    return Outcome(
        "PASS",
        f"equal to the CPU (rel <= {worst:.0e}); per-use dequant vs held bf16: {ratio}",
        {"rel": rels, "seconds": {n: list(t) for n, t in times.items()}},
    )


STEPS = [Step("6 resident base", run, limit_s=(120.0, 30.0))]
