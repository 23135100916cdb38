"""Rules of online RL (`rl.*` with `data.format: prompts`): what GRPO composes with, refused by key.

GRPO is an objective with a generation phase (training/objectives/grpo.py): the policy generates whole
sequences with `generate`, which pipeline stages (a rank holds some layers) and context parallel
(a rank holds a slice of every sequence) cannot do, and a tensor-parallel model's generate is not
rehearsed; those are refused. Each rank generates and normalises whole groups: its micro x
accumulation completions must hold whole groups.
"""

from __future__ import annotations

import importlib.util

from typing import Callable

from overdrive.config.schema import RunConfig
from overdrive.errors import Problem

_KNOBS = ("rl.num_generations", "rl.max_completion_length", "rl.temperature", "rl.top_p", "rl.top_k", "rl.beta",
          "rl.epsilon", "rl.epsilon_high", "rl.loss_type", "rl.scale_rewards", "rl.num_iterations",
          "rl.mask_truncated_completions", "rl.reward_funcs", "rl.importance_sampling_level",
          "rl.sapo_temperature_pos", "rl.sapo_temperature_neg", "rl.tools", "rl.max_tool_calling_iterations",
          "rl.tool_timeout_s", "rl.environment", "rl.baseline", "rl.multi_objective_aggregation",
          "rl.use_transformers_continuous_batching", "rl.use_vllm", "rl.vllm_mode", "rl.vllm_gpu_memory_utilization",
          "rl.vllm_tensor_parallel_size", "rl.vllm_max_model_length", "rl.vllm_enable_sleep_mode",
          "rl.vllm_server_base_url", "rl.vllm_server_host", "rl.vllm_server_port", "rl.vllm_server_timeout",
          "rl.vllm_group_port", "rl.vllm_importance_sampling_correction", "rl.vllm_importance_sampling_mode",
          "rl.vllm_importance_sampling_clip_max", "rl.vllm_importance_sampling_clip_min")

# Axes of the layout a generating policy cannot take: (key, why).



def rl_rules(cfg: RunConfig, where: Callable[[str], str],
             set_explicitly: Callable[[str], bool]) -> tuple[list[Problem], list[Problem]]:
    """(errors, warnings): the method, the data and the layout agree."""
    rl, errors, warnings = cfg.rl, [], []
    prompts = cfg.data.format == "prompts"
    if rl.method == "none":
        if prompts:
            errors.append(Problem("rl.method", "data.format is prompts, but no RL method is set", where("data.format"),
                                  "set rl.method=grpo (and rl.reward_funcs)"))
        stray = [k for k in _KNOBS if set_explicitly(k)]
        if stray:
            warnings.append(Problem(stray[0], "applies to RL only (rl.method is none)", where(stray[0]),
                                    "set rl.method=grpo, or remove the key"))
        return errors, warnings
    # With a second objective asked for, the conflict is named (here, or by distillation's rules) and the
    # data's format, which the two would each ask for, is left until one is chosen.
    if not prompts and cfg.preference.method == "none" and cfg.distill.teacher is None:
        errors.append(Problem("data.format", f"rl.method={rl.method} generates from prompts, but data.format is "
                              f"{cfg.data.format}", where("rl.method"), "set data.format=prompts, with a prompt column"))
    if cfg.preference.method != "none":
        errors.append(Problem("preference.method", "preference training and RL are two objectives; a run has one",
                              where("preference.method"), "set preference.method=none, or rl.method=none"))
    if cfg.model.task != "causal-lm":
        errors.append(Problem("model.task", f"rl.method={rl.method} trains a causal LM", where("model.task"),
                              "set model.task=causal-lm"))
    if cfg.model.from_scratch:  # the weights are there, the key says not to load them: name that key
        errors.append(Problem("model.from_scratch", f"{rl.method} improves a pretrained model, but "
                              "model.from_scratch starts it from random weights", where("model.from_scratch"),
                              "set model.from_scratch=false to load the weights of model.name_or_path"))
    elif not cfg.model.name_or_path:
        errors.append(Problem("model.name_or_path", f"{rl.method} improves a pretrained model, but no model is named "
                              "(it would start from random weights)", where("rl.method"),
                              "set model.name_or_path to a save_pretrained directory or hub name"))
    # An environment may own the reward (its get_reward): whether it does is checked once it is imported
    # (training/build/user_inputs.py).
    if not rl.reward_funcs and not rl.environment:
        errors.append(Problem("rl.reward_funcs", "no reward function: every completion would score the same",
                              where("rl.method"), "add one, e.g. rl.reward_funcs=[{function: exact_match, column: "
                              "answer}]"))
    if cfg.data.sources:
        errors.append(Problem("data.sources", "RL reads one prompt set", where("data.sources"),
                              "set data.source to the prompts"))
    # The layouts it does not compose with: rows of resolving/composition.py's table.
    micro = cfg.training.micro_batch_size
    per_rank = micro * cfg.training.gradient_accumulation_steps if micro != "auto" else None
    if per_rank is None:
        errors.append(Problem("training.micro_batch_size", f"rl.method={rl.method} needs a fixed micro-batch (the "
                              "completions of a step are generated before it)", where("training.micro_batch_size"),
                              "set training.micro_batch_size to an integer"))
    elif per_rank % rl.num_generations:
        errors.append(Problem("training.micro_batch_size", f"each rank's {micro} x {cfg.training.gradient_accumulation_steps}"
                              f" completions per step do not hold whole groups of rl.num_generations="
                              f"{rl.num_generations}", where("training.micro_batch_size"),
                              "make micro_batch_size x gradient_accumulation_steps a multiple of rl.num_generations"))
    errors += generation_rules(cfg, where)
    return errors + reference_rules(cfg, where) + loss_rules(cfg, where, set_explicitly), warnings + tool_warnings(
        cfg, where, set_explicitly) + unread_data_warnings(cfg, where, set_explicitly)


