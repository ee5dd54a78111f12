"""The frozen base kept as released (`lora.base_dtype = "released"`, models/packed_weight.py) equals the same
base dequantised up front, in float64.

The folder: the dsv4 micro flavor's seeded weights written in the release's format
(tests/models/dsv4/_release.py: several files and an index, FP8 e4m3 with power-of-two scale blocks,
routed experts packed FP4 with 1 x 32 e8m0 scales), with FP8 blocks of 16 x 16 so that the tensor-
parallel cuts of a model this small fall on whole blocks (the release's 128 x 128 are checked by the
unit tests and refused on a cut that splits them).

- `PackedWeight.dense` of any block-aligned box equals models/dsv4/hf_dequant.py's dequantisation of that
  box (the loader's, checked against transformers' reading by tests/models/dsv4/test_hf_fp8.py),
  bitwise, partial edge blocks too; in bfloat16 too (an e4m3 / e2m1 value times a power of two is a
  bfloat16: no rounding).
- The autograd functions dequantise per use: nothing of W is saved for the backward (saved tensors
  hooks see only x-sized or smaller tensors), and their input gradients are W's.
- Through the Trainer (tests/lora/test_lora_layouts.py's LoRA recipe, every target group, float64):
  LoRA on the resident base equals LoRA on the base dequantised to float64 on one process (losses,
  gradient norms, MTP / indexer terms rel <= 1e-12 per step, adapters <= 1e-10), on one process and on
  FSDP 2, TP 2, PP 2, CP 2, EP 2 x FSDP 2 and TP 2 x EP 2 (4 ranks); extended: HSDP 2 x 2, PP 2 x TP 2
  (GPipe), CP 2 x EP 2.
- A resident run resumes bitwise (the checkpoint holds the adapters; the base is read again), and on the
  base dequantised on load.
- Bad input is one line: released without LoRA, without a folder, a folder with no quantised weight,
  a cut that splits a scale block (the tensor, the block and the degrees that serve it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.lora.test_lora_layouts import COMMON, EP, GPIPE, LORA, _check_adapters, _merge, _runs, train
from tests.models.dsv4._release import write_micro_release
from tests.test_train_compose import CP2, HSDP, PP2, TP2, _compare, _spawn, config
from tests.test_train_layouts import records
from titan_thd.models import get_model_spec, packed_weight
from titan_thd.models.dsv4.hf_dequant import quantized_sources
from titan_thd.models.hf.export import export
from titan_thd.models.hf.io import SafetensorsFolder
from titan_thd.models.hf.quant import Format
from titan_thd.models.packed_weight import PackedWeight
from titan_thd.startup import resolve_run

pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")
BLOCK = (16, 16)
STEPS = 2
RELEASED = ["--lora.base_dtype", "released"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return write_micro_release(tmp_path_factory.mktemp("resident") / "micro", BLOCK)


def _sources(folder: Path):
    stored = SafetensorsFolder(folder)
    sources, _ = quantized_sources(stored.tensors, BLOCK)
    return stored, sources


def _resident(stored: SafetensorsFolder, key: str, source, box) -> PackedWeight:
    fmt = source.format
    r = PackedWeight(key, fmt, tuple(s.stop - s.start for s in box), box)
    r.codes, r.scale = source.read_codes(stored, box)
    return r


def test_dense_equals_the_loaders_dequantisation_on_every_aligned_box(folder):
    stored, sources = _sources(folder)
    seen = set()
    for name, source in sources.items():
        rows, cols = source.shape[-2:]
        bm, bn = source.block
        kind = "fp4" if source.packed else "fp8"
        seen.add(kind)
        # whole, the first / last block rows and columns (edge blocks partial where the size is not a
        # multiple of the block), a middle box
        r_cut = min(rows, bm * max(1, rows // bm // 2))
        c_cut = min(cols, bn * max(1, cols // bn // 2))
        for box in [
            (slice(0, rows), slice(0, cols)),
            (slice(0, r_cut), slice(c_cut, cols)),
            (slice(r_cut, rows), slice(0, c_cut)),
        ]:
            if any(s.stop == s.start for s in box):
                continue
            want = source.read(stored, box)
            r = _resident(stored, name, source, box)
            assert r.fmt.kind == kind and r.fmt.block == (bm, bn)
            assert torch.equal(r.dense(torch.float32), want), (name, box)
            assert torch.equal(r.dense(torch.float64), want.double()), (name, box)
            # exact in bfloat16 too: no rounding of a code times a power of two
            assert torch.equal(r.dense(torch.bfloat16).float(), want), (name, box)
            assert r.codes.numel() * r.codes.element_size() + r.scale.numel() * r.scale.element_size() == (
                r.fmt.stored_bytes(r.shape)
            ), name
    assert seen == {"fp4", "fp8"}


def test_the_autograd_functions_save_nothing_of_w_and_give_ws_gradients(folder):
    stored, sources = _sources(folder)
    name = next(k for k, s in sources.items() if not s.packed and s.shape[-2] >= 32)
    src = sources[name]
    box = tuple(slice(0, n) for n in src.shape)
    w = _resident(stored, name, src, box)
    W = src.read(stored, box).double()
    x = torch.randn(5, W.shape[1], dtype=torch.float64, requires_grad=True)
    saved: list[tuple[int, ...]] = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = packed_weight.base_linear(x, w)
    assert all(s != tuple(W.shape) for s in saved), saved  # W is not kept for the backward
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    assert torch.allclose(y, x @ W.T, rtol=1e-14, atol=1e-14)
    assert torch.allclose(gx, dy @ W, rtol=1e-14, atol=1e-14)

    # the routed experts, one expert dequantised at a time
    parts = [sources[f"layers.1.ffn.experts.{e}.w1.weight"] for e in range(4)]
    inner = tuple(slice(0, n) for n in parts[0].shape)
    pairs = [p.read_codes(stored, inner) for p in parts]
    r = PackedWeight("layers.1.ffn.experts.w1", parts[0].format, (4, *parts[0].shape), (slice(0, 4), *inner))
    r.codes, r.scale = torch.stack([c for c, _ in pairs]), torch.stack([s for _, s in pairs])
    Ws = [p.read(stored, inner).double() for p in parts]
    counts = [2, 0, 3, 1]
    x = torch.randn(sum(counts), Ws[0].shape[1], dtype=torch.float64, requires_grad=True)
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = packed_weight.base_grouped(x, counts, r)
    assert all(s[-2:] != tuple(Ws[0].shape) for s in saved), saved
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad(y, x, dy)
    rows = torch.repeat_interleave(torch.arange(4), torch.tensor(counts))
    want_y = torch.stack([x[i] @ Ws[e].T for i, e in enumerate(rows.tolist())])
    want_gx = torch.stack([dy[i] @ Ws[e] for i, e in enumerate(rows.tolist())])
    assert torch.allclose(y, want_y, rtol=1e-14, atol=1e-14)
    assert torch.allclose(gx, want_gx, rtol=1e-14, atol=1e-14)


def _lora(dump: Path, folder: Path, *extra: str):
    return train(dump, "dsv4", STEPS, "--model.hf_path", str(folder), *extra)


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory):
    """LoRA on the base dequantised to float64 on load (lora.base_dtype = master), one process."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("resident_runs")
    try:
        ref = _lora(path / "dsv4-one", folder)
    finally:
        torch.set_num_threads(threads)
    return path, ref


