"""Configuration: nested dataclass sections, TOML files and `--section.field value` overrides.

Precedence: command line > TOML file > defaults. Every field has a docstring (the string literal
right after it), which `--help` prints. Unknown keys, wrong types and invalid values are
`ValueError`s that name the field, the value and what is allowed. `validate()` runs before any
process group exists.

    cfg = load_config(["--job.config_file", "train_configs/debug_dense_thd.toml",
                       "--training.steps", "20"])
"""

from __future__ import annotations

import ast
import difflib
import json
import os
import sys
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from titan_thd.components.precision import ComputeChoice, ReduceChoice, validate_precision
from titan_thd.components.run_settings import FIXED, RUN_KEYS
from titan_thd.data.planner import Policy
from titan_thd.data.sources import Schema
from titan_thd.data.tokenizer import ChatTemplate
from titan_thd.jsonfile import read_json_object
from titan_thd.models import ModelName
from titan_thd.parallel.activation_checkpoint import ACMode
from titan_thd.parallel.context_parallel import CPConfigMode
from titan_thd.pipeline import Schedule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


# ============================================================================ sections
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
    README "Precision"; printed in the log header). Wider than training.dtype is refused."""
    mixed_precision_reduce: ReduceChoice = "float32"
    """Mixed precision: dtype of the gradient reduce-scatter and of the gradients FSDP accumulates
    unsharded between pipeline microbatches: `float32` (sums of many ranks keep their small terms) or
    `bfloat16` (half the bytes; needs bf16 compute). A pure run reduces in training.dtype."""
    deterministic: bool = False
    """Use deterministic algorithms (for bitwise comparisons)."""
    compile: bool = False
    """Regional torch.compile (inductor) of the model's element-wise chains: the dsv4 mHC update,
    norms and SwiGLU, the llama SwiGLU (docs/dsv4.md §18). The first step pays the compile
    (tens of seconds on a CPU); the float64 results stay the eager ones up to rounding."""


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
    titan_thd/components/run_settings.py RUN_KEYS, and model.args entries) differ from the checkpoint's is
    refused with the changes (old -> new) unless every changed key is listed here; the run then continues
    with the new values and logs them. training.seed and training.global_batch_size place the data
    position and cannot change. Layout (parallel degrees, world size) and training.steps are not run
    settings: DCP reshards, and a change is logged. Empty: no changes (docs/design.md §3.11)."""


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
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    parallelism: Parallelism = field(default_factory=Parallelism)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    metrics: Metrics = field(default_factory=Metrics)
    validation: Validation = field(default_factory=Validation)
    evaluation: Evaluation = field(default_factory=Evaluation)
    comm: Comm = field(default_factory=Comm)


# ============================================================================ introspection
def _section_types() -> dict[str, type]:
    return {f.name: f.default_factory().__class__ for f in fields(Config)}  # type: ignore[misc]