def generation_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """The generation backends TRL offers beside generate: vLLM (vllm_rules); continuous batching samples
    from torch's stream, so not where a completion must be the policy's whatever its batch (the strategies'
    lockstep, the turns of a tool rollout, image inputs). On a CPU both are refused by strategies/cpu.py."""
    rl, found = cfg.rl, []
    if rl.use_vllm:
        found += vllm_rules(cfg, where)
    if rl.use_transformers_continuous_batching:
        from overdrive.resolving.composition import is_vision
        from overdrive.strategies import registry

        beside = [k for k, on in (("rl.tools", bool(rl.tools)), ("rl.environment", bool(rl.environment)),
                                  ("model.name_or_path", is_vision(cfg)),
                                  ("parallel.strategy", not registry.of(cfg).holds_whole_model(cfg))) if on]
        if beside:
            found.append(Problem("rl.use_transformers_continuous_batching", f"continuous batching generates one "
                                 f"turn of text from an unsharded policy; {beside[0]} asks for more",
                                 where("rl.use_transformers_continuous_batching"),
                                 "remove rl.use_transformers_continuous_batching (the default sampler runs them)"))
    return found


def vllm_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """rl.use_vllm: the package is here (a CPU is refused by strategies/cpu.py), and the rollout is one turn of
    text. TRL's GRPOTrainer runs tools, environments and images through vLLM too; overdrive's vLLM path
    (training/generation/vllm_sampling.py) does not carry a tool turn's or an image's inputs yet."""
    from overdrive.resolving.composition import is_vision

    rl, found = cfg.rl, []
    if importlib.util.find_spec("vllm") is None:  # found, not imported: importing it initialises CUDA
        found.append(Problem("rl.use_vllm", "generation with vLLM needs the vllm package, which is not installed "
                             "here", where("rl.use_vllm"), "pip install 'overdrive[vllm]' on a machine with CUDA GPUs, "
                             "or remove rl.use_vllm (overdrive's own sampler generates)"))
    beside = [k for k, on in (("rl.tools", bool(rl.tools)), ("rl.environment", bool(rl.environment)),
                              ("model.name_or_path", is_vision(cfg))) if on]
    if beside:
        found.append(Problem("rl.use_vllm", f"overdrive generates one turn of text with vLLM; {beside[0]} asks for "
                             "more (tool turns, an environment or images, which TRL runs through vLLM and overdrive "
                             "does not yet)", where(beside[0]),
                             f"remove rl.use_vllm (overdrive's own sampler runs {beside[0]}), or remove {beside[0]}"))
    if rl.vllm_mode == "colocate" and cfg.launch.num_processes % rl.vllm_tensor_parallel_size:
        found.append(Problem("rl.vllm_tensor_parallel_size", f"{rl.vllm_tensor_parallel_size} GPUs per vLLM engine "
                             f"do not divide the {cfg.launch.num_processes} processes", where("rl.vllm_tensor_parallel_size"),
                             "set rl.vllm_tensor_parallel_size to a divisor of launch.num_processes"))
    return found


