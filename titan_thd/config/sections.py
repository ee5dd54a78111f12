"""The configuration's sections: one dataclass per TOML `[section]`, gathered by `Config`.

Every field has a docstring, the string literal right after it: `field_docs()` (schema.py) reads
them from this file's source for `--help`, so a field without one shows an empty help line. A
`Literal[...]` annotation is the field's set of allowed values (`CHOICES`). The order of the
fields here is the order of `--help` and of the printed TOML. Loading (loader.py) and the checks
(checks.py) live next to this file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# The annotations are resolved at run time (typing.get_type_hints, for coercion and CHOICES), so
# the Literal aliases they name are imported here, not only for type checkers; choices.py imports
# nothing, so neither does the config.
from titan_thd.config.choices import (
    ACMode,
    ChatTemplate,
    CompileChoice,
    ComputeChoice,
    CPConfigMode,
    ModelName,
    Policy,
    ReduceChoice,
    Schedule,
    Schema,
)


@dataclass
class Job:
    config_file: str = ""
    """TOML file this run was configured from (set by run_train.sh --config)."""
    dump_folder: str = "./outputs"
    """Folder for metrics.jsonl, TensorBoard events and checkpoints."""
    description: str = ""
    """Free text shown in the log header."""
    print_config: bool = False
    """Print the merged configuration as TOML and exit."""
    preflight: bool = False
    """Check the inputs of a run of NGPU processes (env, default 1) in this one process and exit: config and
    layout, tokenizer, data (tokenised into the cache the run reuses), Hugging Face config, checkpoint to
    resume. run_train.sh does this before torchrun, so an input error is one line."""


@dataclass
class Model:
    name: ModelName = "llama"
    """Model family: `llama` (dense GQA transformer) or `dsv4` (DeepSeek-V4-Flash hybrid)."""
    flavor: str = ""
    """Size preset of the model family (llama: debug, bench; dsv4: micro, tiny, flash). Empty: with
    model.hf_path, the architecture its config.json describes (as transformers reads it); without, the
    family's default (llama debug, dsv4 tiny). A flavor given with model.hf_path must match config.json."""
    hf_path: str = ""
    """Hugging Face checkpoint folder (config.json + safetensors) to initialise the weights from."""
    args: dict = field(default_factory=dict)
    """Model-specific settings over the flavor's: a TOML table [model.args] or `--model.args.NAME VALUE`,
    each a field of the family's args dataclass (titan_thd/models/<name>/args.py, with its
    docstring), e.g. llama attention_backend; dsv4 mtp_loss_weight, indexer_loss_coeff,
    indexer_loss_mode, router_bias_update_rate. An unknown name is refused with the model's list."""


@dataclass
class Data:
    source: Literal["mock", "jsonl", "parquet", "packed"] = "mock"
    """`mock` (generated lengths), `jsonl`, `parquet` or `packed` (output of prepare_packed_data.py)."""
    path: str = ""
    """Dataset file or folder. Relative paths resolve against the working directory, then the
    package assets (`titan_thd/assets/`), where the embedded default dataset lives."""
    format: Literal["auto", Schema] = "auto"
    """Record schema: `auto` (detect from the columns), `messages`, `sharegpt`, `alpaca` or `text`."""
    tokenizer: str = "byte"
    """`byte` (built-in byte-level tokenizer) or a path to a Hugging Face `tokenizer.json`."""
    chat_template: ChatTemplate = "auto"
    """How chat records are rendered: `simple` (the project's markers), `deepseek` (DeepSeek-V4's own
    format, needs its tokenizer.json) or `auto` (deepseek for a tokenizer with DeepSeek's chat tokens)."""
    mock_config: dict = field(
        default_factory=lambda: {
            "mode": "distribution",
            "type": "lognormal",
            "min_seq_len": 16,
            "max_seq_len": 1024,
            "mean_seq_len": 192,
            "lognormal_sigma": 1.0,
        }
    )
    """Mock lengths: {mode="distribution", type="lognormal", min_seq_len, max_seq_len,
    mean_seq_len, lognormal_sigma} or {mode="file", path="lengths.csv"}; or the path of a `.json` file
    holding such an object (relative to the working directory, like data.path; read when the config is
    loaded, so the merged config shows its content)."""
    num_samples: int = 0
    """Mock source: number of samples (0 = 100,000)."""
    pad_to_multiple: int = 0
    """Pad every document to a multiple of this many tokens. 0 = what the CP mode needs: 2 *
    context_parallel_degree for zigzag and hybrid (each split document is cut into 2 * cp chunks), 1
    for contiguous CP or none (set by the start-up checks, which know the model's CP mode; an explicit
    value must satisfy the mode)."""
    trim_padding: bool = True
    """End each microbatch after its last document (rounded up to what the layout needs: multiples of
    pad_to_multiple, the CP split and cp x tp, at least cp x the model's CP halo; data/rows.py) instead
    of padding it to training.tokens_per_microbatch rows:
    no compute is spent on tail padding (the plan spreads a step's documents over its microbatches, so
    they are rarely full). Pipeline parallelism always uses full microbatches (fixed shapes between
    stages); false does so everywhere (fixed shapes, e.g. for CUDA graphs)."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Documents longer than training.tokens_per_microbatch: `truncate` or `drop` (both counted)."""
    num_workers: int = 0
    """DataLoader worker processes that pack microbatches (0 = in the training process)."""
    shuffle: bool = True
    """Shuffle the sample order every epoch (seeded by training.seed and the epoch)."""
    cache_dir: str = ""
    """Where tokenised datasets are cached (empty = <dump_folder>/data_cache)."""
    packed_replan: bool = True
    """data.source = packed: plan the documents of each step's rows again over the DP x CP ranks with
    training.planner (Megatron's _unpack_batch); false trains each packed row as one microbatch."""


