"""`eval.*`: what a run is judged by beyond its loss: benchmark tasks of lm-evaluation-harness
and sample answers to a few prompts, both at every evaluation (`training.eval_every_steps` and
the end of the run). `overdrive eval` and `overdrive generate` do the same on a saved model.

The tasks are lm-evaluation-harness's own (its task registry, or a task YAML file on disk);
nothing of it is re-implemented. Their metrics go to metrics.jsonl as `eval/<task>/<metric>`.
"""

from __future__ import annotations

from typing import Optional, Union

from pydantic import Field, field_validator

from overdrive.config.sections import Section

# The prefix of a benchmark metric in metrics.jsonl: `eval/<task>/<metric>` (e.g. `eval/hellaswag/acc_norm`).
BENCHMARK_PREFIX = "eval/"


def is_benchmark_metric(name: str) -> bool:
    """Whether `name` has the shape of a benchmark metric a run writes (`eval/<task>/<metric>`)."""
    parts = name.split("/")
    return name.startswith(BENCHMARK_PREFIX) and len(parts) >= 3 and all(parts)


class EvalConfig(Section):
    """Benchmarks and sample answers at each evaluation of a run (needs the `eval` extra: lm-eval)."""

    tasks: list[str] = Field(
        default_factory=list, description="lm-evaluation-harness tasks run at each evaluation: names from its "
        "registry (`hellaswag`, `arc_easy`, ...) or paths to task YAML files (`my_task.yaml`). Metrics go to "
        "metrics.jsonl as `eval/<task>/<metric>`, usable as `sweep.metric`. Empty: none."
    )
    limit: Optional[float] = Field(
        None, gt=0, description="Rows per task: a count (>= 1) or a fraction (< 1) of each task's test set, as "
        "lm-eval's `--limit`. Empty: every row."
    )
    num_fewshot: Optional[int] = Field(None, ge=0, description="Few-shot examples per prompt. Empty: each task's own.")
    batch_size: int = Field(8, ge=1, description="Requests per forward pass of the benchmark tasks.")
    prompts: Union[str, list[str], None] = Field(
        None, description="Prompts answered at each evaluation, written to `<output_dir>/samples.jsonl` (step, "
        "prompt, answer): a list, or a file (one prompt per line, or a .jsonl with a `prompt` field, and for a "
        "vision-language model an `images` list of paths read from the file's directory). Each is given as a user "
        "turn through the chat template when the tokenizer has one (its images first). Empty: none."
    )
    max_new_tokens: int = Field(64, ge=1, description="Tokens generated per sample answer (greedy).")
    show_samples: int = Field(3, ge=0, description="Sample answers printed on the console at each evaluation.")

    @field_validator("prompts", mode="before")
    @classmethod
    def _listed_on_the_command_line(cls, value):
        """`eval.prompts=[a, b]` typed as one item is a list, not a file named `[a, b]`."""
        if isinstance(value, str) and value.strip().startswith("[") and value.strip().endswith("]"):
            import yaml

            listed = yaml.safe_load(value)
            if isinstance(listed, list):
                return [str(item) for item in listed]
        return value
