"""Using a trained model: generation over packed THD microbatches and answer-accuracy evaluation.

    sampling.py      greedy / temperature / top-k / top-p choice of the next token
    generate.py      the generation loop, several prompts in one packed batch; full-recompute decoder
    packing.py       prompts packed back to back as one THD microbatch (BatchMeta)
    llama_cache.py   cached decoding of llama (per-layer K / V)
    dsv4_cache.py    cached decoding of dsv4 (window K=V, compressed entries, indexer keys)
    loading.py       a run's model, tokenizer and config in one process (any checkpoint layout)
    chat_tasks.py    the embedded dataset's checker: solve, grade, task families
    evaluation.py    exact-answer / format / tool-call accuracy on held-out conversations

Command lines: scripts/generate.py, scripts/evaluate.py.
"""
