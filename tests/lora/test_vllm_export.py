"""`convert_hf.py to-vllm`: a dsv4 LoRA run trained on a micro folder in DeepSeek's release format (FP8
blocks, packed FP4 experts), exported as the adapters vLLM 0.34 serves on that folder, without vLLM:

- every key is `base_model.model.<a tensor of the folder's index without .weight>.lora_{A,B}.weight`,
  A [r, in] and B [out, r] with the (out, in) of that tensor as stored (FP4: two values per byte), every
  routed expert of every layer has w1, w2 and w3, and w1 / w3 carry the expert's one shared A;
- the folder's weights dequantised here (not by the loader) plus s * B @ A per tensor name (wo_a group by
  group, B's rows g * O : (g + 1) * O with the one A, as vLLM's grouped wo_a layer applies it) equal the
  merged `to-hf` of the same run (float32, <= 1e-6 relative per tensor), and every tensor without an
  adapter is unchanged there: the adapter set is complete;
- a routed-expert projection the run did not adapt is written as a zero update (vLLM packs only whole
  triplets); the checkpoint is read one block at a time;
- what the format cannot carry and a changed base are one `error:` line, and nothing is written.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import torch

from tests.lora.test_lora_export import DSV4, convert_hf, train
from tests.models.dsv4._release import write_micro_release
from titan_thd.lora import vllm
from titan_thd.lora.targets import LoRAPlan, attach, resolve_lora
from titan_thd.models import get_model_spec
from titan_thd.parallel.fsdp import build_on_meta

pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

TARGETS = ("--lora.targets", "attention,attention.wo_a,shared_expert,experts")
KEY = re.compile(r"^base_model\.model\.(.+)\.lora_([AB])\.weight$")
E2M1 = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def convert(*argv) -> tuple[int, str, str]:
    """convert_hf.py's exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = convert_hf.main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(release folder, the run's config, run folder) of a 2-step LoRA run on every dsv4 target."""
    root = tmp_path_factory.mktemp("vllm_export")
    release = write_micro_release(root / "release", (16, 16))
    config, _ = train(root / "run", *DSV4, "--model.hf_path", str(release), *TARGETS)
    return release, config, root / "run"


@pytest.fixture(scope="module")
def exported(run, tmp_path_factory):
    """(adapter folder, its tensors, stdout, the blocks each checkpoint read asked for)."""
    from titan_thd.export import vllm_adapters

    _, config, folder = run
    out = tmp_path_factory.mktemp("vllm_out") / "adapter"
    reads: list[list[str]] = []
    original = vllm_adapters.DcpExport.load

    def spy(self, names):
        reads.append(list(names))
        return original(self, names)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(vllm_adapters.DcpExport, "load", spy)
        rc, stdout, err = convert("to-vllm", folder, out, "--config", config)
    assert rc == 0, err
    return out, load_file(out / "adapter_model.safetensors"), stdout, reads


def dequantised(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights in float32: FP8 codes times their 2-D block's scale, packed FP4 (low nibble
    = even column) times its 1 x 32 block's scale, the rest as stored. Written here from the format's
    definition, independently of titan_thd's loader."""
    cfg = json.loads((folder / "config.json").read_text())
    bm, bn = cfg["quantization_config"]["weight_block_size"]
    raw: dict[str, torch.Tensor] = {}
    for f in folder.glob("*.safetensors"):
        with safe_open(f, "pt") as h:
            raw |= {k: h.get_tensor(k) for k in h.keys()}  # noqa: SIM118 - safe_open has no iterator
    out = {}
    for k, v in raw.items():
        if k.endswith(".scale"):
            continue
        scale = raw.get(k.removesuffix("weight") + "scale")
        if scale is None:
            out[k] = v.float()
        elif v.dtype == torch.float8_e4m3fn:
            rows, cols = v.shape
            grid = scale.float().repeat_interleave(bm, 0)[:rows].repeat_interleave(bn, 1)[:, :cols]
            out[k] = v.float() * grid
        else:
            b = v.view(torch.uint8).long()
            values = torch.stack([E2M1[b & 15], E2M1[b >> 4]], dim=-1).flatten(-2)
            out[k] = values * scale.float().repeat_interleave(32, 1)
    return out