def loss_rules(cfg: RunConfig, where: Callable[[str], str], set_explicitly: Callable[[str], bool]) -> list[Problem]:
    """The GRPO family's settings agree: GSPO is the sequence-level ratio, CISPO's cap is asked for."""
    rl, found = cfg.rl, []
    if rl.loss_type == "gspo" and set_explicitly("rl.importance_sampling_level") and \
            rl.importance_sampling_level == "token":
        found.append(Problem("rl.importance_sampling_level", "rl.loss_type=gspo is the sequence-level importance "
                             "ratio; a token-level one is grpo", where("rl.importance_sampling_level"),
                             "remove rl.importance_sampling_level, or set rl.loss_type=grpo"))
    if rl.loss_type == "cispo" and rl.epsilon_high is None:
        # TRL falls back to epsilon (0.2) as CISPO's cap on the ratio: every token's weight would be cut to 0.2.
        found.append(Problem("rl.epsilon_high", "rl.loss_type=cispo clips the importance ratio at rl.epsilon_high "
                             "(its ε_max), which is not set (rl.epsilon, 0.2, would cap every ratio near 1 at 0.2)",
                             where("rl.loss_type"), "set rl.epsilon_high=5.0 (the ScaleRL paper's, TRL's advice)"))
    if rl.baseline == "leave_one_out" and rl.multi_objective_aggregation == "normalize_then_sum":
        found.append(Problem("rl.baseline", "normalize_then_sum (GDPO) centres each reward on its group's mean and "
                             "the sum on the batch's; a leave-one-out baseline has no place in it (TRL's RLOO sums "
                             "the rewards first)", where("rl.baseline"),
                             "set rl.multi_objective_aggregation=sum_then_normalize, or rl.baseline=group_mean"))
    return found


def tool_warnings(cfg: RunConfig, where: Callable[[str], str], set_explicitly: Callable[[str], bool]) -> list[Problem]:
    """Knobs of a tool-calling rollout set without a tool: they do nothing."""
    stray = [k for k in ("rl.max_tool_calling_iterations", "rl.tool_timeout_s") if set_explicitly(k)]
    if cfg.rl.tools or cfg.rl.environment or not stray:
        return []
    return [Problem(stray[0], "applies to tool calls only (rl.tools is empty)", where(stray[0]),
                    "add rl.tools (or rl.environment), or remove the key")]


def unread_data_warnings(cfg: RunConfig, where: Callable[[str], str],
                         set_explicitly: Callable[[str], bool]) -> list[Problem]:
    """Data keys a prompt set is not read by (data/prompts.py reads every row of data.split, holds none
    out): set, they would seem to bound the prompts or to evaluate on some."""
    return [Problem(key, f"does nothing under rl.method={cfg.rl.method}: every prompt of data.split is read and "
                    "none is held out (there is no validation split for RL prompts yet)", where(key),
                    f"remove {key} (to train on fewer prompts, give a smaller prompt file)")
            for key, on in (("data.validation_split", True), ("data.validation_fraction", cfg.data.validation_fraction > 0),
                            ("data.max_bytes", True)) if on and set_explicitly(key)]


def reference_rules(cfg: RunConfig, where: Callable[[str], str]) -> list[Problem]:
    """A KL term needs a reference: the adapter switched off, or a whole frozen copy per rank (not where the
    strategy shards the policy)."""
    from overdrive.strategies import registry

    if cfg.rl.beta == 0.0 or cfg.peft.method != "none":
        if cfg.rl.beta != 0.0 and cfg.peft.adapter_path:
            return [Problem("rl.beta", "with the adapter in peft.adapter_path switched off the reference would be the "
                            "bare base, not the model the run starts from", where("peft.adapter_path"),
                            "merge the adapter into its base (`overdrive merge`) and train a new one, or set rl.beta=0")]
        return []
    strategy = registry.of(cfg)
    if strategy.holds_whole_model(cfg):
        return []
    return [Problem("rl.beta", f"a KL to the reference with every parameter trained needs a frozen copy of the model; "
                    f"under {strategy.label(cfg)} the policy is sharded and a whole copy would not be",
                    where("rl.beta"), "set rl.beta=0 (no reference, TRL's default), or peft.method=lora (the base "
                    "model is the reference)")]