def field_docs() -> dict[str, str]:
    """{"section.field": docstring} read from the string literal that follows each field."""
    tree = ast.parse(Path(__file__).read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    docs: dict[str, str] = {}
    for section, cls in _section_types().items():
        body = classes[cls.__name__].body
        for stmt, nxt in zip(body, body[1:] + [None]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                doc = ""
                if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
                    doc = " ".join(str(nxt.value.value).split())
                docs[f"{section}.{stmt.target.id}"] = doc
    return docs


def _field_type(section_cls: type, name: str) -> Any:
    return typing.get_type_hints(section_cls)[name]


def _choices() -> dict[str, tuple[str, ...]]:
    """{"section.field": allowed values} of every field annotated `Literal[...]`."""
    return {
        f"{section}.{f.name}": typing.get_args(typ)
        for section, cls in _section_types().items()
        for f in fields(cls)
        if typing.get_origin(typ := _field_type(cls, f.name)) is Literal
    }


CHOICES: dict[str, tuple[str, ...]] = _choices()
"""Fields whose value must be one of a fixed set (their Literal annotations)."""


def _closest(name: str, options: list[str]) -> str:
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else ""


# ============================================================================ coercion
def coerce(key: str, value: Any, typ: Any, from_cli: bool) -> Any:
    """Convert `value` to `typ` (from the command line: from its text); ValueError naming the key, the
    value and the expected type. Also used for the entries of [model.args] (titan_thd/inputs.py)."""

    def bad(expected: str) -> ValueError:
        return ValueError(f"{key}: got {value!r}, expected {expected}")

    if typ is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise bad("true or false")
    if typ is int:
        if isinstance(value, bool):
            raise bad("an integer")
        if isinstance(value, int):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise bad("an integer")
    if typ is float:
        if isinstance(value, bool):
            raise bad("a number")
        if isinstance(value, (int, float)):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise bad("a number")
    if typing.get_origin(typ) is Literal:
        allowed = typing.get_args(typ)
        if value in allowed:
            return value
        raise bad(f"one of {', '.join(allowed)}")
    if typ is str:
        if isinstance(value, str):
            return value
        raise bad("a string")
    if typing.get_origin(typ) is tuple:  # tuple[X, ...]: a list, or comma-separated on the command line
        if from_cli and isinstance(value, str):
            value = [v.strip() for v in value.split(",") if v.strip()]
        if not isinstance(value, (list, tuple)):
            raise bad("a list")
        item = typing.get_args(typ)[0]
        return tuple(coerce(f"{key}[{i}]", v, item, from_cli) for i, v in enumerate(value))
    if typ is dict or typing.get_origin(typ) is dict:
        if isinstance(value, dict):
            return value
        if from_cli and isinstance(value, str):
            try:
                parsed = json.loads(value)
            except json.JSONDecodeError:
                try:
                    parsed = tomllib.loads(f"v = {value}")["v"]
                except tomllib.TOMLDecodeError:
                    parsed = None
            if isinstance(parsed, dict):
                return parsed
        if isinstance(value, str) and value.endswith(".json"):
            return _json_table(key, value)
        raise bad('a table, e.g. {"mode": "file", "path": "lengths.csv"}, or the path of a .json file')
    raise AssertionError(f"unsupported config type {typ} for {key}")


def _json_table(key: str, value: str) -> dict:
    """The JSON object of file `value` (relative to the working directory); ValueError naming the file
    and, for bad JSON, its line and column."""
    return read_json_object(Path(value).expanduser().absolute(), prefix=f"{key} = {value!r}: ")


# ============================================================================ loading
# Fields that are open tables: `--section.field.KEY VALUE` sets one entry (checked by the component
# that reads the table).
_TABLES = ("model.args",)
# [model] settings that moved into [model.args] (they belong to one model family).
_MOVED_TO_MODEL_ARGS = (
    "attention_backend",
    "mtp_loss_weight",
    "indexer_loss_coeff",
    "indexer_loss_mode",
    "router_bias_update_rate",
)


def _table_entry(value: Any, from_cli: bool) -> Any:
    """A table entry's value: from the command line a TOML literal when it reads as one (0.2, true,
    ["a", "b"]), else the text itself; from a TOML file as it is."""
    if not from_cli or not isinstance(value, str):
        return value
    try:
        return tomllib.loads(f"v = {value}")["v"]
    except tomllib.TOMLDecodeError:
        return value


def _apply(cfg: Config, key: str, value: Any, from_cli: bool, origin: str) -> None:
    sections = _section_types()
    section, _, name = key.partition(".")
    if section not in sections or not name:
        raise ValueError(f"{origin}: unknown config section '{section}'.{_closest(section, list(sections))}")
    table, _, entry = key.rpartition(".")
    if table in _TABLES and entry:
        getattr(getattr(cfg, section), table.partition(".")[2])[entry] = _table_entry(value, from_cli)
        return
    if section == "model" and name in _MOVED_TO_MODEL_ARGS:
        raise ValueError(
            f"{origin}: model.{name} is a setting of one model family: write it as --model.args.{name} "
            f"VALUE (TOML: `{name} = ...` under [model.args])"
        )
    cls = sections[section]
    names = [f.name for f in fields(cls)]
    if name not in names:
        raise ValueError(
            f"{origin}: unknown key '{key}'.{_closest(name, names)} Valid keys of [{section}]: {', '.join(names)}"
        )
    try:
        coerced = coerce(key, value, _field_type(cls, name), from_cli)
    except ValueError as e:
        raise ValueError(f"{origin}: {e}") from None
    setattr(getattr(cfg, section), name, coerced)


def _load_toml(cfg: Config, path: Path) -> None:
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"job.config_file: {path} is a folder, expected a TOML file") from None
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{e.object[e.start]:02x}), expected TOML"
        ) from None
    except OSError as e:
        raise ValueError(f"{path}: cannot read: {e}") from None
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: invalid TOML: {e}") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ValueError(f"{path}: top-level key '{section}' must be a [section] table")
        for name, value in table.items():
            _apply(cfg, f"{section}.{name}", value, from_cli=False, origin=str(path))


