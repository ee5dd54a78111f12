"""A run written back in its base's release format (`convert_hf.py to-hf --dtype released`,
models/hf/released.py) and any HF folder written in it (`to-release`).

The base: the dsv4 micro model in DeepSeek's release format (tests/models/dsv4/_release.py: FP8 e4m3
with power-of-two 16 x 16 block scales, routed experts packed FP4 with 1 x 32 e8m0 scales, the rest
float32, several files), trained 2 steps with LoRA on every dsv4 target (a checkpoint).

- Zero update (the checkpoint with every B set to 0): the released export holds every tensor of the
  base folder under its name, dtype and shape, with its quantization_config; its values decoded by the
  loader (models/dsv4/hf_dequant.py) equal the base's bitwise; codes and scales are the base's
  bytes wherever the base's scale is the smallest power of two that fits its block (checked here by
  amax > max * 2^(e - 1), the rest of the blocks listed); the survival lines say "no update".
- The trained run: the printed fraction per target and group equals ||Q(W + dW) - Q(W)|| / ||dW||
  computed from three folders read by the loader: the base (W = Q(W)), the float32 merge (W + dW)
  and the released merge (Q(W + dW)). transformers loads the released folder (it dequantises on a
  CPU) with our loader's per-document logits (<= 1e-5); the logits against the bfloat16 export, and
  the base's, are printed (docs/results.md).
- `to-release` of an HF folder with 48 x 48 FP8 blocks (partial edge blocks on both sides): the
  loader reads it within e4m3 / e2m1 rounding of the original with the smallest scales, `to-release`
  of that release gives back the same values (the bytes but where a block's amax rounded onto the
  scale below's limit), and a LoRA run with lora.base_dtype = released trains on it.
- A full fine-tuning run: every quantised tensor decodes to the encoding of its float32 export's.
- Bad input is one line: `--dtype released` for to-peft, for a DCP folder without the run's config;
  a base folder that is not in the release format is refused.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from tests.lora.test_lora_export import DSV4, LENGTHS, assert_same_logits, convert, hf_logits, train
from tests.models.dsv4._release import write_release
from tests.models.dsv4._util import build, doc_slices, micro, packed
from titan_thd.models import get_model_spec
from titan_thd.models.dsv4 import export_hf, load_hf
from titan_thd.models.dsv4.hf_dequant import check_quantization_config, quantized_sources
from titan_thd.models.hf.io import SafetensorsFolder
from titan_thd.models.hf.quant import Format

transformers = pytest.importorskip("transformers")

TARGETS = ("--lora.targets", "attention,attention.wo_a,shared_expert,experts")
VMAX = {"fp8": 448.0, "fp4": 6.0}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("release_export")
    # the micro model with 32 indexer heads: no indexer score ties between transformers and us
    args = micro(vocab_size=320, index_n_heads=32, index_head_dim=16)
    model = get_model_spec("dsv4").build(args)
    model.init_weights(7)
    base = write_release(model, args, root / "base", block=(16, 16))
    config, _ = train(root / "run", *DSV4, "--model.hf_path", str(base), *TARGETS)
    return root, base, config, root / "run" / "checkpoint" / "step-2"


def _zero_update(step: Path, out: Path) -> Path:
    """A copy of a LoRA checkpoint with every B set to 0 (its merge is the base)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    shutil.copytree(step, out)
    state = _load_state_dict_from_keys(storage_reader=dcp.FileSystemReader(step))
    bs = [k for k in state["model"] if ".lora_B" in k]
    assert bs
    for k in bs:
        state["model"][k] = torch.zeros_like(state["model"][k])
    dcp.save(state, storage_writer=dcp.FileSystemWriter(out), no_dist=True)
    return out


def _decoded(path: Path) -> tuple[SafetensorsFolder, dict, dict]:
    """(the folder, {weight name: Quantized source}, config.json) of a folder, read by the loader."""
    folder = SafetensorsFolder(path)
    config = json.loads((path / "config.json").read_text())
    quantized, _ = quantized_sources(folder.tensors, check_quantization_config(config, str(path)))
    return folder, quantized, config


def _full(source) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in source.shape)


def _unsigned_zero(t: torch.Tensor, packed: bool) -> torch.Tensor:
    """Code bytes with -0 (e4m3 0x80, e2m1 nibble 8) as +0."""
    if not packed:
        return torch.where(t == 0x80, 0, t).to(torch.uint8)
    lo, hi = t & 0xF, t >> 4
    return (torch.where(lo == 8, 0, lo) | (torch.where(hi == 8, 0, hi) << 4)).to(torch.uint8)