def test_one_process_resident_equals_the_dequantised_base(folder, reference):
    path, ref = reference
    got = _lora(path / "resident-one", folder, *RELEASED)
    # every frozen matrix the folder stores quantised (not the embedding, head, routers): 4 layers x
    # (attention 5, compressor 2 on 3 layers, indexer 2 + its compressor 2 on 2 CSA layers, shared 3,
    # routed 3) + the MTP block's
    assert ref["resident"] == 0 and got["resident"] >= 4 * 11, got["resident"]
    _compare(path, "resident-one", "dsv4")
    _check_adapters("resident-one", got, ref)


def _layouts(folder: Path) -> dict[int, dict]:
    base = ["--model.hf_path", str(folder), *RELEASED]
    return {
        2: {
            "resident-fsdp2": ("dsv4", 2, base, STEPS),
            "resident-tp2": ("dsv4", 2, [*TP2, *base], STEPS),
            "resident-pp2": ("dsv4", 2, [*PP2, *base], STEPS),
            "resident-cp2": ("dsv4", 2, [*CP2, *base], STEPS),
        },
        4: {
            "resident-ep2-fsdp2": ("dsv4", 4, [EP, "2", *base], STEPS),
            "resident-tp2-ep2": ("dsv4", 4, [*TP2, EP, "2", *base], STEPS),
        },
    }


