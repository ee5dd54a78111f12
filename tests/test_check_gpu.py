"""scripts/check_gpu.sh's Python side (titan_thd/check): the CPU mode runs every step that needs no CUDA
and passes, in seconds; its table and JSON name every step; a failing or overlong step is a FAIL row and
the check goes on; --device cuda without CUDA is one `error:` line."""

from __future__ import annotations

import json
import time

import pytest
import torch

from titan_thd.check import cli

STEPS = [
    "1 llama float32", "1 llama mixed bf16", "1 dsv4 float32", "1 dsv4 mixed bf16",
    "2 llama TE attention",
    "3 llama speed+memory", "3 dsv4 speed+memory",
    "4 flash sliding layer", "4 flash csa layer", "4 flash hca layer",
    "5 llama generation", "5 dsv4 generation",
    "6 resident base",
    "7 vllm adapters",
]  # fmt: skip
NEEDS_CUDA = {"2 llama TE attention", "7 vllm adapters"}


@pytest.fixture(scope="module")
def cpu_check(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "check.json"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        start = time.perf_counter()
        code = cli.main(["--device", "cpu", "--out", str(out)])
        seconds = time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)
    return code, json.loads(out.read_text()), seconds


def test_cpu_mode_runs_every_step_and_passes(cpu_check, capsys):
    code, report, seconds = cpu_check
    rows = {r["step"]: r for r in report["steps"]}
    assert list(rows) == STEPS
    for name, row in rows.items():
        if name in NEEDS_CUDA:
            assert (row["verdict"], row["figure"]) == ("SKIP", "needs CUDA"), row
        else:
            assert row["verdict"] == "PASS", row
            assert row["seconds"] >= 0 and row["figure"], row
    assert code == 0
    assert report["device"] == "cpu" and report["machine"]["torch"] == torch.__version__
    # the figures behind the verdicts: mixed bf16 within one bf16 rounding of float32, equal tokens
    mixed = rows["1 dsv4 mixed bf16"]["details"]
    assert len(mixed["losses"]) == len(mixed["reference"]) == 2 and max(mixed["rel"]) <= 2.0**-8
    assert rows["5 llama generation"]["details"]["tokens"]
    assert seconds < 120  # "well under a minute" on an idle machine; this one is shared


def test_the_table_has_one_row_per_step(capsys):
    rows = [cli.Row("1 a", "PASS", 1.25, "fine", {}), cli.Row("2 longer name", "SKIP", 0.0, "needs CUDA", {})]
    lines = cli.table(rows).splitlines()
    assert lines[0].split() == ["step", "verdict", "seconds", "figure"]
    assert lines[2].split() == ["1", "a", "PASS", "1.2", "fine"]
    assert lines[3].startswith("2 longer name  SKIP") and lines[3].endswith("needs CUDA")


def test_a_failing_or_overlong_step_is_a_fail_row_and_the_check_goes_on(tmp_path, capsys):
    ctx = cli.Context(torch.device("cpu"), False, tmp_path)

    def broken(ctx):
        raise KeyError("no such thing")

    def slow(ctx):
        time.sleep(5)
        return cli.Outcome("PASS", "too late")

    row = cli.run_step(cli.Step("x broken", broken), ctx, 1.0)
    assert (row.verdict, row.figure) == ("FAIL", "KeyError: 'no such thing'")
    assert row.details["at"].endswith(f"test_check_gpu.py:{broken.__code__.co_firstlineno + 1}")
    start = time.perf_counter()
    row = cli.run_step(cli.Step("x slow", slow, limit_s=(60.0, 0.2)), ctx, 1.0)
    assert row.verdict == "FAIL" and "time limit" in row.figure and time.perf_counter() - start < 2
    assert cli.run_step(cli.Step("x ok", lambda c: cli.Outcome("PASS", "ok")), ctx, 1.0).verdict == "PASS"
    assert "[x broken] FAILED: KeyError" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_device_cuda_without_cuda_is_one_line(tmp_path, capsys):
    assert cli.main(["--device", "cuda", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --device cuda: ") and "use --device cpu" in err and err.count("\n") == 1
    assert not (tmp_path / "c.json").exists()


def test_the_vllm_step_says_why_it_skips(tmp_path, monkeypatch):
    from titan_thd.check import vllm_adapters

    real = vllm_adapters.importlib.util.find_spec
    monkeypatch.setattr(vllm_adapters.importlib.util, "find_spec", lambda n: None if n == "vllm" else real(n))
    out = vllm_adapters.run(cli.Context(torch.device("cpu"), False, tmp_path))
    assert (out.verdict, out.figure) == (
        "SKIP",
        "vllm is not importable here (install vllm 0.34 to serve the adapters)",
    )


def test_the_vllm_step_writes_one_set_of_adapters_in_both_layouts(tmp_path):
    """What step 7 serves, at a narrow width: vLLM's keys name tensors of its release folder, and expert
    e's factors are the same numbers as in PEFT's fused layout (A rows e * r.., B columns j * E + e)."""
    from safetensors.torch import load_file

    from titan_thd.check import vllm_adapters
    from titan_thd.models.hf.io import SafetensorsFolder

    paths = vllm_adapters.prepare(tmp_path, small=True)
    index = SafetensorsFolder(paths["release"]).tensors
    served = load_file(paths["vllm"] / "adapter_model.safetensors")
    names = {k.removeprefix("base_model.model.").rsplit(".", 2)[0] + ".weight" for k in served}
    assert names <= set(index) and any(".experts.7.w2." in k for k in served)
    fused = load_file(paths["peft"] / "adapter_model.safetensors")
    r, E = vllm_adapters.RANK, 8
    A_fused = fused["base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"]
    B_fused = fused["base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"]
    for e in (0, 5):
        A = served[f"base_model.model.layers.1.ffn.experts.{e}.w1.lora_A.weight"]
        B3 = served[f"base_model.model.layers.1.ffn.experts.{e}.w3.lora_B.weight"]
        assert torch.equal(A, A_fused[e * r : (e + 1) * r])
        assert torch.equal(B3, B_fused[B3.shape[0] :, e::E])  # gate_up_proj = w1 rows, then w3 rows
    config = json.loads((paths["vllm"] / "adapter_config.json").read_text())
    assert config["r"] == r and vllm_adapters.vllm_rank() == 8
    # the reference half of the step: transformers + peft on the dequantised folder, the adapter moves tokens
    prompts = vllm_adapters.prompts_of(vllm_adapters.check_args(True)[1].vocab_size)
    base, adapted = vllm_adapters.transformers_tokens(paths, prompts, torch.device("cpu"))
    assert [len(t) for t in adapted] == [vllm_adapters.NEW_TOKENS] * len(prompts) and adapted != base
