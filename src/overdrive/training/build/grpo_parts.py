"""What an RL run (`rl.method`) builds in place of the token cache and the preference objective:
the tokenizer and the prompts (data/prompts.py), the loader of completion slots, and the GRPO
objective with its reference (training/objectives/grpo.py). training/build/parts.py asks these three builders."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Optional

from overdrive.config import batch
from overdrive.config.schema import RunConfig
from overdrive.data import prompts as prompts_mod
from overdrive.strategies import registry
from overdrive.errors import UserError
from overdrive.training.objectives import grpo
from overdrive.training.step import loss_kernels
from overdrive.training.generation import environments, tools as tools_mod


@dataclass
class PromptData:
    """The run's data as build_parts reads a token cache's: `train` (the slots), no validation."""

    prompts: prompts_mod.PromptSet
    layout: prompts_mod.SlotLayout
    train: Any
    validation: Optional[Any] = None
    label_names: Optional[list] = None
    tools: tuple = ()  # rl.tools, built: the prompts were rendered with their schemas
    environment: Optional[environments.Environment] = None  # rl.environment, probed: its methods' schemas too


def prepare(cfg: RunConfig, make_tokenizer) -> tuple[Any, PromptData]:
    """(tokenizer, the prompts and their slots); every rank reads the (small) prompt set itself. With rl.tools
    the tools are imported and the tokenizer's template asked whether it can run them, before the model loads."""
    tokenizer = make_tokenizer(cfg, [], "")
    tools = tools_mod.build(cfg.rl.tools) if cfg.rl.tools else []
    rows = prompts_mod.read(cfg)
    environment = None
    if cfg.rl.environment:
        environment = environments.build(cfg.rl.environment, list(dict.fromkeys(k for row in rows for k in row)))
    schemas = [t.schema for t in tools] + (environment.schemas if environment else [])
    key = "rl.tools" if tools else environments.KEY  # the key the user set: an environment's methods are tools too
    if schemas:
        refused = [replace(p, key=key) for p in tools_mod.template_problems(tokenizer)]
        if refused:
            raise UserError(refused)
    prompt_set = prompts_mod.encode(cfg, rows, tokenizer, tools=schemas, key=key)
    if environment is not None and not prompt_set.conversational:
        raise UserError(prompts_mod.text_prompts_problem(environments.KEY))
    layout = prompts_mod.slot_layout(cfg, len(prompt_set.rows))
    return tokenizer, PromptData(prompt_set, layout, prompts_mod.Slots(layout), tools=tuple(tools),
                                 environment=environment)


def loader(data: PromptData, split: Optional[batch.BatchSplit] = None):
    """The completion slots' loader, at the run's split or at `split` (training.oom_retry's redo):
    the slots land where a run started at that split puts them."""
    layout = data.layout if split is None else replace(data.layout, micro=split.micro, accumulation=split.accumulation)
    return prompts_mod.loader(layout)


def _lora_reference(accelerator):
    @contextlib.contextmanager
    def reference(model):
        with accelerator.unwrap_model(model).disable_adapter():
            yield model

    return reference


def objective(cfg: RunConfig, accelerator, tokenizer, data: PromptData, reference_model) -> "grpo.GRPOObjective":
    """The GRPO objective, its reference the adapter switched off (LoRA) or a frozen copy (beta > 0)."""
    reference = None
    if cfg.rl.beta != 0.0:
        if cfg.peft.method != "none":
            reference = _lora_reference(accelerator)
        else:
            frozen = reference_model.to(accelerator.device)
            reference = lambda model: contextlib.nullcontext(frozen)  # noqa: E731
    sharded = not registry.of(cfg).holds_whole_model(cfg)
    kernel = loss_kernels.for_run(cfg, accelerator.device)  # full or chunked (fused is refused for GRPO)
    objective = grpo.GRPOObjective(cfg, accelerator, tokenizer, data.prompts, reference, sharded=sharded, kernel=kernel,
                                   tools=data.tools, environment=data.environment)
    objective.samples_path = Path(cfg.output_dir).expanduser() / "completions.jsonl"
    if cfg.rl.use_vllm:  # the engine starts at the first generation, from the prepared model
        from overdrive.training.generation import vllm_sampling

        per_rank = int(cfg.training.micro_batch_size) * cfg.training.gradient_accumulation_steps
        objective.vllm_factory = lambda model: vllm_sampling.VLLMSampler(cfg, accelerator, model, tokenizer, per_rank)
    return objective
