"""Dense Llama-style GQA transformer on packed THD microbatches."""

from titan_thd.models.llama.args import LlamaArgs, flavors, flops_per_step
from titan_thd.models.llama.model import Llama, build_llama, padded_logits
from titan_thd.models.llama.parallelize import apply_compile, parallelize_llama, tp_divides
from titan_thd.models.spec import ModelSpec

spec = ModelSpec(
    name="llama",
    flavors=flavors,
    build=build_llama,
    flops_per_step=flops_per_step,
    # Only the zigzag split balances causal attention (titan_thd.ops.cp_attention).
    cp_mode="zigzag",
    parallelize=parallelize_llama,
    padded_forward=padded_logits,
    tp_divides=tp_divides,
    compile=apply_compile,
)

__all__ = ["Llama", "LlamaArgs", "build_llama", "flavors", "flops_per_step", "parallelize_llama", "spec"]
