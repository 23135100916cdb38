"""The run config: one small pydantic model per concern.

Every field carries a type, a default and a one-line description; `overdrive docs` renders
them into docs/config.md. Unknown keys are rejected at every depth (`extra="forbid"`), and
every model is frozen: once resolved, a run config is a value, not a mutable object.

The defaults describe the embedded job: a small GPT-2-style model trained from scratch on
the Python standard library's own source, with a BPE tokenizer trained on the fly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, Union

from typing_extensions import TypeAlias

from pydantic import Field, create_model

from overdrive.config.schema_eval import EvalConfig
from overdrive.config.schema_launch import LaunchConfig
from overdrive.config.schema_moe import MoeConfig
from overdrive.config.schema_parallel import ParallelConfig
from overdrive.config.schema_peft import PeftConfig
from overdrive.config.schema_preference import PreferenceConfig
from overdrive.config.schema_distill import DistillConfig
from overdrive.config.schema_rl import RLConfig
from overdrive.config.schema_recipe import OptimConfig, SchedulerConfig
from overdrive.config.schema_resilience import LossSpikeConfig
from overdrive.config.schema_sweep import SweepConfig
from overdrive.config.schema_vision import VisionConfig
from overdrive.config.sections import Auto, PositiveInt, Section, admits_bool

__all__ = ["OPEN_MAPPINGS", "RunConfig", "Section", "admits_bool"]


def default_architecture() -> dict[str, Any]:
    # ~1.2M parameters with a 2k vocabulary: at a few minutes on two CPU cores a narrow model
    # seeing more tokens beats a wide one seeing fewer (the loss falls from ln(2048) = 7.6 to
    # about 3.9). No dropout: the run ends before one pass over its data (about 1,650 steps
    # per epoch by `overdrive plan`), so there is nothing to overfit.
    return {
        "model_type": "gpt2",
        "n_layer": 4,
        "n_head": 4,
        "n_embd": 128,
        "n_positions": 1024,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


class ModelConfig(Section):
    """What to train."""

    name_or_path: Optional[str] = Field(
        None,
        description="Hub name or local directory (save_pretrained output). Empty: build from "
        "`model.architecture` with fresh weights.",
    )
    task: Literal["causal-lm", "sequence-classification"] = Field(
        "causal-lm", description="Training objective; picks the Auto class and the data pipeline."
    )
    architecture: dict[str, Any] = Field(
        default_factory=default_architecture,
        description="Inline model config (keys of the Transformers config class named by "
        "`model_type`), used when `model.name_or_path` is empty. Vocabulary size comes from the "
        "tokenizer.",
    )
    from_scratch: bool = Field(
        False,
        description="With `model.name_or_path`: take only its config and start from random weights.",
    )
    num_labels: Optional[int] = Field(
        None, ge=2, description="Classes for sequence-classification; inferred from the data when empty."
    )
    revision: Optional[str] = Field(None, description="Hub revision (branch, tag or commit).")
    trust_remote_code: bool = Field(
        False, description="Allow model code from the hub to run. Off unless you trust the repository."
    )
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, ~30% more compute."
    )
    attn_implementation: Optional[str] = Field(
        None, description="Attention kernel passed to Transformers (`eager`, `sdpa`, ...). Empty: its default."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Storage dtype of the weights when loaded. Keep float32 for mixed-precision "
        "training; `auto` takes the checkpoint's.",
    )
    moe: MoeConfig = Field(default_factory=MoeConfig, description="A mixture-of-experts model's router: the "
                           "load-balancing loss's weight and scope, the experts per token.")
    vision: VisionConfig = Field(default_factory=VisionConfig, description="A vision-language model: docs/vision.md.")


class TokenizerConfig(Section):
    """How text becomes token ids."""

    name_or_path: Optional[str] = Field(
        None,
        description="Hub name or local directory. Empty: the model's own tokenizer, or (when "
        "training from an inline architecture) a byte-level BPE trained on the data and cached.",
    )
    vocab_size: int = Field(2048, ge=256, description="Vocabulary size of a BPE trained on the fly.")
    train_max_bytes: int = Field(
        20_000_000, ge=1, description="At most this much text is read to train a BPE on the fly."
    )
    chat_template: Optional[str] = Field(
        None, description="Jinja chat template for `data.format: chat`: the template itself, or a file holding it "
        "(.jinja). Empty: the tokenizer's own."
    )


class DataConfig(Section):
    """Where training text comes from and how it is batched."""

    source: str = Field(
        "stdlib",
        description="`stdlib` (the Python standard library's own .py files), a local file or "
        "directory (text, jsonl, json, csv, parquet), or a hub data set name.",
    )
    format: Literal["auto", "text", "json", "csv", "parquet", "chat", "preference", "prompts"] = Field(
        "auto", description="File format; `auto` goes by the file extension. `chat`: rows of conversations "
        "(`data.messages_column`, or prompt/completion columns) in any row format (jsonl, json, csv, parquet, a "
        "saved or hub data set), rendered with the tokenizer's chat template (docs/finetuning.md). `preference`: "
        "rows of a prompt and a chosen and a rejected answer (text, or lists of turns), for `preference.method` "
        "(docs/preference.md). `prompts`: rows of a prompt (`data.prompt_column`: text, or a list of turns rendered "
        "by the chat template), the other columns passed to the reward functions, for `rl.method` (docs/rl.md)."
    )
    subset: Optional[str] = Field(None, description="Hub data set configuration name.")
    split: str = Field("train", description="Split to train on.")
    validation_split: Optional[str] = Field(
        None, description="Split to evaluate on. Empty: hold out `data.validation_fraction`."
    )
    validation_fraction: float = Field(
        0.02, ge=0.0, lt=1.0, description="Fraction held out for evaluation when there is no validation split."
    )
    text_column: str = Field("text", description="Column holding the text.")
    label_column: str = Field("label", description="Column holding the class (sequence-classification).")
    messages_column: str = Field(
        "messages", description="Chat: column holding a list of {role, content} turns."
    )
    prompt_column: str = Field(
        "prompt", description="Chat, when there is no messages column: the prompt (a string, or a list of turns)."
    )
    completion_column: str = Field(
        "completion", description="Chat, with `data.prompt_column`: the answer (a string, or a list of turns)."
    )
    layout: Literal["auto", "messages", "prompt-completion", "sharegpt", "alpaca"] = Field(
        "auto", description="Chat: how a row holds its conversation. `messages`: a list of {role, content} turns "
        "(OpenAI's, with `tool_calls` and `tool` turns); `prompt-completion`: two columns; `sharegpt`: "
        "`conversations` of {from, value} turns (human, gpt, system, function_call, observation, tool); `alpaca`: "
        "instruction, input, output (and optional system, history). `auto`: recognised by the columns."
    )
    images_column: str = Field("images", description="Chat with a vision-language model: the row's images.")
    input_column: str = Field("input", description="Chat, alpaca layout: the column added to the instruction.")
    system_column: str = Field("system", description="Chat: a column holding a system prompt for the row (when present).")
    tools_column: str = Field("tools", description="Chat: a column holding the tools offered (a list, or its JSON "
                              "text), passed to the chat template as `tools` (when present).")
    chat_template: Optional[str] = Field(None, description="Chat: a template for this data only (text or a .jinja "
                                         "file), over `tokenizer.chat_template`; a `data.sources` entry may set its own.")
    chosen_column: str = Field(
        "chosen", description="Preference data: the preferred answer (a string, or a list of turns)."
    )
    rejected_column: str = Field(
        "rejected", description="Preference data: the other answer (a string, or a list of turns)."
    )
    train_on_prompt: bool = Field(
        False, description="Chat: take the loss over every token. Off: over the assistant's tokens only."
    )
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="Chat: a conversation longer than `data.max_length` tokens is cut to it, or left "
        "out. Both are counted and reported."
    )
    packing: bool = Field(
        False, description="Chat: put several conversations into one sequence of `data.max_length` tokens, each "
        "attending only to itself (position ids restart per conversation). Off: one conversation per row, padded."
    )
    max_length: int = Field(
        256, ge=8, description="Tokens per sequence: packed blocks (causal-lm) or truncation (classification)."
    )
    document_mask: bool = Field(
        False, description="Packed text (causal-lm): the documents joined with EOS into a block attend only to "
        "themselves (position ids restart after each EOS, from which Transformers masks sdpa, eager and flex "
        "attention and flash-attention takes its varlen path) and the first token after an EOS is not predicted "
        "from the document before it. Off: every token attends to the whole block before it, as GPT-2 was trained "
        "(docs/memory.md says why off is the default)."
    )
    max_bytes: Optional[int] = Field(
        None, ge=1, description="Read at most this much raw text (handy for quick runs on big sources)."
    )
    streaming: bool = Field(
        False, description="Read a hub data set as it downloads (`datasets` streaming) instead of "
        "preparing a local Arrow copy first. Local text, jsonl, csv and parquet files are always streamed.",
    )
    num_workers: int = Field(0, ge=0, description="DataLoader worker processes.")
    pin_memory: bool = Field(False, description="Pin host memory for faster host-to-GPU copies.")
    shuffle: bool = Field(True, description="Shuffle training samples each epoch (seeded).")
    cache_dir: str = Field(
        "~/.cache/overdrive", description="Where tokenizers and tokenized data are cached, by content hash."
    )
    sources: list["DataSourceConfig"] = Field(
        default_factory=list, description="Several data sets mixed by weight: a list of `{name, source, weight}`, "
        "each with any of the keys of `data` that describe a source (format, subset, split, validation_split, "
        "validation_fraction, text_column, label_column, max_bytes, streaming, and for chat layout, messages_column, "
        "prompt_column, completion_column, input_column, system_column, tools_column, chat_template, train_on_prompt; "
        "unset: the `data.*` value). "
        "Samples are drawn in proportion to the weights, in an order fixed by `training.seed`. Empty: "
        "`data.source` alone."
    )
    when_exhausted: Literal["repeat", "stop"] = Field(
        "repeat", description="A mixed source that runs out before the run ends: start it over (a new "
        "shuffle), or stop the run after the last whole step."
    )


# The keys of `data` that describe one source; a `data.sources` entry may set each of them.
SOURCE_DESCRIPTION = ("format", "subset", "split", "validation_split", "validation_fraction", "text_column",
                      "label_column", "max_bytes", "streaming", "layout", "messages_column", "prompt_column",
                      "completion_column", "input_column", "system_column", "tools_column", "chat_template",
                      "train_on_prompt")


def _source_entry_model() -> type:
    """`data.sources` entries: name, source, weight, and the describing keys of `data` (empty: data's)."""
    from pydantic import create_model

    describing: dict[str, Any] = {}
    for name in SOURCE_DESCRIPTION:
        info = DataConfig.model_fields[name]
        arguments = (info.annotation, *info.metadata)  # ge, lt kept
        checked = Annotated[arguments] if info.metadata else info.annotation
        describing[name] = (Optional[checked], Field(None, description=f"As `data.{name}`, for this source. "
                                                     "Empty: the `data` value."))
    return create_model(
        "DataSourceConfig", __base__=Section, __doc__="One data set of a mixture.",
        name=(str, Field(..., min_length=1, description="A name for the source (metrics' `source_tokens`, `plan`).")),
        source=(str, Field(..., min_length=1, description="As `data.source`.")),
        weight=(float, Field(1.0, ge=0.0, description="Share of the samples drawn, relative to the other weights.")),
        **describing)


class TrainingConfig(Section):
    """The loop: batch math, length, evaluation."""

    micro_batch_size: Union[PositiveInt, Auto] = Field(
        8, description="Samples per device per forward pass, or `auto`: the largest that fits, "
        "keeping the global batch by adjusting accumulation."
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    global_batch_size: Optional[int] = Field(
        None, ge=1, description="Samples per optimizer step over all processes. Set, it derives the accumulation: "
        "global / (micro x data-parallel processes), refused when that is not a whole number or contradicts a "
        "gradient_accumulation_steps also set. Kept when micro_batch_size is `auto` (required then)."
    )
    max_steps: int = Field(1200, ge=1, description="Optimizer steps to train (unless `training.num_epochs` is set "
                           "in a later layer: the one set last wins).")
    num_epochs: Optional[float] = Field(
        None, gt=0, description="Passes over the training data; the steps are derived from the data when the run "
        "starts (ceil(epochs x samples per epoch / global batch), exact over the token cache; `overdrive plan` shows "
        "them). Of `max_steps` and `num_epochs` the one set in the later layer wins (a file's epochs, the command "
        "line's max_steps=10: 10 steps); both in one file is refused. Empty: `max_steps`."
    )
    evals_per_epoch: Optional[int] = Field(None, ge=1, description="Evaluate this many times per epoch (over "
                                           "`eval_every_steps`), counted from the data when the run starts.")
    gradient_clipping: Optional[float] = Field(1.0, gt=0.0, description="Max global gradient norm. Empty: no clipping.")
    seed: int = Field(42, ge=0, lt=2**32, description="Seed for weights, data order and dropout (0 <= seed < 2**32, as numpy accepts).")
    eval_every_steps: Optional[int] = Field(200, ge=1, description="Evaluate every N optimizer steps. Empty: only at the end.")
    eval_batches: int = Field(20, ge=1, description="Validation batches per evaluation.")
    log_every_steps: int = Field(10, ge=1, description="Read the loss and append to metrics.jsonl every N optimizer steps.")
    nonfinite_loss: Literal["skip", "stop", "ignore"] = Field(
        "skip", description="On a NaN/inf loss: skip the step, stop the run, or ignore it."
    )
    max_nonfinite_in_a_row: int = Field(5, ge=1, description="Stop after this many non-finite steps in a row.")
    oom_retry: bool = Field(
        False, description="On an out-of-memory error inside a step: every rank halves the micro-batch, doubles the "
        "accumulation (the global batch, data order and loss unchanged) and redoes the step; the new split is "
        "kept (origin `oom_retry`) and resumes. At micro-batch 1 the run ends. Off, an out-of-memory step ends the "
        "run by this key (exit 2), its last checkpoint kept.")
    loss_spike: LossSpikeConfig = Field(default_factory=LossSpikeConfig,
                                        description="Loss spikes skipped (off unless `factor` is set).")
    loss_kernel: Literal["auto", "full", "chunked", "fused"] = Field(
        "auto", description="How a causal LM's token loss is computed. `full`: the model's own loss, from the whole "
        "logits (tokens x vocabulary, fp32). `chunked`: the LM head and cross entropy a slice of the sequence at a "
        "time, recomputed slice by slice in backward, no logits held. `fused`: a fused kernel (Liger on CUDA, `pip install "
        "overdrive[liger]`; else torch's `F.linear_cross_entropy`). `auto`: `fused` where Liger is installed on "
        "CUDA, else `full`. The same sum of token losses each (docs/memory.md has the memory and time). GRPO takes "
        "`chunked` (its completions' per-token log-probs, a slice at a time) but not `fused`; the preference "
        "methods, the reward model and classification take `full` only."
    )
    activation_offloading: bool = Field(
        False, description="Keep the activations the forward pass saves for backward in pinned host memory "
        "instead of on the GPU (copied back as backward needs them); composes with "
        "`model.gradient_checkpointing`. On a CPU run they are in host memory already: no change."
    )


class Fp8Config(Section):
    """FP8 training (GPUs with FP8 support only)."""

    backend: Literal["TE", "MSAMP", "AO"] = Field("TE", description="FP8 engine: Transformer Engine, MS-AMP or torchao.")
    fp8_format: Literal["E4M3", "HYBRID"] = Field("HYBRID", description="FP8 number format.")
    amax_history_len: int = Field(1024, ge=1, description="Transformer Engine amax history length.")
    amax_compute_algo: Literal["max", "most_recent"] = Field("most_recent", description="How amax is taken from the history.")
    interval: int = Field(1, ge=1, description="Steps between scaling factor updates.")
    margin: int = Field(0, ge=0, description="Scaling factor margin.")
    override_linear_precision: tuple[bool, bool, bool] = Field(
        (False, False, False), description="Keep fprop, dgrad, wgrad of linear layers in higher precision."
    )
    use_autocast_during_eval: bool = Field(False, description="Use FP8 autocast in evaluation too.")
    opt_level: Literal["O1", "O2"] = Field("O2", description="MS-AMP optimisation level.")


class PrecisionConfig(Section):
    """Mixed precision."""

    mixed_precision: Literal["no", "fp16", "bf16", "fp8"] = Field(
        "no", description="Compute precision under autocast; weights stay fp32."
    )
    downcast_bf16: bool = Field(False, description="TPU only: downcast float tensors to bf16.")
    fp8: Fp8Config = Field(default_factory=Fp8Config, description="FP8 settings (when `mixed_precision` is fp8).")


class CompileConfig(Section):
    """torch.compile through Accelerate's dynamo plugin."""

    backend: Optional[str] = Field(None, description="Dynamo backend (`inductor`, `aot_eager`, ...). Empty: no compile.")
    mode: Optional[Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]] = Field(
        None, description="Inductor mode."
    )
    fullgraph: bool = Field(False, description="Fail instead of falling back on graph breaks.")
    dynamic: Optional[bool] = Field(None, description="Dynamic shapes. Empty: torch decides.")
    regional: bool = Field(False, description="Compile each repeated block once instead of the whole model.")


class _CheckpointKeys(Section):
    """Saving and resuming."""

    enabled: bool = Field(
        True, description="Write checkpoints: every `every_steps`, at the end, and when stopped by SIGTERM/SIGINT "
        "or a non-finite loss. Off: nothing to resume from (resuming existing ones is `resume`)."
    )
    every_steps: Optional[int] = Field(None, ge=1, description="Save every N optimizer steps. Empty: only at the end.")
    saves_per_epoch: Optional[int] = Field(
        None, ge=1, description="Save this many times per epoch (over `every_steps`), counted from the data when the run starts."
    )
    keep_last: int = Field(2, ge=1, description="Checkpoints kept; older ones are pruned after a successful save.")
    resume: Literal["auto", "never"] = Field("auto", description="`auto`: continue from the newest complete checkpoint in output_dir.")
    save_final_model: bool = Field(True, description="Write the trained model and tokenizer with save_pretrained at the end.")


# `async` is a Python keyword: the field is added by name (read it with `getattr(section, "async")`,
# or checkpoint/background.py's `wanted(cfg)`).
if TYPE_CHECKING:
    CheckpointConfig = _CheckpointKeys  # the same keys but `async`, which is read by name anyway
else:
    CheckpointConfig = create_model(
        "CheckpointConfig", __base__=_CheckpointKeys, __doc__="Saving and resuming.",
        **{"async": (bool, Field(False, description="Save through DCP's async_save where the strategy saves through DCP "
                                 "(FSDP2 sharded): the state staged to host memory, written in the background; training "
                                 "waits only for the staging. The checkpoint still appears whole or not at all."))})


class LoggingConfig(Section):
    """What the run reports."""

    trackers: list[str] = Field(
        default_factory=lambda: ["auto"], description="Accelerate trackers (`tensorboard`, `wandb`, ...); `auto`: tensorboard when installed."
    )
    project_name: str = Field("overdrive", description="Project name passed to the trackers.")
    progress: bool = Field(True, description="Rich progress bar on the main process when attached to a terminal.")
    level: Literal["quiet", "normal", "verbose"] = Field("normal", description="How much is printed.")


class RunConfig(Section):
    """One training run, end to end."""

    model: ModelConfig = Field(default_factory=ModelConfig, description="What to train.")
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig, description="Tokenizer.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data.")
    optim: OptimConfig = Field(default_factory=OptimConfig, description="Optimizer.")
    scheduler: SchedulerConfig = Field(default_factory=SchedulerConfig, description="Learning-rate schedule.")
    training: TrainingConfig = Field(default_factory=TrainingConfig, description="Training loop.")
    precision: PrecisionConfig = Field(default_factory=PrecisionConfig, description="Mixed precision.")
    parallel: ParallelConfig = Field(default_factory=ParallelConfig, description="Parallelism strategy.")
    peft: PeftConfig = Field(default_factory=PeftConfig, description="Adapter fine-tuning (LoRA, QLoRA).")
    preference: PreferenceConfig = Field(default_factory=PreferenceConfig,
                                         description="Preference training (DPO, IPO, ORPO, SimPO).")
    rl: RLConfig = Field(default_factory=RLConfig, description="Online RL on prompts (GRPO, DAPO, Dr. GRPO).")
    distill: DistillConfig = Field(default_factory=DistillConfig,
                                   description="Knowledge distillation from a teacher (docs/distillation.md).")
    compile: CompileConfig = Field(default_factory=CompileConfig, description="torch.compile.")
    launch: LaunchConfig = Field(default_factory=LaunchConfig, description="Processes and machines.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description="Checkpoints.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Logging.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Benchmark tasks and sample answers at each evaluation.")
    sweep: SweepConfig = Field(default_factory=SweepConfig, description="Hyperparameter search (`overdrive sweep`).")
    output_dir: str = Field("runs/default", description="Where checkpoints, metrics, the resolved config and the final model go.")


# Fields whose values are free-form mappings: their sub-keys are not checked against the
# schema (they belong to Transformers or DeepSpeed), but each still carries its origin.
OPEN_MAPPINGS = frozenset({"model.architecture", "parallel.deepspeed.extra", "optim.kwargs"})


if TYPE_CHECKING:
    # Built by create_model from data's own keys: to the type checker an entry is any model.
    DataSourceConfig: TypeAlias = Any
else:
    DataSourceConfig = _source_entry_model()
DataConfig.model_rebuild()
