"""Step 7 of the check: vLLM serves dsv4 adapters in `to-vllm`'s layout as transformers + peft applies
the same adapters in `to-peft`'s layout (greedy tokens equal).

Where `vllm` is importable on a CUDA machine: a small dsv4 at DeepSeek-V4-Flash's widths (3 layers:
sliding, CSA, HCA; 8 experts; a 4096-token vocabulary), seeded, written in the release's format (FP8
e4m3 with power-of-two 128 x 128 block scales, routed experts packed FP4 e2m1 with 1 x 32 e8m0 scales),
and the same weights dequantised as a transformers folder; random rank-8 adapters on attention, shared
expert and experts (B nonzero), written both ways by lora/vllm.py and lora/peft.py. transformers + peft
(float32) on the dequantised folder and vLLM (`LLM(..., enable_lora=True)`, its own FP8 / FP4 kernels,
bfloat16) on the release folder then generate greedily from the same token ids, with and without the
adapter. PASS when the adapted tokens agree; the figure says how many agree without the adapter too (the
adapter must change them). Otherwise SKIP with the reason (no vllm, no CUDA). Never run on a GPU with
vLLM in this project: a FAIL row carries vLLM's own error.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import torch

from titan_thd.check.steps import Context, Outcome, Step

RANK, ALPHA, NEW_TOKENS = 8, 16.0, 16
TARGETS = ("attention", "shared_expert", "experts")


def check_args(small: bool):
    """(spec, args): Flash's widths with 3 layers and 8 experts (`small`: narrowed for a CPU test)."""
    from titan_thd.models import get_model_spec

    spec = get_model_spec("dsv4")
    args = dataclasses.replace(
        spec.flavors["flash"],
        layer_types=("sliding", "csa", "hca"),
        n_experts=8,
        vocab_size=4096,
        n_hash_layers=1,
    )
    if small:
        args, _ = spec.narrow(args, 32)
    return spec, args


def write_release(spec, model: torch.nn.Module, args, out: Path) -> Path:
    """`model` in DeepSeek's release format through the export's own encoder (`convert_hf.py
    to-release`: reference names, FP8 128 x 128 blocks, packed FP4 routed experts, the release's
    config.json and quantization_config), from its transformers export beside `out`."""
    from titan_thd.export.commands import to_release
    from titan_thd.models import hf
    from titan_thd.models.hf.write import DEFAULT_MAX_SHARD_SIZE

    seeded = out.with_name(out.name + "_seeded_hf")
    hf.export(spec, model, args, seeded)
    to_release(seeded, out, "128x128", DEFAULT_MAX_SHARD_SIZE)
    return out


def prepare(work: Path, small: bool = False, seed: int = 0) -> dict[str, Path]:
    """The release folder, its dequantised transformers folder and the two adapter folders (same adapters)."""
    from safetensors.torch import save_file

    from titan_thd.lora import peft, vllm
    from titan_thd.lora.targets import attach, resolve_lora
    from titan_thd.models import hf
    from titan_thd.parallel.fsdp import build_on_meta

    spec, args = check_args(small)
    model = spec.build(args)
    model.init_weights(seed)
    paths = {"release": write_release(spec, model, args, work / "release")}
    dequantised = hf.load(spec, paths["release"])  # what both engines start from
    paths["hf"] = work / "hf"
    hf.export(spec, dequantised, dequantised.args, paths["hf"])
    meta = build_on_meta(lambda: spec.build(args))
    plan = resolve_lora(TARGETS, RANK, ALPHA, False, spec.lora, meta, "dsv4")
    attach(meta, plan)
    g = torch.Generator().manual_seed(seed + 1)
    adapters = {
        n: (torch.rand(p.shape, generator=g) - 0.5) * (0.2 if ".lora_A" in n else 0.05)
        for n, p in meta.named_parameters()
        if ".lora_" in n
    }
    blocks = [f"layers.{i}" for i in meta.layers]
    shapes = {k: tuple(v.shape) for k, v in meta.state_dict().items()}
    served = {}
    for block in blocks:
        served |= vllm.vllm_tensors(adapters, plan, block, spec.hf.to_hf, shapes)
    paths["vllm"] = work / "adapter_vllm"
    paths["vllm"].mkdir()
    save_file(
        {k: v.clone() for k, v in served.items()}, paths["vllm"] / "adapter_model.safetensors"
    )  # w1, w3 share A
    config = vllm.adapter_config(plan, vllm.target_leaves(served), str(paths["release"]))
    (paths["vllm"] / "adapter_config.json").write_text(json.dumps(config, indent=1))
    config = peft.adapter_config(plan, spec.hf.hf_module, base_model=str(paths["hf"]))
    tensors = peft.peft_tensors(adapters, plan, blocks, spec.hf.hf_module)
    paths["peft"] = work / "adapter_peft"
    paths["peft"].mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, paths["peft"] / "adapter_model.safetensors")
    (paths["peft"] / "adapter_config.json").write_text(json.dumps(config, indent=1))
    return paths


