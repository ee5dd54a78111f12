"""The machine check a user runs before a long job: does this install train here, how fast, how much memory.

    ./scripts/check_gpu.sh [--out check.json]          # the venv of scripts/setup_env.sh
    ./scripts/check_gpu.sh --system-python              # the Python already installed (air-gapped nodes)
    python -m titan_thd.check --device cpu --out c.json  # the same steps minus those that need CUDA

Steps (each timed, under a time limit, with a verdict PASS / FAIL / SKIP; a failing step says what failed
and the check goes on):
1. both recipes for a few steps on the device in float32 and in mixed bf16 (float32 master weights),
   losses against the same steps on the CPU in float32 (recipes.py);
2. the dense model's attention through Transformer Engine against the pure PyTorch path (layers.py);
3. tokens/s and MFU against the GPU's bf16 peak, peak device memory against the run header's per-rank
   estimate (recipes.py);
4. one DeepSeek-V4-Flash-width layer of each type (sliding, CSA, HCA) forward + backward, time and
   memory against the activation estimate per layer (layers.py);
5. greedy generation with the cache on the device equal to the CPU's tokens (generation.py);
6. a LoRA base kept as released (FP8 blocks, packed FP4 experts) dequantised per use on the device
   equal to the CPU path in float64, and what per-use dequantisation costs (resident.py);
7. where `vllm` is importable: vLLM serves adapters in `to-vllm`'s layout on a release-format folder
   with the greedy tokens of transformers + peft on the same adapters (vllm_adapters.py; SKIP otherwise).
On a machine without CUDA (or with `--device cpu`) the same steps run at CPU scale; those that need CUDA
say SKIP. One table at the end, and the same rows in the JSON file of `--out`.
"""
