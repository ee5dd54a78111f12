"""A LoRA run's checkpoint served elsewhere: a dsv4 `micro` LoRA run trained from an HF folder (2 steps,
the Trainer API) and a llama one on its seeded base, then

- `convert_hf.py to-peft` -> `peft.PeftModel.from_pretrained` on transformers' model of the base folder:
  per-document logits equal our model's (adapters read from the checkpoint by inference/loading.py,
  which holds exactly the trainer's weights) to 1e-5 (float32), and the adapters do move them;
- `to-hf` on the LoRA run -> the merged model, `from_pretrained` gives the same logits (float32 export;
  the llama one draws its base from the seed);
- `generate.py --checkpoint <LoRA run>` prints the greedy tokens of transformers + peft's `generate`
  (every chosen token leads its runner-up by more than 10x the logits difference: no rounding luck);
- bad inputs are one `error:` line and write nothing: a full fine-tuning checkpoint, a config without
  [lora], another base, targets PEFT cannot apply (`attention.wo_a`), a quantised dtype for the merge.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import peft  # the test extra installs it: a missing peft fails, never skips
import pytest
import torch

from tests.conftest import TRAIN_ARGS
from tests.models.dsv4._util import build, doc_slices, meta, micro, packed
from titan_thd.config import load_config, to_toml
from titan_thd.data.tokenizer import ByteTokenizer
from titan_thd.inference.loading import config_argv, load_model
from titan_thd.models import hf
from titan_thd.models.dsv4 import export_hf
from titan_thd.parallel.fsdp import build_on_meta
from titan_thd.startup import resolve_run
from titan_thd.train import Trainer

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5
LENGTHS = (5, 37, 130)  # shorter than the window, not a multiple of 4, longer than 128
LORA = ("--lora.enable", "true", "--lora.rank", "2", "--lora.alpha", "4.0")
DSV4 = ("--model.name", "dsv4", "--model.flavor", "", *LORA)


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


convert_hf = _script("convert_hf")


def convert(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = convert_hf.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def train(dump: Path, *extra: str, steps: int = 2) -> tuple[Path, dict[str, torch.Tensor]]:
    """A run of `steps` steps with a checkpoint; (its config written as TOML, the trained state)."""
    cfg = load_config(
        [*TRAIN_ARGS, "--training.steps", str(steps), "--job.dump_folder", str(dump)]
        + ["--checkpoint.enable", "true", "--metrics.peak_tflops", "1", "--optimizer.lr", "3e-3", *extra]
    )
    trainer = Trainer(resolve_run(cfg))
    try:
        trainer.train()
        state = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()
    config = dump.with_suffix(".toml")
    config.write_text(to_toml(cfg))
    return config, state


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared 2-core machine: one thread per process is faster
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dsv4(tmp_path_factory):
    """(base HF folder, the run's config, run folder, trained state, our model loaded from the checkpoint)."""
    root = tmp_path_factory.mktemp("lora_dsv4")
    args = micro(vocab_size=320, index_n_heads=32, index_head_dim=16)  # 32 heads: no indexer score ties
    base = export_hf(build(args, seed=1, dtype=torch.float32), args, root / "base", tokenizer=ByteTokenizer())
    targets = ("--lora.targets", "attention,shared_expert,experts")
    config, state = train(root / "run", *DSV4, "--model.hf_path", str(base), *targets)
    loaded = load_model(config_argv(str(config)), root / "run")
    return base, config, root / "run", state, loaded


@pytest.fixture(scope="module")
def dsv4_peft(dsv4, tmp_path_factory):
    base, config, run, _, _ = dsv4
    out = tmp_path_factory.mktemp("lora_dsv4_peft") / "adapter"
    assert convert_hf.main(["to-peft", str(run), str(out), "--config", str(config)]) == 0  # the run folder
    model = transformers.DeepseekV4ForCausalLM.from_pretrained(base, attn_implementation="eager").eval()
    return out, peft.PeftModel.from_pretrained(model, out).eval()


def logits_of(model, tokens, batch):
    with torch.no_grad():
        return model(tokens, meta(batch)).logits


def hf_logits(model, tokens):
    with torch.no_grad():
        return model(tokens[None]).logits[0]


def assert_same_logits(ours, theirs, vocab: int, base=None) -> None:
    """Per-document logits of our packed batch equal transformers' of each document alone (<= TOL);
    with `base` (our model without the adapters): the adapters move them."""
    tokens, batch = packed(list(LENGTHS), vocab, pad_to=8, tail=21, seed=7)
    logits = logits_of(ours, tokens, batch)
    errors = [(logits[r] - hf_logits(theirs, tokens[r])).abs().max().item() for r in doc_slices(batch)]
    print("max abs logits error per document:", errors)
    assert max(errors) <= TOL, errors
    if base is not None:
        assert (logits - logits_of(base, tokens, batch)).abs().max().item() > 1e-2


def test_loaded_lora_checkpoint_is_the_trained_model(dsv4):
    *_, state, loaded = dsv4
    assert "checkpoint" in loaded.source and "LoRA adapters on" in loaded.source
    got = loaded.model.state_dict()
    assert got.keys() == state.keys() and any(".lora_B" in k for k in got)
    for k, v in state.items():
        assert torch.equal(got[k], v), k


def test_to_peft_loads_in_peft_with_the_trainers_logits(dsv4, dsv4_peft):
    base, config, _, _, loaded = dsv4
    out, served = dsv4_peft
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["base_model_name_or_path"] == str(base) and cfg["r"] == 2 and cfg["lora_alpha"] == 4.0
    assert cfg["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    untrained = load_model(config_argv(str(config))).model  # the base folder + zero B: the base model
    assert_same_logits(loaded.model, served, 320, base=untrained)


def test_to_hf_merges_the_adapters(dsv4, tmp_path, capsys):
    _, config, run, _, loaded = dsv4
    step = run / "checkpoint" / "step-2"
    rc, out, err = convert(
        capsys, "to-hf", step, tmp_path / "merged", "--config", config, "--dtype", "float32"
    )
    assert rc == 0, err
    assert "base + the adapters of 40 tensors" in out and "to-hf: " in err  # 4 blocks x (4 + 3 + 3)
    merged = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert not any("lora" in k for k in merged.state_dict())
    assert_same_logits(loaded.model, merged, 320)
    # bfloat16: the same float32 merge, rounded once when written.
    rc, _, err = convert(capsys, "to-hf", step, tmp_path / "bf16", "--config", config, "--dtype", "bfloat16")
    assert rc == 0, err
    from safetensors.torch import load_file

    wide, narrow = (
        load_file(tmp_path / "merged/model.safetensors"),
        load_file(tmp_path / "bf16/model.safetensors"),
    )
    assert wide.keys() == narrow.keys()
    for k, v in wide.items():
        assert torch.equal(narrow[k], v.to(torch.bfloat16) if v.is_floating_point() else v), k


def test_generate_on_the_lora_checkpoint_equals_transformers_with_peft(dsv4, dsv4_peft, capsys):
    _, config, run, _, loaded = dsv4
    _, served = dsv4_peft
    new, text = 8, "The answer is"
    capsys.readouterr()
    argv = ["--checkpoint", str(run), "--config", str(config), "--raw", "--prompt", text]
    assert _script("generate").main([*argv, "--max_new_tokens", str(new)]) == 0
    printed = capsys.readouterr().out
    tok = loaded.tokenizer
    prompt = [tok.bos_id, *tok.encode(text)]
    unused = list(range(tok.vocab_size, 320))  # rows past the tokenizer's ids: generate.py never picks them
    with torch.no_grad():
        ids = served.generate(
            torch.tensor([prompt]), max_new_tokens=new, do_sample=False, suppress_tokens=unused,
            eos_token_id=None, pad_token_id=tok.pad_id,
        )[0, len(prompt) :].tolist()  # fmt: skip
    stop = next((i for i, t in enumerate(ids) if t in loaded.stop_ids), len(ids))
    assert printed == tok.decode(ids[:stop]) + "\n"
    # No near tie: each chosen token leads by more than 10x the two models' logits difference.
    seq = torch.tensor(prompt + ids)
    tokens, batch = packed([len(seq)], 320)
    ours = logits_of(loaded.model, seq, batch)[len(prompt) - 1 : -1, : tok.vocab_size]
    theirs = hf_logits(served, seq)[len(prompt) - 1 : -1, : tok.vocab_size]
    top2 = ours.topk(2, dim=-1)
    assert top2.indices[:, 0].tolist() == ids
    lead, diff = (top2.values[:, 0] - top2.values[:, 1]).min().item(), (ours - theirs).abs().max().item()
    assert lead > 10 * diff, (lead, diff)


def test_to_hf_merges_into_a_dequantised_fp8_fp4_release(tmp_path, capsys):
    """A base in the release's format (FP8 linears, packed FP4 experts): the merge reads it dequantised,
    as the trainer did, and writes W + s * B @ A of those values in float32, the rest as loaded."""
    from tests.models.dsv4._release import write_release
    from titan_thd.export.merge import merged_weight
    from titan_thd.models import get_model_spec

    args = micro(vocab_size=320)
    release = write_release(build(args, seed=3, dtype=torch.float32), args, tmp_path / "release")
    targets = ("--lora.targets", "attention,experts")
    config, _ = train(tmp_path / "run", *DSV4, "--model.hf_path", str(release), *targets, steps=1)
    rc, _, err = convert(capsys, "to-hf", tmp_path / "run", tmp_path / "merged", "--config", config)
    assert rc == 0, err
    ours = load_model(config_argv(str(config)), tmp_path / "run").model.state_dict()
    merged = hf.load(get_model_spec("dsv4"), tmp_path / "merged").state_dict()
    assert merged.keys() == {k for k in ours if ".lora_" not in k}
    changed = 0
    for k, v in merged.items():
        module, _, leaf = k.rpartition(".")
        a, b = (f"{module}.lora_A", f"{module}.lora_B") if leaf == "weight" else (None, None)
        if leaf in ("w1", "w3", "w2"):
            a, b = f"{module}.lora_A_{'w2' if leaf == 'w2' else 'w13'}", f"{module}.lora_B_{leaf}"
        if a in ours:
            changed += 1
            torch.testing.assert_close(v, merged_weight(ours[k], ours[a], ours[b], 2.0), rtol=1e-6, atol=1e-7)
        else:
            assert torch.equal(v, ours[k]), k
    assert changed == 4 * (4 + 3)  # wq_a, wq_b, wkv, wo_b and the experts' w1, w3, w2 of 4 blocks


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_llama):
    """A llama LoRA run on the seeded base (llama has no model.hf_path), its base as an HF folder."""
    root = tmp_path_factory.mktemp("lora_llama")
    flavor = ("--model.flavor", tiny_llama)
    config, _ = train(root / "run", *flavor, *LORA, "--lora.targets", "attention,mlp")
    run = resolve_run(load_config(config_argv(str(config))))
    base = build_on_meta(lambda: run.spec.build(run.model_args)).to_empty(device="cpu")
    base.init_weights(run.cfg.training.seed)  # what the trainer drew
    hf.export(run.spec, base, run.model_args, root / "base")
    train(root / "full", *flavor, steps=1)  # a full fine-tuning checkpoint
    return root, config, load_model(config_argv(str(config)), root / "run").model


def test_llama_to_peft_and_merge(llama, capsys):
    root, config, ours = llama
    rc, _, err = convert(capsys, "to-peft", root / "run", root / "adapter", "--config", config)
    assert rc == 0, err
    named = json.loads((root / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert "drawn from training.seed" in named  # never null: a seeded base says what it is
    served = peft.PeftModel.from_pretrained(
        transformers.LlamaForCausalLM.from_pretrained(root / "base").eval(), root / "adapter"
    ).eval()
    vocab = ours.args.vocab_size
    untrained = load_model(config_argv(str(config)), untrained=True).model  # seeded base, B = 0
    assert_same_logits(ours, served, vocab, base=untrained)
    rc, _, err = convert(capsys, "to-hf", root / "run", root / "merged", "--config", config)
    assert rc == 0, err  # the base drawn from the seed, tensor by tensor
    assert_same_logits(ours, transformers.LlamaForCausalLM.from_pretrained(root / "merged").eval(), vocab)


def test_bad_inputs_are_one_line_and_write_nothing(dsv4, llama, tmp_path, capsys):
    base, config, run, _, _ = dsv4
    root, llama_config, _ = llama
    cases = [
        (("to-peft", root / "full", "--config", llama_config), "is not a LoRA checkpoint: it holds the whole model"),
        (("to-peft", run, "--config", config, "--lora.enable", "false"), "holds LoRA adapters, but the config has lora.enable = false"),
        (("to-hf", run, "--config", config, "--lora.enable", "false"), "holds LoRA adapters, but the config has lora.enable = false"),
        (("to-peft", run, "--config", config, "--lora.targets", "attention,attention.wo_a"), "lora.targets ['attention.wo_a']"),
        (("to-peft", run, "--config", config, "--model.hf_path", tmp_path / "other"), "trained with other settings than the config's: lora.base"),
        (("to-hf", run, "--config", config, "--dtype", "float8_e4m3fn"), "or with --dtype released in the base folder's own FP8 / FP4 format"),
        (("to-peft", run, "--config", config, "--dtype", "float8_e4m3fn"), "expected float32 or bfloat16"),
    ]  # fmt: skip
    # Another base of the same architecture: a copy of the base folder with one tensor changed.
    from safetensors.torch import load_file, save_file

    (tmp_path / "other").mkdir()
    for f in base.iterdir():
        (tmp_path / "other" / f.name).write_bytes(f.read_bytes())
    state = load_file(base / "model.safetensors")
    first = sorted(state)[0]
    state[first] = state[first] + 1e-3
    save_file(state, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
    for i, ((cmd, src, *rest), message) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc, _, err = convert(capsys, cmd, src, out, *rest)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (cmd, rest, err)
        assert message in err, (message, err)
        assert not out.exists(), (cmd, rest)


@pytest.mark.slow
@pytest.mark.extended  # ~50 s: trains the base recipe and the LoRA recipe (2 steps each)
def test_readme_lora_chain_runs_as_written(tmp_path):
    """The README's chain: train, export, LoRA on the export, to-peft, and the README's transformers
    snippet with its peft line prints what generate.py prints for the LoRA checkpoint."""
    import re
    import subprocess

    from tests.inference.test_readme_hf import README, hf_round_trip, readme_blocks
    from tests.inference.test_readme_hf import run as run_line

    for name in (".venv", "scripts"):
        (tmp_path / name).symlink_to(ROOT / name)
    export, snippet = hf_round_trip()
    lora = next(b for b in readme_blocks("bash") if "convert_hf.py to-peft" in b).strip().splitlines()
    for line in [export[0], export[2], *lora]:
        run_line(line, tmp_path, step=2)
    wrap = re.search(r"`(model = peft\.PeftModel\.from_pretrained\(model, [^`]*)`", README)[1]
    at = snippet.index("chat = ")
    snippet = "import peft\n" + snippet[:at] + wrap + "\n" + snippet[at:]
    proc = subprocess.run(
        [str(tmp_path / ".venv/bin/python"), "-c", snippet], cwd=tmp_path, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    ask = next(line for line in lora if "scripts/generate.py" in line)  # the README's LoRA checkpoint line
    assert run_line(ask, tmp_path, step=2).stdout == proc.stdout