def prompts_of(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 40, 130)]


def transformers_tokens(paths: dict[str, Path], prompts, device) -> tuple[list, list]:
    import peft
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(paths["hf"], dtype=torch.float32)
    model = model.to(device).eval()

    def greedy(m) -> list[list[int]]:
        with torch.no_grad():
            return [
                m.generate(t, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[
                    0, t.shape[1] :
                ].tolist()
                for t in (torch.tensor([p], device=device) for p in prompts)
            ]

    base = greedy(model)
    adapted = greedy(peft.PeftModel.from_pretrained(model, paths["peft"]).eval())
    del model
    torch.cuda.empty_cache()
    return base, adapted


def vllm_tokens(paths: dict[str, Path], prompts) -> tuple[list, list]:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process already holds CUDA
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    llm = LLM(
        model=str(paths["release"]),
        enable_lora=True,
        max_lora_rank=vllm_rank(),
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=512,
        gpu_memory_utilization=0.6,
    )
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    lora = LoRARequest("adapter", 1, str(paths["vllm"]))
    base = [o.outputs[0].token_ids for o in llm.generate(inputs, params)]
    adapted = [o.outputs[0].token_ids for o in llm.generate(inputs, params, lora_request=lora)]
    return [list(t) for t in base], [list(t) for t in adapted]


def vllm_rank() -> int:
    from titan_thd.lora.vllm import max_lora_rank

    return max_lora_rank(RANK)


def run(ctx: Context) -> Outcome:
    if importlib.util.find_spec("vllm") is None:
        return Outcome("SKIP", "vllm is not importable here (install vllm 0.34 to serve the adapters)")
    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
        return Outcome("SKIP", "transformers + peft are not importable (./scripts/setup_env.sh test)")
    paths = prepare(ctx.workdir / "vllm_adapters")
    prompts = prompts_of(check_args(False)[1].vocab_size)
    ref_base, ref = transformers_tokens(paths, prompts, ctx.device)
    got_base, got = vllm_tokens(paths, prompts)
    agree = sum(a == b for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True))
    agree_base = sum(
        a == b for x, y in zip(got_base, ref_base, strict=True) for a, b in zip(x, y, strict=True)
    )
    moved = sum(a != b for x, y in zip(ref, ref_base, strict=True) for a, b in zip(x, y, strict=True))
    details = {"vllm": got, "peft": ref, "vllm_base": got_base, "transformers_base": ref_base}
    total = len(prompts) * NEW_TOKENS
    figure = f"{agree} of {total} adapted greedy tokens equal (base: {agree_base}); the adapter moved {moved}"
    ok = got == ref and moved > 0
    return Outcome("PASS" if ok else "FAIL", figure, details)


STEPS = [Step("7 vllm adapters", run, needs_cuda=True, limit_s=(600.0, 30.0))]
