"""What composes, as a page users read: docs/compatibility.md, generated from the rules
`explain` and `train` apply (resolving/composition.py's table and every other rule of resolve),
so the page cannot say what the commands do not.

    python -m overdrive.resolving.compatibility > docs/compatibility.md

Each cell resolves the combination as `overdrive explain` would (on GPUs: `launch.gpus_per_machine`
set) and adds the CPU rules a CPU run meets (strategies/cpu.py).
"""

from __future__ import annotations

from overdrive.errors import UserError
from overdrive.resolving import composition
from overdrive.resolving.resolve import resolve

PRETRAINED = ["model.name_or_path=org/pretrained-model", "model.from_scratch=false"]
OBJECTIVES = {  # name: the keys that ask for it
    "text": [*PRETRAINED],
    "chat": [*PRETRAINED, "data.format=chat", "data.packing=false"],
    "classification": [*PRETRAINED, "model.task=sequence-classification", "data.format=csv",
                       "data.source=reviews.csv"],
    "dpo": [*PRETRAINED, "data.format=preference", "preference.method=dpo", "data.packing=false",
            "preference.precompute_reference=true"],
    "orpo": [*PRETRAINED, "data.format=preference", "preference.method=orpo", "data.packing=false"],
    "simpo": [*PRETRAINED, "data.format=preference", "preference.method=simpo", "data.packing=false"],
    "kto": [*PRETRAINED, "data.format=preference", "preference.method=kto", "data.packing=false"],
    "grpo": [*PRETRAINED, "data.format=prompts", "rl.method=grpo", "rl.num_generations=2",
             "rl.reward_funcs=[{function: length, target_length: 8}]"],
    "grpo + tools": [*PRETRAINED, "data.format=prompts", "rl.method=grpo", "rl.num_generations=2",
                     "rl.reward_funcs=[{function: length, target_length: 8}]", "rl.tools=[my_tools:calculator]"],
    "grpo + environment": [*PRETRAINED, "data.format=prompts", "rl.method=grpo", "rl.num_generations=2",
                           "rl.environment=my_env:LookupEnv"],
    "reward": [*PRETRAINED, "data.format=preference", "preference.method=reward", "data.packing=false",
               "model.task=sequence-classification"],
    "distill": [*PRETRAINED, "distill.teacher=org/larger-model"],
}
LAYOUTS = {  # name: (processes, keys)
    "1 process": (1, []),
    "DDP": (2, ["parallel.strategy=ddp"]),
    "ZeRO-2": (2, ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=2"]),
    "ZeRO-3": (2, ["parallel.strategy=deepspeed", "parallel.deepspeed.zero_stage=3"]),
    "FSDP2": (2, ["parallel.strategy=fsdp"]),
    "HSDP": (4, ["parallel.strategy=fsdp", "parallel.dp_replicate_size=2", "parallel.dp_shard_size=2"]),
    "TP": (2, ["parallel.strategy=ddp", "parallel.tp_size=2"]),
    "FSDP2 x TP": (4, ["parallel.strategy=fsdp", "parallel.tp_size=2"]),
    "CP": (2, ["parallel.strategy=fsdp", "parallel.cp_size=2"]),
    "SP": (2, ["parallel.strategy=deepspeed", "parallel.sp_size=2"]),
    "PP": (2, ["parallel.pp_size=2"]),
    "PP x FSDP2": (4, ["parallel.strategy=fsdp", "parallel.pp_size=2"]),
    "EP": (2, ["parallel.strategy=ddp", "parallel.ep_size=2"]),
    "EP x FSDP2": (4, ["parallel.strategy=fsdp", "parallel.ep_size=2"]),
}
ADAPTERS = {"none": [], "LoRA": ["peft.method=lora"], "QLoRA": ["peft.method=qlora"]}


VISION = ["model.vision.enabled=true"]  # a vision-language model (docs/vision.md)


def verdict(objective: str, layout: str, adapter: str, extra: tuple[str, ...] = ()) -> str:
    """`runs`, `GPU` (runs on CUDA GPUs; refused on CPU by the key named) or `no: KEY`."""
    processes, keys = LAYOUTS[layout]
    items = [*OBJECTIVES[objective], *keys, *ADAPTERS[adapter], *extra, f"launch.num_processes={processes}",
             "training.micro_batch_size=2", "launch.gpus_per_machine=" + str(processes)]
    try:
        resolved = resolve([], cli=items, env={}, accelerate_default=False)
    except UserError as error:
        return "no: " + ", ".join(sorted({p.key for p in error.problems}))
    from overdrive.strategies import cpu, layout

    loop = layout.loop_problems(resolved.config)  # what `overdrive train`'s loop refuses before it starts
    if loop:
        return "no: " + ", ".join(sorted({p.key for p in loop}))

    on_cpu = resolved.config.model_copy(update={"launch": resolved.config.launch.model_copy(
        update={"use_cpu": True, "gpus_per_machine": None})})
    cpu_keys = sorted({p.key for p in cpu.problems(on_cpu) + composition.problems(on_cpu)})
    return "GPU: " + ", ".join(cpu_keys) if cpu_keys else "runs"


def markdown() -> str:
    lines = ["# What composes", "",
             "Generated from the rules `overdrive explain` and `overdrive train` apply "
             "(`python -m overdrive.resolving.compatibility`); tests/test_composition.py checks it.", "",
             "Each cell: **runs** (on CPU processes and on GPUs, with the one-process losses at the same global "
             "batch), **GPU: key** (runs on CUDA GPUs; on CPU it is refused by that key), or **no: key** "
             "(refused by that key before anything starts, with the fix in the message; sequence parallel is "
             "refused by `overdrive train`, whose loop does not split sequences for Ulysses, and runs in a "
             "Transformers or TRL script under `overdrive launch`). Preference methods are "
             "shown with a precomputed reference where they need one under a sharded strategy "
             "(`preference.precompute_reference`). The EP columns (`parallel.ep_size=2`) are for a mixture of "
             "experts: a dense model is refused by `parallel.ep_size` once its config is read.", ""]
    for adapter in ADAPTERS:
        lines += [f"## Adapter: {adapter}", "", "| objective | " + " | ".join(LAYOUTS) + " |",
                  "|---" * (len(LAYOUTS) + 1) + "|"]
        for objective in OBJECTIVES:
            cells = [verdict(objective, layout, adapter) for layout in LAYOUTS]
            lines.append(f"| {objective} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Vision-language models (docs/vision.md)", "",
              "A model whose config has a vision tower (`model.vision.enabled`, else read from its config), with "
              "LoRA (without an adapter the cells are the same).", "",
              "| objective | " + " | ".join(LAYOUTS) + " |", "|---" * (len(LAYOUTS) + 1) + "|"]
    for objective in OBJECTIVES:
        cells = [verdict(objective, layout, "LoRA", tuple(VISION)) for layout in LAYOUTS]
        lines.append(f"| {objective} | " + " | ".join(cells) + " |")
    lines += ["", "## Why a combination is refused", "",
              "| objectives | with | key | why | fix |", "|---|---|---|---|---|"]
    for row in composition.ROWS:
        lines.append(f"| {', '.join(sorted(row.objectives))} | {row.piece.replace('+', ' and ')} | `{row.key}` | "
                     f"{row.why} | {row.fix} |")
    lines += ["", "Attention: `model.attn_implementation=flash_attention_2` (or `_3`) needs CUDA and the "
              "flash-attn package; where either is missing the run is refused before it starts, with "
              "`model.attn_implementation=sdpa` as the fix.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")
