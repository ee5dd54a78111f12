"""Pipeline parallelism: a stage split by layer (split.py) and a GPipe / 1F1B / Interleaved1F1B
schedule (schedule.py).

No metadata crosses a stage boundary. Every rank of every stage already holds the step's plan and
its data-parallel replica's K microbatches (the dataloader gives them to all pp ranks alike), runs
the CP partition and builds its own `BatchMeta` per microbatch. What is sent between the ranks of
neighbouring stages is one fixed-shape tensor per microbatch and direction:

    forward   stage s -> s+1   the residual stream   llama [T_local, d], dsv4 mHC [T_local, hc, d]
    backward  stage s+1 -> s   its gradient          (same shape and dtype)

both in the compute dtype (training.mixed_precision_param: bf16 under mixed precision).

    layers = validate_pipeline(parallelism, n_layers, spec.pipeline, name)  # before any group
    parts = build(model, spec, dims, ..., layers=layers)   # runner.py: split, parallelize, schedule
    ce_sum, aux_sums = parts.runner.step(inputs, num_trained)               # sums over all stages

The model says what sits on the first / last stage, what is tied and what crosses a boundary in
its `ModelSpec.pipeline` (models/spec.py); nothing in this package knows a model by name.

activations.py measures what a stage keeps per in-flight microbatch (the dry run's memory lines).

This package sits beside `parallel/` rather than in it because it imports the loss and the batch
metadata (components, data), which `parallel/` must not. Its `__init__` imports nothing: import the
modules themselves.
"""
