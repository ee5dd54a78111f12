"""Memory: what each rank holds, decided once at start-up, and the measurements behind it.

- plan.py: `plan_memory(run) -> MemoryPlan`, the one entry: every pipeline rank's sharded state,
  stage copy, activations in flight, backward transient, start-up peak and largest FSDP unit (and a
  LoRA base kept as released: its stored bytes, its dequantisation and one all-gather, each part on
  a line); the log header, the dry run and the host-memory refusal read it.
- state.py: parameter, gradient and optimizer-state bytes of a rank's share (`estimate_memory_per_rank`),
  the largest all-gather of a wrapped model, and `size`, the byte formatter of every memory line.
- activations.py: the saved activations of one microbatch per layer, measured (docs/design.md §5.3).
- cache.py: those measured on narrowed copies (a dry run of a large model) kept on disk per model shape.
- live.py: what a process holds, measured (live tensors, max RSS, the host's available memory).
- dry_run.py: a fake-process-group dry run's activations (after its header) and whether its step,
  for which its shards (and a resident base's codes) are filled, fits this machine.

Its `__init__` imports nothing: import the modules themselves.
"""