@dataclass
class Training:
    steps: int = 20
    """Optimizer steps to run."""
    seed: int = 42
    """Seed of weights and data order; the same seed gives the same run on every parallel layout."""
    global_batch_size: int = 32
    """Samples (documents) per optimizer step, over all data-parallel replicas; for data.source = packed:
    packed rows (one microbatch each), a multiple of the data-parallel degree."""
    tokens_per_microbatch: int = 2048
    """T: tokens per packed microbatch of one data-parallel replica, before the CP split."""
    planner: Policy = "balanced"
    """Microbatch planner: `balanced` (minimise the slowest replica) or `dp_balanced` (Megatron)."""
    planner_cost_attention: float = 0.0
    """Planner cost weight b of sum(len^2) relative to a = 1 per token (0 = derive from the model)."""
    max_norm: float = 1.0
    """Gradient clipping norm (0 disables clipping)."""
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    """Master dtype: of the parameters the optimizer steps, their reduced gradients, the optimizer
    state and the checkpoint: `float32`, `bfloat16` or `float64` (exact parity checks). `bfloat16`
    is pure bf16 (no float32 copy anywhere: updates below ~|w| / 256 are lost, a start-up warning says
    so); for bf16 compute on float32 weights keep `float32` and set mixed_precision_param."""
    mixed_precision_param: ComputeChoice = "auto"
    """Compute dtype of forward and backward (FSDP2 gathers the parameters in it, on every layout, one
    process too): `bfloat16` on float32 master weights is mixed precision; `float32`; `auto` (training.dtype
    itself, except float32 masters on a CUDA GPU with native bf16: bfloat16; CPUs compute float32, see
    docs/results.md §6; printed in the log header). Wider than training.dtype is refused."""
    mixed_precision_reduce: ReduceChoice = "float32"
    """Mixed precision: dtype of the gradient reduce-scatter and of the gradients FSDP accumulates
    unsharded between pipeline microbatches: `float32` (sums of many ranks keep their small terms) or
    `bfloat16` (half the bytes; needs bf16 compute). A pure run reduces in training.dtype."""
    deterministic: bool = False
    """Use deterministic algorithms (for bitwise comparisons)."""
    compile: CompileChoice = "auto"
    """Regional torch.compile (inductor) of the model's element-wise chains: the dsv4 mHC update,
    norms and SwiGLU, the llama SwiGLU (docs/dsv4.md §18). The first step pays the compile (tens of
    seconds on a CPU, logged after it); the float64 results stay the eager ones up to rounding.
    `true`, `false`, or `auto`: on where it was measured faster and the run is long enough to repay
    the compile (ModelSpec.compile.payback_steps; a CPU with a C++ compiler), off elsewhere; the log
    header says which and why."""