def test_a_zero_update_gives_back_the_release(lora_run, tmp_path, capsys):
    root, base, config, step = lora_run
    zero = _zero_update(step, tmp_path / "zero" / "checkpoint" / "step-2")
    rc, out, err = convert(capsys, "to-hf", zero, tmp_path / "out", "--config", config, "--dtype", "released")
    assert rc == 0, err
    survival = [line for line in out.splitlines() if line.startswith("  ")]
    assert survival and all("no update (dW = 0)" in line for line in survival), out
    (folder, quantized, cfg), (got, got_q, got_cfg) = _decoded(base), _decoded(tmp_path / "out")
    assert got_cfg["quantization_config"] == cfg["quantization_config"]
    assert {k: (s.dtype, s.shape) for k, s in got.tensors.items()} == {
        k: (s.dtype, s.shape) for k, s in folder.tensors.items()
    }
    assert got_q.keys() == quantized.keys() and len(quantized) > 50
    smallest, larger = 0, []
    for name, stored in folder.tensors.items():
        if name in quantized or name not in got_q and stored.dtype.itemsize == 1:
            continue  # a scale: compared with its weight below
        if name not in quantized:
            assert torch.equal(got.read(got.tensors[name]), folder.read(stored)), name
    for name, q in quantized.items():
        mine = got_q[name]
        want, have = q.read(folder, _full(q)), mine.read(got, _full(mine))
        # bitwise, but a merge's W + 0 turns -0.0 into +0.0 (IEEE): torch.equal's -0.0 == 0.0
        assert torch.equal(have.view(torch.int32) & 0x7FFFFFFF, want.view(torch.int32) & 0x7FFFFFFF), name
        assert torch.equal(have, want), name
        codes, scale = q.read_codes(folder, _full(q))
        my_codes, my_scale = mine.read_codes(got, _full(mine))
        codes, my_codes = _unsigned_zero(codes, q.packed), _unsigned_zero(my_codes, q.packed)
        # the base's exponents, and whether each block's is the smallest that fits (amax > max * 2^(e-1))
        e = (
            scale.view(torch.uint8).double() - 127
            if scale.dtype.itemsize == 1
            else torch.log2(scale.double())
        )
        bm, bn = q.block
        rows, cols = q.shape
        pad = torch.nn.functional.pad(want.abs(), (0, -cols % bn, 0, -rows % bm))
        amax = pad.view(pad.shape[0] // bm, bm, -1, bn).amax(dim=(1, 3)).double()
        is_smallest = (amax > VMAX["fp4" if q.packed else "fp8"] * torch.exp2(e - 1)) | (e == -127)
        assert torch.equal(my_scale[is_smallest], scale[is_smallest]), name
        per_row = is_smallest.repeat_interleave(bm, 0)[:rows]
        if q.packed:
            keep = per_row.repeat_interleave(bn // 2, 1)
        else:
            keep = per_row.repeat_interleave(bn, 1)[:, :cols]
        assert torch.equal(my_codes[keep], codes[keep]), name
        smallest += int(is_smallest.sum())
        larger += [name] * int((~is_smallest).sum())
    print(f"blocks with the smallest scale: {smallest}; larger: {len(larger)} ({sorted(set(larger))[:4]})")
    assert smallest > 1000


def _target(name: str) -> str | None:
    """The LoRA target of a release tensor name (None: not adapted)."""
    if not name.startswith("layers."):
        return None
    m = re.match(
        r"layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.shared_experts\.(w[123])|ffn\.experts\.\d+\.(w[123]))\.weight$",
        name,
    )
    if m is None:
        return None
    if m[2]:
        return f"attention.{m[2]}"
    if m[3]:
        return f"shared_expert.{m[3]}"
    return "experts.w2" if m[4] == "w2" else "experts.w13"


def test_a_lora_merge_prints_what_survives_and_transformers_loads_it(lora_run, tmp_path, capsys):
    root, base, config, step = lora_run
    rc, out, err = convert(
        capsys, "to-hf", step, tmp_path / "released", "--config", config, "--dtype", "released"
    )
    assert rc == 0, err
    for dtype in ("float32", "bfloat16"):
        rc, _, err = convert(capsys, "to-hf", step, tmp_path / dtype, "--config", config, "--dtype", dtype)
        assert rc == 0, err
    line = r"^  (\S+(?: \(group\))?): ([\d.]+) of the update survives \(norm ratio\), (-?[\d.]+) of it along dW, error ([\d.e+-]+) x"
    printed = {k: (float(a), float(b), float(c)) for k, a, b, c in re.findall(line, out, re.M)}
    (b, bq, _), (r, rq, _) = _decoded(base), _decoded(tmp_path / "released")
    merged = SafetensorsFolder(tmp_path / "float32")
    sums: dict[str, list[float]] = {}
    for name, q in bq.items():
        target = _target(name)
        if target is None:
            continue
        w, qm = q.read(b, _full(q)).double(), rq[name].read(r, _full(q)).double()
        dw = merged.read(merged.tensors[name]).double() - w
        for key in (target, target.split(".")[0] + " (group)"):
            s = sums.setdefault(key, [0.0, 0.0, 0.0, 0.0])
            s[0] += float((qm - w).square().sum())
            s[1] += float(dw.square().sum())
            s[2] += float(((qm - w) * dw).sum())
            s[3] += float((qm - w - dw).square().sum())
    expected = {
        k: ((kept / upd) ** 0.5, along / upd, (err / upd) ** 0.5)
        for k, (kept, upd, along, err) in sums.items()
    }
    assert printed.keys() == expected.keys() and len(expected) == 13, (
        printed,
        expected,
    )  # 10 targets, 3 groups
    for k, v in expected.items():
        assert abs(printed[k][0] - v[0]) <= 6e-5 and abs(printed[k][1] - v[1]) <= 6e-5, (k, printed[k], v)
        assert abs(printed[k][2] - v[2]) <= 6e-3 * v[2], (k, printed[k], v)  # 3 significant digits
    print(
        "survival per target (norm ratio, along dW, error):",
        {k: tuple(round(x, 4) for x in v) for k, v in expected.items()},
    )
    assert all(v[0] > 0 for v in expected.values())

    # transformers loads it (dequantising on a CPU) with our loader's logits
    ours, _ = load_hf(tmp_path / "released")
    vocab = json.loads((base / "config.json").read_text())["vocab_size"]
    theirs = transformers.DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "released", dtype=torch.float32
    ).eval()
    assert_same_logits(ours.eval(), theirs, vocab)

    # the figures of docs/results.md: logits of the released folders against the bfloat16 exports
    zero = _zero_update(step, tmp_path / "zero" / "checkpoint" / "step-2")
    for dtype in ("bfloat16", "released"):  # the base: transformers reads no config.json of DeepSeek's
        rc, _, err = convert(
            capsys, "to-hf", zero, tmp_path / f"base_{dtype}", "--config", config, "--dtype", dtype
        )
        assert rc == 0, err
    tokens, batch = packed(list(LENGTHS), vocab, pad_to=8, tail=21, seed=7)
    rows = [tokens[s] for s in doc_slices(batch)]

    def logits(path: Path) -> list[torch.Tensor]:
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return [hf_logits(model, t) for t in rows]

    def diff(a: list[torch.Tensor], c: list[torch.Tensor]) -> tuple[float, float]:
        """(max |a - c|, RMS(a - c) / RMS(c)) over every document's logits."""
        x, y = torch.cat([t.flatten() for t in a]).double(), torch.cat([t.flatten() for t in c]).double()
        return (x - y).abs().max().item(), ((x - y).square().mean() / y.square().mean()).sqrt().item()

    run_diff = diff(logits(tmp_path / "released"), logits(tmp_path / "bfloat16"))
    base_released = logits(tmp_path / "base_released")
    base_diff = diff(base_released, logits(tmp_path / "base_bfloat16"))
    lora_moves = diff(logits(tmp_path / "float32"), base_released)
    print(
        f"transformers logits, max abs (RMS relative) over {len(rows)} documents: "
        f"run released vs bf16 {run_diff[0]:.3e} ({run_diff[1]:.2e}); base released vs bf16 {base_diff[0]:.3e} "
        f"({base_diff[1]:.2e}); the adapters move float32 logits by {lora_moves[0]:.3e}"
    )
    assert run_diff[0] < lora_moves[0]


def test_to_release_round_trips(tmp_path, capsys):
    args = micro()
    model = build(args, seed=3, dtype=torch.float32)
    src = export_hf(model, args, tmp_path / "hf")
    rc, out, err = convert(
        capsys, "to-release", src, tmp_path / "rel", "--fp8-block", "48x48", "--max-shard-size", "200KB"
    )
    assert rc == 0, err
    assert "wrote" in out and (tmp_path / "rel" / "model.safetensors.index.json").is_file()
    folder, quantized, cfg = _decoded(tmp_path / "rel")
    assert cfg["quantization_config"]["weight_block_size"] == [48, 48]
    hf = SafetensorsFolder(src)
    fp8 = fp4 = 0
    for name, q in quantized.items():
        w = hf.read(hf.tensors[name]).float()
        got = q.read(folder, _full(q))
        codes, scale = q.read_codes(folder, _full(q))
        e = scale.view(torch.uint8).double() - 127
        bm, bn = q.block
        assert (bm, bn) == ((1, 32) if q.packed else (48, 48)), name
        s = torch.exp2(e).repeat_interleave(bm, 0)[: w.shape[0]].repeat_interleave(bn, 1)[:, : w.shape[1]]
        # e4m3: 3 mantissa bits, subnormal step 2^-9; e2m1: steps 0.5 / 1 / 2 (module doc of test_hf_fp8)
        bound = (2.0**-4 * w.abs() + 2.0**-10 * s) if not q.packed else (2.0**-2 * w.abs() + 2.0**-2 * s)
        assert bool(((got - w).abs() <= bound * (1 + 1e-6)).all()), name
        pad = torch.nn.functional.pad(w.abs(), (0, -w.shape[1] % bn, 0, -w.shape[0] % bm))
        amax = pad.view(pad.shape[0] // bm, bm, -1, bn).amax(dim=(1, 3)).double()
        vmax = VMAX["fp4" if q.packed else "fp8"]
        assert bool(((amax <= vmax * torch.exp2(e)) & (amax > vmax * torch.exp2(e - 1))).all()), name
        fp4, fp8 = fp4 + q.packed, fp8 + (not q.packed)
    experts = [k for k in hf.tensors if ".experts." in k]
    assert fp8 > 40 and fp4 == len(experts) > 0  # every routed expert FP4, every other linear FP8
    # a partial edge block on both sides: 64 rows of 48, 128 columns of 48
    assert any(q.shape == (64, 128) for q in quantized.values())
    # again from the release: the same values bitwise, the same bytes but where a block's amax rounded
    # down onto the threshold of the scale below (then that smaller scale, the codes doubled)
    rc, _, err = convert(capsys, "to-release", tmp_path / "rel", tmp_path / "again", "--fp8-block", "48x48")
    assert rc == 0, err
    again, again_q, _ = _decoded(tmp_path / "again")
    assert {k: (v.dtype, v.shape) for k, v in again.tensors.items()} == {
        k: (v.dtype, v.shape) for k, v in folder.tensors.items()
    }
    lower = 0
    for name, q in quantized.items():
        a, c = again_q[name].read(again, _full(q)), q.read(folder, _full(q))
        assert torch.equal(a.view(torch.int32), c.view(torch.int32)), name
        (codes_a, scale_a), (codes_c, scale_c) = (
            again_q[name].read_codes(again, _full(q)),
            q.read_codes(folder, _full(q)),
        )
        same = scale_a == scale_c
        assert bool((scale_a[~same] == scale_c[~same] - 1).all()), name  # only ever the scale below
        lower += int((~same).sum())
        if bool(same.all()):
            assert torch.equal(codes_a, codes_c), name
    print(f"blocks re-encoded one scale lower: {lower}")
    for name, stored in folder.tensors.items():
        if name not in quantized and not name.endswith(".scale"):
            assert torch.equal(again.read(again.tensors[name]), folder.read(stored)), name
    # what it is for: a LoRA run keeps it as released
    train(
        tmp_path / "run",
        *DSV4,
        "--model.hf_path",
        str(tmp_path / "rel"),
        "--lora.base_dtype",
        "released",
        steps=1,
    )


def test_to_release_bad_input_is_one_line(tmp_path, capsys):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    for argv, message in [
        (
            ("to-release", tmp_path, tmp_path / "o1", "--fp8-block", "128"),
            "--fp8-block '128': expected ROWSxCOLS",
        ),
        (("to-release", tmp_path / "src", tmp_path / "full"), "exists and is not empty"),
        (("to-release", tmp_path, tmp_path / "o2"), "the output folder lies inside the source folder"),
    ]:
        rc, _, err = convert(capsys, *argv)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, err
        assert message in err, err


def test_released_needs_a_release_base_and_is_one_line(lora_run, tmp_path, capsys):
    root, base, config, step = lora_run
    cases = [
        (("to-peft", step, "--config", config, "--dtype", "released"), "expected float32 or bfloat16"),
        (("to-hf", step, "--flavor", "micro", "--dtype", "released"), "give the run's --config"),
        (("to-hf", step, "--config", config, "--dtype", "float8_e4m3fn"), "or with --dtype released"),
    ]  # fmt: skip
    for i, ((cmd, src, *rest), message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, _, err = convert(capsys, cmd, src, out, *rest)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (cmd, rest, err)
        assert message in err, (message, err)
        assert not out.exists(), (cmd, rest)
    # a base that is not in the release format
    from titan_thd.models.hf.released import folder_plan

    plain = export_hf(build(micro(), seed=1, dtype=torch.float32), micro(), tmp_path / "plain")
    with pytest.raises(ValueError, match="not a release-format folder"):
        folder_plan(plain)


def test_a_full_fine_tuning_run_is_written_in_its_bases_format(lora_run, tmp_path, capsys):
    """No LoRA: the trained weights (a DCP checkpoint) re-encoded in the base folder's format; each
    quantised tensor decodes to the encoding of the float32 export's, the rest as the base stores it."""
    from titan_thd.models.hf.quant import decoded, encode

    root, base, _, _ = lora_run
    config, _ = train(
        tmp_path / "full", "--model.name", "dsv4", "--model.flavor", "", "--model.hf_path", str(base), steps=1
    )
    step = tmp_path / "full" / "checkpoint" / "step-1"
    for dtype in ("released", "float32"):
        rc, out, err = convert(capsys, "to-hf", step, tmp_path / dtype, "--config", config, "--dtype", dtype)
        assert rc == 0, err
    assert "update survives" not in out
    (b, bq, _), (r, rq, cfg) = _decoded(base), _decoded(tmp_path / "released")
    assert "quantization_config" in cfg and rq.keys() == bq.keys()
    wide = SafetensorsFolder(tmp_path / "float32")
    moved = 0
    for name, q in rq.items():
        w = wide.read(wide.tensors[name])
        fmt = Format("fp4" if q.packed else "fp8", q.block, 1)
        want = decoded(*encode(w, fmt), fmt)
        assert torch.equal(q.read(r, _full(q)), want), name
        moved += not torch.equal(want, bq[name].read(b, _full(q)))
    assert moved > 0  # the step changed what the release format holds
    for name, s in b.tensors.items():
        if name in r.tensors and name not in bq and not name.endswith(".scale"):
            assert r.tensors[name].dtype == s.dtype, name


def test_release_encoder_writes_each_tensor_as_planned():
    from titan_thd.models.hf.released import ReleaseEncoder, StoredAs

    fp8, fp4 = Format("fp8", (16, 16), 1), Format("fp4", (1, 32), 1)
    plan = {
        "a.weight": StoredAs(torch.float8_e4m3fn, fp8, "a.scale", torch.uint8, (32, 48)),
        "e.weight": StoredAs(torch.int8, fp4, "e.scale", torch.float8_e8m0fnu, (4, 64)),
        "ids": StoredAs(torch.float32),
        "norm": StoredAs(torch.bfloat16),
    }
    enc = ReleaseEncoder(plan)
    w = torch.randn(32, 48, dtype=torch.float64)  # a float64 master: encoded from its float32 values
    out = dict(enc("a", "a.weight", w))
    assert out["a.weight"].dtype == torch.float8_e4m3fn and out["a.scale"].dtype == torch.uint8
    assert out["a.scale"].shape == (2, 3)
    out = dict(enc("e", "e.weight", torch.randn(4, 64)))
    assert out["e.weight"].shape == (4, 32) and out["e.scale"].shape == (4, 2)
    assert dict(enc("n", "norm", torch.ones(3)))["norm"].dtype == torch.bfloat16
    assert torch.equal(dict(enc("i", "ids", torch.arange(5)))["ids"], torch.arange(5.0))
    with pytest.raises(ValueError, match="ids: its torch.int64 values do not fit the base's torch.float32"):
        list(enc("i", "ids", torch.tensor([2**24 + 1])))
    with pytest.raises(ValueError, match=r"a.weight: the model's \[32, 32\] is not the base's \[32, 48\]"):
        list(enc("a", "a.weight", torch.randn(32, 32)))
    assert dict(enc("x", "extra", torch.ones(2)))["extra"].dtype == torch.float32  # not in the base
    report = "\n".join(enc.report())
    assert "written as trained: 1 tensors the base does not store" in report