def _parse_cli(argv: list[str]) -> list[tuple[str, str]]:
    pairs: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            raise ValueError(f"command line: expected --section.field, got {arg!r}")
        key = arg[2:]
        if "=" in key:
            key, value = key.split("=", 1)
            i += 1
        else:
            if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                raise ValueError(f"command line: {arg} needs a value (booleans too: {arg} true)")
            # The next token is always the value, so negative numbers (-1) work as values.
            value = argv[i + 1]
            i += 2
        pairs.append((key, value))
    return pairs


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML file (--job.config_file), then command-line overrides; validated."""
    argv = list(sys.argv[1:] if argv is None else argv)
    pairs = _parse_cli(argv)
    cfg = Config()
    for key, value in pairs:
        if key == "job.config_file":
            cfg.job.config_file = value
    if cfg.job.config_file:
        _load_toml(cfg, Path(cfg.job.config_file))
    for key, value in pairs:
        _apply(cfg, key, value, from_cli=True, origin="command line")
    validate(cfg)
    return cfg


# ============================================================================ validation
def validate(cfg: Config) -> None:
    """Value checks that need no process group. Raises ValueError naming the field and value."""
    for key, allowed in CHOICES.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value not in allowed:
            raise ValueError(f"{key}: got {value!r}, expected one of {', '.join(allowed)}")

    def positive(key: str, value: float, allow_zero: bool = False) -> None:
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(
                f"{key}: got {value}, expected a {'non-negative' if allow_zero else 'positive'} value"
            )

    t, p = cfg.training, cfg.parallelism
    positive("training.steps", t.steps)
    positive("training.global_batch_size", t.global_batch_size)
    positive("training.tokens_per_microbatch", t.tokens_per_microbatch)
    positive("training.max_norm", t.max_norm, allow_zero=True)
    positive("training.planner_cost_attention", t.planner_cost_attention, allow_zero=True)
    validate_precision(t.dtype, t.mixed_precision_param, t.mixed_precision_reduce)
    positive("optimizer.lr", cfg.optimizer.lr)
    positive("optimizer.weight_decay", cfg.optimizer.weight_decay, allow_zero=True)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, allow_zero=True)
    positive("lr_scheduler.total_steps", cfg.lr_scheduler.total_steps, allow_zero=True)
    positive("data.pad_to_multiple", cfg.data.pad_to_multiple, allow_zero=True)
    positive("data.num_workers", cfg.data.num_workers, allow_zero=True)
    positive("data.num_samples", cfg.data.num_samples, allow_zero=True)
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, allow_zero=True)
    positive("metrics.log_freq", cfg.metrics.log_freq)
    positive("metrics.peak_tflops", cfg.metrics.peak_tflops, allow_zero=True)
    positive("optimizer.eps", cfg.optimizer.eps)
    positive("comm.init_timeout_seconds", cfg.comm.init_timeout_seconds)
    for key in ("beta1", "beta2", "muon_momentum"):
        value = getattr(cfg.optimizer, key)
        if not 0.0 <= value < 1.0:
            raise ValueError(f"optimizer.{key}: got {value}, expected 0 <= value < 1")
    if not 1 <= cfg.optimizer.muon_ns_steps < 100:
        raise ValueError(f"optimizer.muon_ns_steps: got {cfg.optimizer.muon_ns_steps}, expected 1..99")
    if cfg.checkpoint.load_step < -1:
        raise ValueError(
            f"checkpoint.load_step: got {cfg.checkpoint.load_step}, expected -1 (newest) or a step >= 0"
        )
    _validate_allow_changes(cfg.checkpoint.allow_changes)
    if not 0.0 <= cfg.lr_scheduler.min_lr_factor <= 1.0:
        raise ValueError(f"lr_scheduler.min_lr_factor: got {cfg.lr_scheduler.min_lr_factor}, expected 0..1")
    if cfg.checkpoint.keep_latest_k == 1:
        raise ValueError("checkpoint.keep_latest_k: got 1, expected 0 (keep all) or >= 2")
    for key in (
        "context_parallel_degree",
        "tensor_parallel_degree",
        "pipeline_parallel_degree",
        "expert_parallel_degree",
    ):
        positive(f"parallelism.{key}", getattr(p, key))
    positive("parallelism.hybrid_cp_threshold", p.hybrid_cp_threshold, allow_zero=True)
    if p.data_parallel_shard_degree == 0 or p.data_parallel_shard_degree < -1:
        raise ValueError(
            f"parallelism.data_parallel_shard_degree: got {p.data_parallel_shard_degree}, expected -1 or >= 1"
        )
    # The rules of each parallelism, and T against data.pad_to_multiple, need the model and the world
    # size: titan_thd.inputs.check_inputs checks them, still before any process group.
    if cfg.data.source in ("jsonl", "parquet", "packed") and not cfg.data.path:
        raise ValueError(f"data.source = {cfg.data.source} needs data.path")
    _validate_validation(cfg)
    _validate_evaluation(cfg)


def _validate_allow_changes(names: tuple[str, ...]) -> None:
    for name in names:
        if name in FIXED:
            raise ValueError(
                f"checkpoint.allow_changes: {name} cannot change on a resume (it places the checkpoint's data "
                "position); start a new run in another job.dump_folder instead"
            )
        if name not in RUN_KEYS and not name.startswith("model.args."):
            allowed = [k for k in RUN_KEYS if k not in FIXED]
            raise ValueError(
                f"checkpoint.allow_changes: got {name!r}, expected run settings among {', '.join(allowed)}, "
                "model.args.<name>"
            )


def _validate_evaluation(cfg: Config) -> None:
    """[evaluation] checks (evaluation.path is read when the trainer starts)."""
    e, p = cfg.evaluation, cfg.parallelism
    if e.freq < 1:
        raise ValueError(f"evaluation.freq: got {e.freq}, expected a positive number of steps")
    if e.limit < 0:
        raise ValueError(
            f"evaluation.limit: got {e.limit}, expected 0 (all) or a positive number of conversations"
        )
    if e.max_new_tokens < 1:
        raise ValueError(
            f"evaluation.max_new_tokens: got {e.max_new_tokens}, expected a positive number of tokens"
        )
    if e.enable and (p.pipeline_parallel_degree > 1 or p.expert_parallel_degree > 1):
        raise ValueError(
            "evaluation.enable = true needs every rank to gather the whole model: got pipeline_parallel_degree "
            f"{p.pipeline_parallel_degree}, expert_parallel_degree {p.expert_parallel_degree}, expected 1 and 1 "
            "(evaluate the checkpoints with scripts/evaluate.py instead)"
        )


def _validate_validation(cfg: Config) -> None:
    """[validation] checks that need no files (validation.path is checked when it is read)."""
    v = cfg.validation
    if v.freq < 1:
        raise ValueError(f"validation.freq: got {v.freq}, expected a positive number of steps")
    if v.max_batches < 0:
        raise ValueError(f"validation.max_batches: got {v.max_batches}, expected 0 (all) or a positive count")
    if not 0.0 <= v.fraction < 1.0:
        raise ValueError(f"validation.fraction: got {v.fraction}, expected 0 < fraction < 1 (0 = not set)")
    if not v.enable:
        return
    if v.fraction and v.path:
        raise ValueError(
            f"validation.fraction = {v.fraction} and validation.path = {v.path!r} both choose the validation "
            "set; set one"
        )
    if not v.fraction and not v.path:
        raise ValueError(
            "validation.enable = true needs a validation set: validation.fraction (0 < fraction < 1) or "
            "validation.path"
        )
    if cfg.data.source == "packed":
        raise ValueError(
            "validation.enable = true with data.source = packed is not supported yet: offline-packed rows have "
            "no per-document split; validate with data.source = jsonl or parquet"
        )
    if v.path and cfg.data.source == "mock":
        raise ValueError(
            f"validation.path = {v.path!r} with data.source = mock: a validation file needs data.source = jsonl "
            "or parquet; for mock data use validation.fraction"
        )


# ============================================================================ output
def to_toml(cfg: Config) -> str:
    """The merged configuration as TOML (what --job.print_config prints)."""

    def fmt(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {fmt(x)}" for k, x in v.items()) + " }"
        if isinstance(v, (tuple, list)):
            return "[" + ", ".join(fmt(x) for x in v) + "]"
        return repr(v)

    out = []
    for f in fields(Config):
        out.append(f"[{f.name}]")
        section = getattr(cfg, f.name)
        out += [f"{g.name} = {fmt(getattr(section, g.name))}" for g in fields(section)]
        out.append("")
    return "\n".join(out)


def help_text() -> str:
    docs = field_docs()
    lines = ["titan_thd training options (--section.field value; TOML [section] field = value):", ""]
    defaults = Config()
    for f in fields(Config):
        lines.append(f"[{f.name}]")
        for g in fields(getattr(defaults, f.name)):
            key = f"{f.name}.{g.name}"
            default = getattr(getattr(defaults, f.name), g.name)
            choices = f" {{{'|'.join(CHOICES[key])}}}" if key in CHOICES else ""
            lines.append(f"  --{key}{choices} (default: {default!r})")
            lines.append(f"      {docs.get(key, '')}")
        lines.append("")
    lines.append(
        "Errors in the input are one `error:` line (exit code 2); TITAN_THD_DEBUG=1 shows the traceback."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m titan_thd.config [--job.config_file X.toml] [--section.field value ...]`: check a
    configuration without starting anything and print it merged, as TOML (run_train.sh runs this
    before torchrun, so a typo costs no process launch)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--help" in argv or "-h" in argv:
        print(help_text())
        return 0
    try:
        cfg = load_config(argv)
    except ValueError as e:
        if os.environ.get("TITAN_THD_DEBUG", "") not in ("", "0"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(to_toml(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
