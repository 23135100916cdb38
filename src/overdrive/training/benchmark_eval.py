"""A run's benchmarks and sample answers at each evaluation (`eval.tasks`, `eval.prompts`), on
the model as it stands: the adapter applied, and under sharding strategies the weights gathered
as the final save gathers them. The loop's evaluation asks `at_eval` once; the tasks run through
lm-evaluation-harness (hf/benchmarks.py), the answers through hf/generation.py.

Only the main process evaluates (lm-eval on one process, as `lm-eval --model hf` on the saved
model would); the other ranks wait. Where a rank holds the whole model (DDP, ZeRO-1/2) it is
used in place; otherwise (ZeRO-3, FSDP, tensor or pipeline parallel) every rank takes part in
writing it as the final save does, to `<output_dir>/.eval-model`, and the main process reads it back.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from overdrive.config.schema import RunConfig
from overdrive.hf import benchmarks, generation
from overdrive.storage import faults
from overdrive.strategies import registry

SAMPLES = "samples.jsonl"
LOG = "lm-eval.log"  # what lm-eval prints during a run's evaluations


def wanted(cfg: RunConfig) -> bool:
    """Whether the run's evaluations include benchmarks or sample answers."""
    return bool(cfg.eval.tasks or cfg.eval.prompts)


def check(cfg: RunConfig) -> None:
    """Before the first step, on every rank: lm-eval there and every task known to it, so a bad
    name stops the run at its start rather than at its first evaluation."""
    if cfg.eval.tasks:
        benchmarks.check_tasks(list(cfg.eval.tasks), "eval.tasks")


def failure_note(error: BaseException, out: Path) -> str:
    """One line for an evaluation that failed, its traceback appended to `<output_dir>/lm-eval.log`."""
    import traceback

    from overdrive.errors import UserError

    try:
        with open(out / LOG, "a") as log:
            log.write("".join(traceback.format_exception(type(error), error, error.__traceback__)))
    except OSError:
        pass  # the note is said either way
    if isinstance(error, UserError):
        first = error.problems[0]
        return f"{first.key}: {first.message}" + (f" (fix: {first.fix})" if first.fix else "")
    text = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {text}"


def at_eval(cfg: RunConfig, parts: Any, step: int, say: Callable[[str], None]) -> dict[str, float]:
    """The benchmarks' `eval/<task>/<metric>` values (on the main process; {} elsewhere), and the
    sample answers appended to `<output_dir>/samples.jsonl`, the first few said."""
    if not wanted(cfg):
        return {}
    out = Path(cfg.output_dir).expanduser()
    values: dict[str, float] = {}
    with _whole_model(cfg, parts, out) as (model, tokenizer):
        if model is not None:
            if cfg.eval.prompts:
                _samples(cfg, model, tokenizer, step, out, say)
            if cfg.eval.tasks:
                e = cfg.eval
                settings = benchmarks.TaskSettings(e.limit, e.num_fewshot, e.batch_size)
                table = benchmarks.run_tasks(model, tokenizer, list(e.tasks), settings, log=out / LOG)
                values = benchmarks.as_metrics(table)
    return values


def _in_place(cfg: RunConfig, parts: Any) -> bool:
    """The main process holds the whole model, as plain tensors: it can be evaluated where it is."""
    return registry.of(cfg).holds_whole_model(cfg) and cfg.parallel.tp_size == 1 and parts.pipeline is None


@contextmanager
def _whole_model(cfg: RunConfig, parts: Any, out: Path) -> Iterator[tuple[Optional[Any], Any]]:
    """(model, tokenizer) on the main process, (None, tokenizer) on the others; every rank waits
    until the main process is done."""
    acc = parts.accelerator
    if _in_place(cfg, parts):
        training = parts.model.training  # lm-eval leaves the model in eval mode: the loop's is put back
        try:
            yield (acc.unwrap_model(parts.model) if acc.is_main_process else None), parts.tokenizer
        finally:
            parts.model.train(training)
            acc.wait_for_everyone()
        return
    from overdrive.hf.saved_model import load
    from overdrive.training.build.parts import save_final

    staged = out / ".eval-model"
    # The final save's own path, whatever the run says about saving at its end.
    writing = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(update={"save_final_model": True}),
                                     "peft": cfg.peft.model_copy(update={"save_merged": False})})
    save_final(writing, parts, staged)  # pipeline stages joined, shards gathered
    try:
        if acc.is_main_process and _vision(cfg):  # AutoModelForImageTextToText, with its adapter
            from overdrive.hf import vision_generate

            seen = vision_generate.load(str(staged / "model"), None, "auto", str(acc.device))
            yield (seen.model if seen else None), parts.tokenizer
        elif acc.is_main_process:
            loaded = load(str(staged / "model"), dtype="auto", device=str(acc.device), key="eval.tasks")
            yield loaded.model, parts.tokenizer
        else:
            yield None, parts.tokenizer
    finally:
        acc.wait_for_everyone()
        if acc.is_main_process:
            shutil.rmtree(staged, ignore_errors=True)


def _samples(cfg: RunConfig, model: Any, tokenizer: Any, step: int, out: Path, say: Callable[[str], None]) -> None:
    """Each prompt answered greedily, appended to samples.jsonl (step, prompt, answer)."""
    rows = generation.read_prompt_rows(cfg.eval.prompts)
    prompts = [row.text for row in rows]
    sampling = generation.Sampling(max_new_tokens=cfg.eval.max_new_tokens)
    if _vision(cfg):  # through the processor, each prompt with its images, as `overdrive generate --image`
        from overdrive.hf import vision_generate

        answered = vision_generate.answers(model, _processor(cfg, tokenizer), rows, sampling)
    else:
        answered = generation.answers(model, tokenizer, prompts, sampling)
    now = time.time()
    lines = "".join(json.dumps({"step": step, "prompt": p, "answer": a, "time": now}) + "\n"
                    for p, a in zip(prompts, answered))
    _drop_from(out / SAMPLES, step)
    with faults.writing(out / SAMPLES, "output_dir"), open(out / SAMPLES, "a") as f:
        f.write(lines)
    for prompt, text in list(zip(prompts, answered))[:cfg.eval.show_samples]:
        say(f"sample at step {step}: {_short(prompt)} -> {_short(text)}")


def _vision(cfg: RunConfig) -> bool:
    from overdrive.hf.vision import declared

    return declared(cfg)


def _processor(cfg: RunConfig, tokenizer: Any) -> Any:
    """The run's VisionProcessor: the one its rows went through, or for GRPO (whose loop holds the tokenizer) loaded
    again from the model's files."""
    from overdrive.hf.vision import family
    from overdrive.hf.vision_processor import VisionProcessor, load

    return tokenizer if isinstance(tokenizer, VisionProcessor) else load(cfg, family(cfg))


def _drop_from(path: Path, step: int) -> None:
    """A resumed run answers again from its checkpoint on: the answers it wrote at this step or
    later before it stopped are left out, as metrics.jsonl leaves out their lines."""
    if not path.is_file():
        return
    lines = path.read_text().splitlines(keepends=True)
    kept = [line for line in lines if _step_of(line) < step]
    if len(kept) != len(lines):
        faults.write_text(path, "".join(kept), "output_dir")


def _step_of(line: str) -> float:
    try:
        return float(json.loads(line).get("step", 0))
    except (ValueError, AttributeError, TypeError):
        return 0.0  # a line cut short by a kill: kept, as a reader skips it


def _short(text: str, width: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 1] + "…"