@pytest.mark.slow
def test_layouts_on_the_resident_base_equal_one_process_on_the_dequantised_base(folder, reference):
    path, ref = reference
    for world, layouts in _layouts(folder).items():
        ranks = _spawn(_runs, world, path, layouts)
        for name in layouts:
            assert all(r[name]["resident"] > 0 for r in ranks), name
            _compare(path, name, "dsv4")
            _check_adapters(name, _merge(ranks, name), ref)


def _error(tmp_path: Path, *extra: str) -> str:
    with pytest.raises(ValueError) as e:
        resolve_run(config(tmp_path / "bad", "dsv4", 1, *LORA["dsv4"], *COMMON, *extra))
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_bad_input_is_one_line(folder, tmp_path):
    msg = _error(tmp_path, *RELEASED, "--lora.enable", "false")
    assert "lora.base_dtype = 'released' without lora.enable = true" in msg, msg
    msg = _error(tmp_path, *RELEASED)
    assert "needs model.hf_path" in msg, msg
    # a folder of float weights (transformers' format, what to-hf writes): nothing to keep as released
    spec = get_model_spec("dsv4")
    model = spec.build(spec.flavors["micro"])
    model.init_weights(7)
    plain = export(spec, model, spec.flavors["micro"], tmp_path / "plain")
    msg = _error(tmp_path, *RELEASED, "--model.hf_path", str(plain))
    assert "stores no block-quantised weight" in msg and "lora.base_dtype = 'master'" in msg, msg


def test_a_cut_inside_a_scale_block_is_refused_with_the_degrees_that_serve_it():
    fp8 = Format("fp8", (128, 128), 1)
    packed_weight.check_box("w", fp8, (1024, 512), (slice(0, 512), slice(0, 512)), "tp 2")  # whole blocks
    packed_weight.check_box("w", fp8, (1000, 512), (slice(896, 1000), slice(0, 512)), "tp 2")  # the end
    with pytest.raises(ValueError) as e:
        packed_weight.check_box(
            "layers.0.attn.wq_b.weight", fp8, (384, 64), (slice(192, 384), slice(0, 64)), "tp 2"
        )
    msg = str(e.value)
    assert "layers.0.attn.wq_b.weight [384, 64] is cut at rows [192, 384) of 384" in msg, msg
    assert "scale blocks of 128 x 128" in msg and "[1, 3]" in msg and "tp 2" in msg, msg
    fp4 = Format("fp4", (1, 32), 1)
    packed_weight.check_box("e", fp4, (4, 64, 96), (slice(0, 2), slice(0, 64), slice(32, 64)), "ep 2, tp 3")
    with pytest.raises(ValueError, match=r"columns \[0, 48\) of 96 .* 1 x 32; .*\[1, 3\]"):
        packed_weight.check_box("e", fp4, (4, 64, 96), (slice(0, 2), slice(0, 64), slice(0, 48)), "tp 2")