def test_keys_are_the_release_tensors_with_their_shapes(run, exported):
    release, _, _ = run
    out, tensors, stdout, _ = exported
    index = json.loads((release / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = json.loads((release / "config.json").read_text())
    weights = dequantised(release)
    r, E, L = 2, cfg["n_routed_experts"], cfg["num_hidden_layers"]
    pairs: dict[str, set[str]] = {}
    for key, t in tensors.items():
        m = KEY.match(key)
        assert m, key
        name, factor = m.group(1) + ".weight", m.group(2)
        assert name in index, key
        out_f, in_f = weights[name].shape
        assert tuple(t.shape) == ((r, in_f) if factor == "A" else (out_f, r)), (key, t.shape)
        pairs.setdefault(m.group(1), set()).add(factor)
    assert all(f == {"A", "B"} for f in pairs.values())
    expected = set()
    for layer in range(L):
        expected |= {f"layers.{layer}.attn.{p}" for p in ("wq_a", "wq_b", "wkv", "wo_a", "wo_b")}
        expected |= {f"layers.{layer}.ffn.shared_experts.{p}" for p in ("w1", "w2", "w3")}
        expected |= {f"layers.{layer}.ffn.experts.{e}.{p}" for e in range(E) for p in ("w1", "w2", "w3")}
    assert set(pairs) == expected  # every global expert has w1, w2, w3; nothing of MTP
    for layer in range(L):
        for e in range(E):
            a1, a3 = (
                tensors[f"{vllm.PREFIX}layers.{layer}.ffn.experts.{e}.{p}.lora_A.weight"]
                for p in ("w1", "w3")
            )
            assert torch.equal(a1, a3)  # the shared A of w1 / w3
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["use_rslora"]) == (2, 4.0, False)
    assert sorted(config["target_modules"]) == ["w1", "w2", "w3", "wkv", "wo_a", "wo_b", "wq_a", "wq_b"]
    assert "modules_to_save" not in config and not config.get("use_dora")
    assert config["base_model_name_or_path"] == str(release) and config["bias"] == "none"
    command = f"vllm serve {release} --enable-lora --lora-modules adapter={out} --max-lora-rank 8"
    assert command in stdout, stdout


def test_applied_per_tensor_equals_the_merged_export(run, exported, tmp_path):
    release, config, folder = run
    _, tensors, _, reads = exported
    rc, _, err = convert("to-hf", folder, tmp_path / "merged", "--config", config, "--dtype", "float32")
    assert rc == 0, err
    merged = {}
    for f in (tmp_path / "merged").glob("*.safetensors"):
        merged |= load_file(f)
    base = dequantised(release)
    groups, s = json.loads((release / "config.json").read_text())["o_groups"], 4.0 / 2
    adapted = {KEY.match(k).group(1) + ".weight" for k in tensors}
    moved = 0
    for name, W in base.items():
        if name not in merged:
            assert name.startswith("mtp.") or not name.endswith(".weight"), name  # transformers has no MTP
            continue
        if name not in adapted:
            assert torch.equal(merged[name], W), name  # the adapter set covers every change
            continue
        stem = vllm.PREFIX + name.removesuffix(".weight")
        A, B = tensors[f"{stem}.lora_A.weight"].double(), tensors[f"{stem}.lora_B.weight"].double()
        if name.endswith(".attn.wo_a.weight"):  # vLLM's grouped wo_a: one A, group g's rows of B
            rows = B.shape[0] // groups
            applied = torch.cat(
                [
                    W[g * rows : (g + 1) * rows].double() + s * B[g * rows : (g + 1) * rows] @ A
                    for g in range(groups)
                ]
            )
        else:
            applied = W.double() + s * B @ A
        got = merged[name].double()
        rel = (got - applied).norm() / applied.norm()
        assert rel <= 1e-6, (name, rel.item())
        moved += bool((B != 0).any())
    assert moved == len(adapted)  # trained: every written adapter moves its tensor
    # Streamed: each read of the checkpoint asks for one block's adapters.
    assert reads and all(len({n.split(".")[1] for n in names}) == 1 for names in reads), reads


def _meta_with_adapters(targets: tuple[str, ...], rank: int = 2):
    spec = get_model_spec("dsv4")
    model = build_on_meta(lambda: spec.build(spec.flavors["micro"]))
    plan = resolve_lora(targets, rank, 4.0, False, spec.lora, model, "dsv4/micro")
    attach(model, plan)
    return spec, model, plan


def test_a_routed_expert_projection_not_trained_is_a_zero_update():
    spec, model, plan = _meta_with_adapters(("experts.w13",))
    g = torch.Generator().manual_seed(0)
    adapters = {
        n: torch.randn(p.shape, generator=g)
        for n, p in model.named_parameters()
        if n.startswith("layers.0.") and ".lora_" in n
    }
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    out = vllm.vllm_tensors(adapters, plan, "layers.0", spec.hf.to_hf, shapes)
    E, F, d = shapes["layers.0.ffn.experts.w1"]
    assert len(out) == E * 3 * 2
    for e in range(E):
        key = f"{vllm.PREFIX}layers.0.ffn.experts.{e}"
        assert torch.equal(out[f"{key}.w1.lora_A.weight"], adapters["layers.0.ffn.experts.lora_A_w13"][e])
        assert torch.equal(out[f"{key}.w3.lora_B.weight"], adapters["layers.0.ffn.experts.lora_B_w3"][e])
        A2, B2 = out[f"{key}.w2.lora_A.weight"], out[f"{key}.w2.lora_B.weight"]
        assert A2.shape == (2, F) and B2.shape == (d, 2) and not A2.any() and not B2.any()


def test_what_the_format_cannot_carry_is_refused():
    spec, model, plan = _meta_with_adapters(("attention",))
    with pytest.raises(ValueError, match=r"^model llama: to-vllm writes adapters for vLLM's DeepseekV4"):
        vllm.check_plan(plan, "llama")
    big = LoRAPlan(plan.targets, plan.family, 600, 4.0, False)
    with pytest.raises(ValueError, match=r"^lora.rank = 600: to-vllm cannot express it"):
        vllm.check_plan(big, "dsv4")
    family = type(plan.family)({**plan.family.targets}, plan.family.groups)
    family.targets["attention.indexer"] = plan.family.targets["attention.wq_b"]
    with pytest.raises(ValueError, match=r"^lora.targets \['attention.indexer'\]: to-vllm cannot express"):
        vllm.check_plan(LoRAPlan(("attention.indexer",), family, 2, 4.0, False), "dsv4")
    assert [vllm.max_lora_rank(r) for r in (1, 2, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


def test_a_base_folder_without_the_release_names_is_refused(tmp_path):
    from titan_thd.export.vllm_adapters import check_names
    from titan_thd.models.hf.io import SafetensorsFolder

    save_file({"model.layers.0.self_attn.q_a_proj.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    key = f"{vllm.PREFIX}layers.0.attn.wq_a.lora_A.weight"
    with pytest.raises(
        ValueError, match=r"holds no tensor layers.0.attn.wq_a.weight .*DeepSeek's release format"
    ):
        check_names([key], SafetensorsFolder(tmp_path))


def test_bad_inputs_are_one_line_and_write_nothing(run, tmp_path):
    release, config, folder = run
    other = tmp_path / "other"  # the same architecture, one tensor changed: another base
    other.mkdir()
    for f in release.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    for f in sorted(other.glob("*.safetensors")):
        state = load_file(f)
        name = next((k for k, v in state.items() if v.dtype == torch.float32), None)
        if name is not None:
            state[name] = state[name] + 1e-3
            save_file(state, f, metadata={"format": "pt"})
            break
    assert name is not None
    cases = [
        (("--model.hf_path", other), "trained with other settings than the config's: lora.base"),
        (("--lora.enable", "false"), "the config has lora.enable = false"),
        (("--dtype", "float8_e4m3fn"), "expected float32 or bfloat16"),
    ]
    for i, (extra, message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, _, err = convert("to-vllm", folder, out, "--config", config, *extra)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (extra, err)
        assert message in err, (message, err)
        assert not out.exists(), extra


def test_a_base_drawn_from_the_seed_is_refused(run):
    """A run trained without a base folder (model.hf_path empty) has nothing vLLM can load: refused
    before the checkpoint is read (an empty --model.hf_path on the command line takes the recorded base)."""
    from titan_thd.config import load_config
    from titan_thd.export.vllm_adapters import check_vllm
    from titan_thd.startup import resolve_run

    _, config, _ = run
    seeded = resolve_run(load_config(["--job.config_file", str(config), "--model.hf_path", ""]))
    assert seeded.lora is not None and not seeded.cfg.model.hf_path
    with pytest.raises(
        ValueError, match=r"model.hf_path is empty: the run's base was drawn from training.seed"
    ):
        check_vllm(seeded)