@dataclass
class Loss:
    chunked: bool = False
    """Compute the token cross-entropy (and dsv4's MTP cross-entropy) chunk by chunk from the final
    hidden states and the LM head's weight, never the [T, V] logits (components/chunked_loss.py): each
    chunk's logits are made in the forward for their log-sum-exp and again in the backward for their
    gradient (one more LM-head matmul per step), so the loss holds [chunk_tokens, V] instead of [T, V]
    float32 twice. Equal to the full logits' loss and gradients up to rounding, on every layout (the
    vocabulary-parallel head of tensor parallelism included); validation uses it too, generation and
    evaluation keep their logits."""
    chunk_tokens: int = 1024
    """loss.chunked: rows per chunk, 1..training.tokens_per_microbatch (only trained rows are chunked)."""


@dataclass
class Optimizer:
    name: Literal["adamw", "muon"] = "adamw"
    """`adamw` for every parameter, or `muon` (Muon for matrices, AdamW for the rest)."""
    lr: float = 3e-4
    """Peak learning rate."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.95
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    muon_momentum: float = 0.95
    """Muon momentum (Nesterov)."""
    muon_ns_steps: int = 5
    """Muon Newton-Schulz iterations."""
    muon_ns_dtype: Literal["auto", "bfloat16", "float32", "float64"] = "auto"
    """Dtype of Muon's Newton-Schulz iterations: `auto` (bfloat16 where bf16 matmuls are native:
    CUDA, CPUs with AVX512-BF16/AMX; float32 elsewhere, where bf16 is emulated and ~10x slower;
    float64 for float64 parameters; printed in the log header), `bfloat16` (torch's choice),
    `float32` (every parallel layout then matches one process to float32 rounding) or `float64`."""


@dataclass
class LRScheduler:
    warmup_steps: int = 2
    """Linear warmup steps: step i (from 0) uses optimizer.lr * (i + 1) / (warmup_steps + 1)."""
    decay: Literal["cosine", "linear", "none"] = "cosine"
    """Decay after warmup: `cosine`, `linear` or `none`."""
    min_lr_factor: float = 0.1
    """Final learning rate as a fraction of optimizer.lr."""
    total_steps: int = 0
    """Length of the schedule (0 = training.steps); pin it so a resumed run gets the same schedule."""


@dataclass
class LoRA:
    enable: bool = False
    """Train low-rank adapters on the frozen model instead of every weight (docs/lora.md): the base gets
    no gradient, no optimizer state and no gradient reduction; AdamW updates the adapters (optimizer.name
    = muon is refused); checkpoints hold the adapters and their optimizer state, not the base."""
    rank: int = 16
    """Adapter rank r (at most the smaller side of every targeted matrix)."""
    alpha: float = 32.0
    """The update W + s * B @ A is scaled by s = alpha / rank (alpha / sqrt(rank) with lora.rslora)."""
    rslora: bool = False
    """Rank-stabilised scaling, s = alpha / sqrt(rank) (PEFT's use_rslora)."""
    targets: tuple[str, ...] = ("attention",)
    """What to adapt: groups or qualified targets of the model family, matched by exact path (the
    indexer's and the compressors' projections are never adapted). dsv4: `attention` (attention.wq_a,
    attention.wq_b, attention.wkv, attention.wo_b), `shared_expert` (shared_expert.w1, .w3, .w2),
    `experts` (one adapter per routed expert: experts.w13, the fused gate / up with one A, and
    experts.w2), and `attention.wo_a` (trains and merges; PEFT cannot apply it to transformers'
    grouped o_a_proj, so `to-peft` refuses it). llama: `attention` (attention.wq, .wk, .wv, .wo),
    `mlp` (mlp.w1, .w3, .w2)."""
    base_dtype: Literal["master", "released"] = "master"
    """How the frozen base is held. `master`: in the master dtype, like a trained weight. `released`:
    as the model.hf_path folder stores it, FP8 e4m3 blocks and packed FP4 experts as codes + scales
    (1 and 0.5 bytes per value; Flash's base 158 GB instead of 1.14 TB), dequantised per use in the
    forward and the backward (models/packed_weight.py); needs lora.enable and a block-quantised folder
    (DeepSeek's release format)."""


@dataclass
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP degree; -1 = the processes left after the other degrees."""
    data_parallel_replicate_degree: int = 1
    """HSDP replicas: data-parallel groups that each hold a full copy of the parameters, sharded over
    their data_parallel_shard_degree x context_parallel_degree ranks; gradients are reduce-scattered
    inside a replica and all-reduced across replicas. Every replica x shard rank reads its own share
    of the batch (the planner's data-parallel ranks)."""
    context_parallel_degree: int = 1
    """Ranks that split one microbatch's tokens."""
    context_parallel_mode: CPConfigMode = "auto"
    """`auto` (the model's mode: llama zigzag, dsv4 contiguous), `zigzag`, `contiguous` or `hybrid`
    (zigzag models: short documents whole on one rank, only long ones zigzagged); another mode than
    the model's is refused."""
    hybrid_cp_threshold: int = 0
    """context_parallel_mode = hybrid: documents with a padded length below this stay whole on one CP
    rank (0 = T / context_parallel_degree, what one rank holds)."""
    tensor_parallel_degree: int = 1
    """Ranks that split attention heads and MLP columns."""
    pipeline_parallel_degree: int = 1
    """Pipeline stages."""
    pipeline_parallel_schedule: Schedule = "1F1B"
    """Pipeline schedule: `1F1B` (at most pp - rank microbatches in flight), `GPipe` (all forwards,
    then all backwards) or `Interleaved1F1B` (each rank runs `pipeline_parallel_virtual_stages`
    stages, which shrinks the bubble by that factor; the planner then makes the microbatch count a
    multiple of pp). Any number of microbatches per step works, fewer than pp too."""
    pipeline_parallel_virtual_stages: int = 0
    """Stages per rank under Interleaved1F1B (0 = 2 there, 1 for the other schedules)."""
    pipeline_parallel_layers_per_stage: int = 0
    """Transformer layers per pipeline stage (0 = split the layers evenly, earlier stages take
    the remainder); pp x this must equal the model's layers."""
    pipeline_parallel_stage_layers: str = ""
    """Explicit stage split: each stage's layer ids, stages separated by `|`, ranges allowed,
    e.g. `0-2|3,4|5` (empty = `pipeline_parallel_layers_per_stage`). Every layer exactly once,
    in order. The embedding sits on the first stage, the final norm and head on the last."""
    expert_parallel_degree: int = 1
    """Ranks that split the routed experts of every MoE layer (each holds n_experts / ep of them;
    tokens travel to their experts by all-to-all). Must divide dp x cp and the model's n_experts;
    the experts are FSDP-sharded over the dp x cp / ep ranks left (docs/design.md §5.2)."""


@dataclass
class ActivationCheckpoint:
    mode: ACMode = "none"
    """`none` (every activation kept until its backward), `full` (each block keeps only its inputs and
    runs again in the backward; dsv4's MTP block too) or `selective` (only the `regions` of each block
    are recomputed). Routing is never recomputed (docs/design.md §5.5)."""
    regions: tuple[str, ...] = ()
    """mode = selective: the regions of each block to recompute, each model's own (dsv4: mhc, indexer,
    attn_up_proj, moe_act, experts, norms; llama: mlp, norms); a list, or comma-separated on the command
    line. An unknown name is refused with the model's list."""
    layers: int = 0
    """Recompute only the first N blocks of each pipeline stage (Megatron's `block` method), the MTP
    block counted last; 0 = every block."""
    offload: bool = False
    """mode = full: keep each recomputed block's inputs (what full recomputation saves) in host memory
    (pinned on CUDA) from its forward to its backward, and bring them back one block ahead of the
    backward (a side stream on CUDA; copies on a CPU) (parallel/offload.py). Bitwise the same step; the
    memory plan counts those bytes as host memory per rank and per node."""


@dataclass
class Memory:
    host_gib: float = 0.0
    """Host memory of one node in GiB, for the memory plan's host line and refusal
    (activation_checkpoint.offload keeps the recomputed blocks' inputs there): 0 = this machine's
    available memory (MemAvailable); set it for a dry run of another machine, e.g. 2000 for a DGX."""
    ranks_per_node: int = 0
    """Ranks that share one node's host memory: 0 = LOCAL_WORLD_SIZE (torchrun's), in a dry run
    min(world size, 8)."""


@dataclass
class Checkpoint:
    enable: bool = False
    """Save checkpoints and resume from the newest complete one."""
    folder: str = "checkpoint"
    """Checkpoint folder, relative to job.dump_folder."""
    interval: int = 500
    """Save every this many steps (the final step is always saved)."""
    keep_latest_k: int = 0
    """Keep only the newest k checkpoints (0 keeps all)."""
    load_step: int = -1
    """Resume from this step (-1 = the newest complete checkpoint)."""
    allow_changes: tuple[str, ...] = ()
    """Run settings a resume may change, e.g. `--checkpoint.allow_changes lr_scheduler.total_steps,optimizer.lr`
    (TOML: a list). A resume whose schedule, optimizer, batch, data or numerics settings (the keys of
    titan_thd/components/run_settings.py RUN_KEYS, model.args entries, and a LoRA run's lora.base: the
    frozen base's folder fingerprint) differ from the checkpoint's is refused with the changes (old ->
    new) unless every changed key is listed here; the run then continues with the new values and logs
    them. training.seed and training.global_batch_size place the data position and cannot change. Layout
    (parallel degrees, world size) and training.steps are not run settings: DCP reshards, and a change is
    logged. Empty: no changes (docs/design.md §3.11)."""


@dataclass
class Metrics:
    log_freq: int = 1
    """Print the console line every this many steps (metrics.jsonl gets every step)."""
    enable_tensorboard: bool = True
    """Write TensorBoard scalars to <dump_folder>/tb."""
    peak_tflops: float = 0.0
    """Peak TFLOP/s per rank for MFU (0 = a measured matmul peak of the compute dtype)."""
    overwrite: bool = False
    """Let a new run (nothing to resume) replace the metrics.jsonl and TensorBoard events of another run in
    job.dump_folder. Without it such a run is refused, naming the folder; a rerun with the same run settings
    (<dump_folder>/run.json) replaces them anyway, and a resumed run appends."""


@dataclass
class Validation:
    enable: bool = False
    """Evaluate a held-out set every `freq` steps and after the last step (`val/loss`, `val/ppl`)."""
    freq: int = 100
    """Evaluate after every this many optimizer steps (the last step is always evaluated)."""
    fraction: float = 0.0
    """Hold out this fraction (0 < f < 1) of the training documents, chosen by a hash of the document
    index and training.seed (the same on every layout; never trained on). Set this or `path`."""
    path: str = ""
    """A separate validation file, read like data.path (same data.source, data.format, tokenizer).
    Set this or `fraction`."""
    max_batches: int = 0
    """Evaluate at most this many validation batches of training.global_batch_size documents each
    (0 = the whole validation set)."""
    compare_padded: bool = False
    """Also run every validation batch's documents as a padded [B, S] batch (one document per row)
    through the model's padded forward and log `val/loss_padded` and `val/padded_diff` (padded minus
    THD; Megatron's --varlen-sbhd-validation). Needs context and pipeline parallel degree 1."""


@dataclass
class Evaluation:
    enable: bool = False
    """Answer the questions of held-out chat conversations with the model (greedy, cached decoding) and log
    the accuracy graded by the embedded dataset's checker: `val/accuracy` (exact answers),
    `val/format_accuracy`, `val/accuracy/<family>` (titan_thd/inference/evaluation.py). Not with
    pipeline or expert parallelism (scripts/evaluate.py evaluates their checkpoints)."""
    freq: int = 100
    """Evaluate after every this many optimizer steps (the last step is always evaluated)."""
    limit: int = 50
    """Held-out conversations to evaluate (each of their questions is one problem; 0 = all 1,000)."""
    path: str = ""
    """Held-out conversations (a messages JSONL, .gz allowed; "" = the embedded held-out set
    titan_thd/assets/chat_heldout.jsonl.gz, which asks no question of the training set)."""
    max_new_tokens: int = 512
    """Cap of a reply's budget (each reply may have the reference answer's length + 16 tokens)."""


@dataclass
class Comm:
    mode: Literal["default", "fake"] = "default"
    """`default` (torchrun process group) or `fake` (one process simulates the world; a dry run)."""
    init_timeout_seconds: int = 300
    """Timeout of process-group creation and collectives."""


@dataclass
class Config:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    data: Data = field(default_factory=Data)
    training: Training = field(default_factory=Training)
    loss: Loss = field(default_factory=Loss)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lora: LoRA = field(default_factory=LoRA)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    memory: Memory = field(default_factory=Memory)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    evaluation: Evaluation = field(default_factory=Evaluation)
    comm: Comm = field(default_factory=Comm)