def test_mixed_bf16_on_the_resident_base_equals_the_dequantised_base(folder, tmp_path):
    """bf16 compute on float32 masters (FSDP2's casting on one rank, which leaves the resident base
    out): the dequantised values are bfloat16 numbers either way, so the runs agree to the bf16
    products' summation order (bitwise on the machines tried; the bound leaves room for another)."""
    mixed = ["--training.dtype", "float32", "--training.mixed_precision_param", "bfloat16"]
    runs = {}
    for base in ("master", "released"):
        got = _lora(tmp_path / base, folder, *mixed, "--lora.base_dtype", base)
        assert (got["resident"] > 0) == (base == "released"), base
        runs[base] = records(tmp_path / base)
    assert len(runs["master"]) == STEPS
    for a, b in zip(runs["master"], runs["released"], strict=True):
        keys = ("loss", "grad_norm", "aux/mtp", "aux/indexer")
        print(f"mixed step {a['step']}: " + ", ".join(f"{k} rel {abs(b[k] / a[k] - 1):.1e}" for k in keys))
        for key in keys:
            assert b[key] == pytest.approx(a[key], rel=1e-3), (a["step"], key, a[key], b[key])


@pytest.mark.parametrize(
    "ac",
    [["--activation_checkpoint.mode", "full"], ["--activation_checkpoint.mode", "selective",
     "--activation_checkpoint.regions", "attn_up_proj,experts,moe_act"]],
    ids=["full", "selective"],
)  # fmt: skip
def test_recomputation_on_the_resident_base_equals_the_dequantised_base(folder, reference, ac):
    """A recomputed forward dequantises again (nothing of W was kept): the same numbers."""
    path, ref = reference
    name = f"resident-ac-{ac[1]}"
    got = _lora(path / name, folder, *RELEASED, *ac)
    assert got["resident"] > 0
    _compare(path, name, "dsv4")
    _check_adapters(name, got, ref)


def test_a_resident_run_resumes_bitwise_and_on_the_dequantised_base(folder, tmp_path):
    """The checkpoint holds the adapters only; the resident base is read again from the folder: 2 steps,
    resume, 2 more equals 4 straight (bitwise), and the same checkpoint resumes on the base dequantised
    on load (lora.base_dtype is how the base is held, not what is trained) to float64 rounding."""
    from titan_thd.train import Trainer

    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "4"]
    lora = [*LORA["dsv4"], "--lora.enable", "true", "--lora.rank", "4", "--lora.alpha", "8"]

    def run(dump: Path, steps: int, base: str) -> None:
        extra = [*lora, *ckpt, "--model.hf_path", str(folder), "--lora.base_dtype", base]
        trainer = Trainer(resolve_run(config(dump, "dsv4", steps, *extra)))
        try:
            trainer.train()
        finally:
            trainer.close()

    run(tmp_path / "straight", 4, "released")
    run(tmp_path / "resumed", 2, "released")
    run(tmp_path / "resumed", 4, "released")
    straight, resumed = records(tmp_path / "straight"), records(tmp_path / "resumed")
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    for a, b in zip(straight, resumed, strict=True):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"], (a["step"], a, b)
    run(tmp_path / "on_master", 2, "released")
    run(tmp_path / "on_master", 4, "master")
    for a, b in zip(straight[2:], records(tmp_path / "on_master")[2:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-12, abs=0), (a["step"], a["loss"], b["loss"])


@pytest.mark.slow
@pytest.mark.extended
def test_more_compositions_on_the_resident_base_equal_one_process(folder, reference):
    """HSDP 2 x 2 (the base replicated over both), PP 2 x TP 2 (GPipe) and CP 2 x EP 2, 4 ranks."""
    path, ref = reference
    base = ["--model.hf_path", str(folder), *RELEASED]
    layouts = {
        "resident-hsdp2x2": ("dsv4", 4, [*HSDP, *base], STEPS),
        "resident-pp2-tp2": ("dsv4", 4, [*PP2, *TP2, *GPIPE, *base], STEPS),
        "resident-cp2-ep2": ("dsv4", 4, [*CP2, EP, "2", *base], STEPS),
    }
    ranks = _spawn(_runs, 4, path, layouts)
    for name in layouts:
        assert all(r[name]["resident"] > 0 for r in ranks), name
        _compare(path, name, "dsv4")
        _check_adapters(name, _merge(ranks, name), ref)
