"""Using a trained model: generation over packed THD microbatches and answer-accuracy evaluation.

    sampling.py      greedy / temperature / top-k / top-p choice of the next token
    generate.py      the generation loop, several prompts in one packed batch; full-recompute decoder
    loading.py       a run's model, tokenizer and config in one process (any checkpoint layout)
    chat_tasks.py    the embedded dataset's checker: solve, grade, task families
    evaluation.py    exact-answer / format / tool-call accuracy on held-out conversations

A family's cached decoder is its `ModelSpec.decoder` (models/<family>/decode.py, beside the attention
it mirrors; the `Decoder` protocol and the packed prompts in models/decoding.py): nothing here imports a
model family. Command lines: scripts/generate.py, scripts/evaluate.py. Exporting a run (the whole
model, the merged model, the adapters) is titan_thd/export/.
"""
